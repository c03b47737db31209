"""``EpLeaderDevice``: rank 0 of an expert-parallel group, wrapped around any Device.

Every call goes to ``inner``, which alone records the trace (the wrapper adds no line, so the
trace is the single-rank trace byte for byte). Besides:

* each ``ep_*`` call also goes to the workers, word for word (after ``inner`` recorded it);
* each forward or sequence change the words do not announce goes out as one of the leader's own
  messages (protocol kinds 5-9), after ``inner`` carried it out; a forward that its words
  announced (a prefill preamble, a decode word, a K-verify) is not announced twice;
* every ``-- tick N`` read sends TICK with the digest of the leader's mirror (fed the same
  messages through the workers' own parser and mirror), and keeps the snapshot in
  ``tick_snapshots``;
* before a model answer is read (a readback, a verify, a proposal, ``decode_batch``), if anything
  was sent since the last one, SYNC: every worker must ack within ``timeout_s``.

Sampling. The interpreter lets a device pick sampled rows itself when the device's class defines
``sample_rows`` (runtime/interpreter.py, specs/runner.md §4.3); attribute forwarding does not
count. So ``EpLeaderDevice(inner, ...)`` builds an ``EpSamplingLeaderDevice`` when ``inner``'s class
has ``sample_rows`` (the torch device): it syncs as the host copy would and then asks ``inner``,
so the picks are those of a single-rank run (and so are the rejection-sampled verifies,
``sample_verify``). Around the recording device the leader stays the
plain class, and the trace keeps its host copies.

Experts: with a sharded MoE model, ``experts`` is the run's ``ExpertGroup`` (runtime/ep/experts.py),
whose layer calls go out inside the forwards that ``inner`` runs (they are not messages of the
command stream); a model answer after layer calls is preceded by a SYNC like one after messages,
so a worker's failed expert computation is known before any token is read.

Failure: a broadcast that fails, an ack that does not come in time, a failed expert call, or a
worker that reports an error puts the leader in ``failure`` (a clear message, e.g. ``EP worker 1
did not answer within 5s``). From then on nothing more is sent; every model-answer call raises ``DeviceError(failure)``,
so the interpreter fails the requests in flight with that message (``DeviceFault``) instead of
waiting; the run ends, and the caller checks ``failure``. The shutdown word raises it too.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Optional

import structlog

from fxsched.core.events import LATE_DRAFT
from fxsched.effects.ep_words import SHUTDOWN_CMD
from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.ep.link import LeaderLink, LinkError
from fxsched.runtime.ep.mirror import EpMirror, Snapshot
from fxsched.runtime.ep.protocol import (
    CommandParser,
    Decode,
    Kind,
    Message,
    Prefill,
    Rows,
    Verify,
    pack_rows,
)

if TYPE_CHECKING:
    from fxsched.runtime.ep.experts import ExpertGroup

log = structlog.get_logger("fxsched.ep")

def _no_late_drafts(call: str, tokens) -> None:
    """The EP words carry a verify's inputs to the workers, so the leader's device must read its
    drafts back (TorchDevice without late_drafts, specs/async.md §16.3)."""
    if LATE_DRAFT in tokens:
        raise DeviceError(f"{call}: a late draft reached the expert-parallel leader, whose words carry every input")


class EpLeaderDevice:
    def __new__(cls, inner, *args, **kwargs):
        if cls is EpLeaderDevice and callable(getattr(type(inner), "sample_rows", None)):
            cls = EpSamplingLeaderDevice
        return super().__new__(cls)

    def __init__(self, inner, group: LeaderLink, timeout_s: float):
        self.inner = inner
        self.link = group
        self.timeout_s = timeout_s
        self.parser = CommandParser()
        self.mirror = EpMirror()
        self.failure: Optional[str] = None
        self.tick_snapshots: list[tuple[int, Snapshot]] = []
        self.worker_reports: dict[int, dict] = {}
        self.shut_down = False
        self.messages = 0
        self._slot_of: dict[int, int] = {}  # scheduler sequence id -> slot
        self._spilled: dict[int, tuple[int, ...]] = {}  # sequence id -> tokens at its spill
        # the last word command, until a forward consumes it
        self._announced: Optional[Prefill | Decode | Verify] = None
        self._unacked = False
        self.experts: Optional[ExpertGroup] = None
        self._expert_calls_acked = 0  # layer calls the last completed SYNC covered
        self._syncs = 0
        self._occupancy_reads = 0

    def __getattr__(self, name: str):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # --- sending ------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self.failure is None and not self.shut_down

    def _send(self, kind: Kind, a: int = 0, b: int = 0, payload=()) -> None:
        """Feed the leader's mirror, then the workers (unless the group failed or stopped)."""
        self.messages += 1
        message = Message(kind, a, b, payload, self.messages)
        command = self.parser.feed(message)
        if command is not None:
            if isinstance(command, (Prefill, Decode, Verify)):
                self._announced = command
            self.mirror.apply(command)
        if not self.healthy:
            return
        try:
            self.link.send(message)
        except LinkError as err:
            self._fail(str(err))
            return
        self._unacked = True

    def _fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
            log.info("ep_group_failed", message=message)  # the caller reports it (EpRunError, DeviceFault)

    def _sync(self) -> None:
        """Every worker has taken everything sent so far, or DeviceError(failure)."""
        calls = self.experts.calls if self.experts is not None else 0
        if self.healthy and (self._unacked or calls != self._expert_calls_acked):
            self._syncs += 1
            self._send(Kind.SYNC, self._syncs)
            if self.healthy:
                try:
                    acks = self.link.collect(f"sync/{self._syncs}", self.timeout_s)
                except LinkError as err:
                    self._fail(str(err))
                else:
                    self._unacked = False
                    self._expert_calls_acked = calls
                    for rank, status in sorted(acks.items()):
                        if status != b"ok":
                            self._fail(f"EP worker {rank} failed: {status.decode(errors='replace')}")
        if self.failure is not None:
            raise DeviceError(self.failure)

    def _rows(self, rows: list[Rows], committed: bool, draft: bool = False) -> None:
        if rows:
            kind = Kind.ROWS if committed else Kind.PENDING_ROWS
            self._send(kind, 1 if draft else 0, 0, pack_rows(rows))

    def _slot(self, seq: int) -> int:
        try:
            return self._slot_of[seq]
        except KeyError:
            raise DeviceError(f"unknown sequence {seq}") from None

    def _at_end(self, seq: int, tokens) -> Rows:
        slot = self._slot(seq)
        return Rows(slot, self.mirror.length(slot), tokens)

    def _announcement(self):
        taken, self._announced = self._announced, None
        return taken

    def stop_workers(self) -> None:
        """Send the shutdown word without a trace line (a run that ended before ``EpShutdown``)."""
        if self.healthy:
            self._send(Kind.CMD_FOR_SEQ, 0, SHUTDOWN_CMD)
            self._collect_reports()

    def _collect_reports(self) -> None:
        if not self.healthy:
            return
        self.shut_down = True
        try:
            finals = self.link.collect("final", self.timeout_s)
        except LinkError as err:
            self._fail(str(err))
            return
        for rank, raw in sorted(finals.items()):
            report = json.loads(raw)
            self.worker_reports[rank] = report
            if report.get("error"):
                self._fail(f"EP worker {rank} failed: {report['error']}")

    # --- EP calls -------------------------------------------------------------------------------

    def ep_broadcast_cmd_for_seq(self, seq_slot: int, cmd: int) -> None:
        self.inner.ep_broadcast_cmd_for_seq(seq_slot, cmd)
        healthy = self.healthy
        self._send(Kind.CMD_FOR_SEQ, seq_slot, cmd)
        if cmd == SHUTDOWN_CMD and healthy:
            self._collect_reports()
            if self.failure is not None:
                raise DeviceError(self.failure)

    def ep_broadcast_cmd(self, cmd: int) -> None:
        self.inner.ep_broadcast_cmd(cmd)
        self._send(Kind.CMD, 0, cmd)

    def ep_broadcast_tokens(self, tokens) -> None:
        self.inner.ep_broadcast_tokens(tokens)
        self._send(Kind.TOKENS, 0, 0, tokens)

    def ep_sync_vision_embeds(self, n: int) -> None:
        self.inner.ep_sync_vision_embeds(n)
        self._send(Kind.VISION, n)

    def ssm_snapshot_occupancy(self) -> None:
        self.inner.ssm_snapshot_occupancy()
        self._occupancy_reads += 1
        if self._occupancy_reads % 2 == 1:  # the first read of each pair is a tick (§3.7)
            tick = (self._occupancy_reads + 1) // 2
            snapshot = self.mirror.snapshot()
            self.tick_snapshots.append((tick, snapshot))
            self._send(Kind.TICK, tick, self.mirror.digest())

    # --- sequences ---------------------------------------------------------------------------

    def alloc_sequence(self, seq: int, session: int) -> int:
        slot = self.inner.alloc_sequence(seq, session)
        self._slot_of[seq] = slot
        return slot

    def alloc_sequence_for(self, seq: int, session: int, budget: int) -> int:
        slot = self.inner.alloc_sequence_for(seq, session, budget)
        self._slot_of[seq] = slot
        return slot

    def free_sequence(self, seq: int) -> None:
        self.inner.free_sequence(seq)
        self._slot_of.pop(seq, None)  # the release word that follows empties the slot

    def compact_sequence(self, seq: int, new_slot: int) -> None:
        old = self._slot_of.get(seq)
        self.inner.compact_sequence(seq, new_slot)
        if old is not None and new_slot != old:
            self._slot_of[seq] = new_slot
            self._send(Kind.MOVE, old, new_slot)

    def save_sequence_state(self, seq: int) -> None:
        self.inner.save_sequence_state(seq)
        self._spilled[seq] = tuple(self.mirror.tokens(self._slot(seq)))

    def restore_sequence_state(self, seq: int, blocks: int) -> None:
        self.inner.restore_sequence_state(seq, blocks)
        tokens = self._spilled.pop(seq, None)
        if tokens is None:
            log.warning("ep_restore_without_spill", seq=seq)
            tokens = ()
        self._send(Kind.RESTORE, self._slot(seq), 0, tokens)

    def truncate_sequence(self, seq: int, seq_len: int) -> None:
        self.inner.truncate_sequence(seq, seq_len)
        slot = self._slot(seq)
        if self.mirror.length(slot) != seq_len:
            self._send(Kind.SET_LEN, slot, seq_len)

    # --- forwards ---------------------------------------------------------------------------------

    def prefill(self, seq: int, tokens, stream: int) -> Optional[int]:
        said = self._announcement()
        cached = self.inner.prefill(seq, tokens, stream)
        slot = self._slot(seq)
        if said != Prefill(slot, 0, len(tokens), tuple(tokens)):
            self._unmatched(said, "prefill", seq)
            self._rows([Rows(slot, 0, tokens)], committed=True)
        return cached

    def prefill_chunk(self, seq: int, prompt, start: int, length: int, last: bool, stream: int) -> Optional[int]:
        said = self._announcement()
        cached = self.inner.prefill_chunk(seq, prompt, start, length, last, stream)
        slot = self._slot(seq)
        if said != Prefill(slot, start, length, tuple(prompt)):
            self._unmatched(said, "prefill_chunk", seq)
            self._rows([Rows(slot, start, prompt[start:start + length])], committed=True)
        return cached

    def decode(self, token: int, seq: int, stream: int) -> None:
        said = self._announcement()
        self.inner.decode(token, seq, stream)
        if said != Decode(self._slot(seq), token):
            self._unmatched(said, "decode", seq)
            self._rows([self._at_end(seq, (token,))], committed=True)

    def decode_draft(self, token: int, seq: int, stream: int) -> None:
        self._announcement()
        self.inner.decode_draft(token, seq, stream)
        self._rows([self._at_end(seq, (token,))], committed=False, draft=True)

    def _slices(self, prefills) -> list[Rows]:
        return [Rows(self._slot(sl.seq), sl.start, sl.prompt[sl.start:sl.start + sl.length]) for sl in prefills]

    def mixed_forward(self, decode_tokens, decode_seqs, prefill, stream: int):
        self._announcement()
        hits = self.inner.mixed_forward(decode_tokens, decode_seqs, prefill, stream)
        decodes = [self._at_end(s, (t,)) for t, s in zip(decode_tokens, decode_seqs, strict=True)]
        self._rows(decodes + self._slices([prefill]), committed=True)
        return hits

    def mixed_forward_batch(self, decode_tokens, decode_seqs, prefills, stream: int):
        self._announcement()
        hits = self.inner.mixed_forward_batch(decode_tokens, decode_seqs, prefills, stream)
        decodes = [self._at_end(s, (t,)) for t, s in zip(decode_tokens, decode_seqs, strict=True)]
        self._rows(decodes + self._slices(prefills), committed=True)
        return hits

    def prefill_batch_chunk(self, prefills, stream: int):
        self._announcement()
        hits = self.inner.prefill_batch_chunk(prefills, stream)
        self._rows(self._slices(prefills), committed=True)
        return hits

    def decode_batch(self, tokens, seqs, stream: int) -> None:
        """A plan's forward: the interpreter turns its DeviceError into the plan's DeviceFault."""
        if self.failure is not None:
            raise DeviceError(self.failure)
        self._announcement()
        self.inner.decode_batch(tokens, seqs, stream)
        self._rows([self._at_end(s, (t,)) for t, s in zip(tokens, seqs, strict=True)], committed=True)
        self._sync()

    def serial_verify(self, name: str, seq: int, tokens) -> list[int]:
        if self.failure is not None:
            raise DeviceError(self.failure)
        _no_late_drafts(name, tokens)
        slot = self._slot(seq)
        start = self.mirror.length(slot)
        said = self._announcement()
        rows = self.inner.serial_verify(name, seq, tokens)
        if said != Verify(slot, tuple(tokens)):
            self._unmatched(said, name, seq)
            self._rows([Rows(slot, start, tokens)], committed=False)
        self._sync()
        return rows

    def verify_inputs(self) -> list[int]:
        return self.inner.verify_inputs()

    def decode_verify_batched(self, tokens, ks, seqs, stream: int, woa: bool) -> list[int]:
        if self.failure is not None:
            raise DeviceError(self.failure)
        _no_late_drafts("decode_verify_batched", tokens)
        starts = [self.mirror.length(self._slot(s)) for s in seqs]
        self._announcement()
        rows = self.inner.decode_verify_batched(tokens, ks, seqs, stream, woa)
        groups, offset = [], 0
        for seq, k, start in zip(seqs, ks, starts, strict=True):
            groups.append(Rows(self._slot(seq), start, tokens[offset:offset + k]))
            offset += k
        self._rows(groups, committed=False)
        self._sync()
        return rows

    def _unmatched(self, said, call: str, seq: int) -> None:
        if said is not None:
            log.warning("ep_announcement_unmatched", call=call, seq=seq, announced=repr(said))

    # --- model answers: the workers must have kept up ---------------------------------------------

    def argmax_on_device(self, row: int, stream: int) -> int:
        self._sync()
        return self.inner.argmax_on_device(row, stream)

    def argmax_batch(self, row: int, n: int, stream: int) -> list[int]:
        self._sync()
        return self.inner.argmax_batch(row, n, stream)

    def copy_logits_to_host(self, row: int, off: int, nbytes: int) -> bytes:
        self._sync()
        return self.inner.copy_logits_to_host(row, off, nbytes)

    def run_mtp_propose_multi(self, token: int, pos: int, n: int, seq: int, stream: int, mask: bool) -> list[int]:
        self._sync()
        return self.inner.run_mtp_propose_multi(token, pos, n, seq, stream, mask)

    def run_mtp_propose_batched(self, tokens, positions, stash, n: int, seqs, stream: int) -> list[list[int]]:
        self._sync()
        return self.inner.run_mtp_propose_batched(tokens, positions, stash, n, seqs, stream)

    def generate_beam_batch(self, prompts, num_beams) -> list[list[int]]:
        self._sync()
        return self.inner.generate_beam_batch(prompts, num_beams)


class EpSamplingLeaderDevice(EpLeaderDevice):
    """The leader around a device that samples rows itself (see the module docstring)."""

    def sample_rows(self, row: int, n: int, picks, eos_ids):
        """The workers first take everything sent (as before ``copy_logits_to_host``), then
        ``inner`` picks the rows."""
        self._sync()
        return self.inner.sample_rows(row, n, picks, eos_ids)

    def sample_verify(self, picks, eos_ids) -> list[int]:
        """The last verify's rows by rejection sampling (specs/speculation.md §6.16): ``inner``'s,
        on rank 0's logits; the workers learn the kept rows from the commits that follow."""
        if self.failure is not None:
            raise DeviceError(self.failure)
        return self.inner.sample_verify(picks, eos_ids)
