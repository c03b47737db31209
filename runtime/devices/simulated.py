"""The simulated device of the model checker: the scripted model of the recording device, fast
and silent, with a finite block pool, injected faults, and a check of every call's arguments.

It answers every call by the same rules as the recording device (``ScriptedDevice``), keeps a
strict block pool (growing past it is KV exhaustion on a decode and a fault elsewhere), refuses
calls on sequences that are not allocated, and can fail scheduled calls. It records no trace; it
keeps what the invariants need: the pool, the slots, each sequence's KV length, the drafts it saw
accepted and the longest KV written per request, the prefix-cache hits it reported, and whom the last failed call blamed.

It is made of layers, one module per concern, each a class over the one below: ``sim_base``
(``SimBase``: the state, the strict block pool, refusals and blame, the EP words),
``sim_sequences`` (allocation, slots, spill files, the prefix cache, the SSM snapshot ring,
adapters), ``sim_sampling`` (sampled rows), ``sim_prompts`` (prompt writes), ``sim_decodes``
(plain decodes and decodes answered ahead), ``sim_proposals`` (hidden rows, proposals and their
checkpoints) and this module, the verifies and what they leave to commit.

**The device is the judge of its own arguments.** Every bookkeeping call is checked against the
device's own state and a mismatch raises ``ArgumentError`` (a ``DeviceError`` subclass the
checker reports as ``device_refused``, never a fault the scheduler may absorb):

- prompt writes (``prefill``, chunks, slices): a fresh sequence for a whole prefill; a slice
  starts where the KV ends (the chunks cover the prompt once, in order), is not empty, ends
  inside the prompt, says ``last`` exactly when it reaches the prompt's end, and keeps its chunk
  budget (specs/scheduler.md §5.10, §5.13): chunk 0 at most ``max_batch_tokens``, and at most
  ``max_prefill_tokens`` when another sequence is on the device; later chunks at most
  ``max_prefill_tokens``, a non-last one of 4+ tokens a multiple of 4;
- ``truncate_sequence`` never lengthens the KV;
- a verify (and a plain ``decode_batch``, one row each) remembers, per sequence, its rows and the KV
  length before it; ``commit_accepted_prefix``
  commits at most those rows (and ``na <= k``), ``commit_ctx`` commits at most those rows from that
  base, ``trim_proposer_state`` trims to at most those rows, ``gdn_fold_accepted`` folds only live
  slots, once each, with ``1 <= accepted <= k``;
- hidden-row reads (``save_hidden_for_mtp``, ``stash_verify_hidden_rows``,
  ``stash_verify_catchup_rows``) name rows of the last forward; ``save_hidden_for_mtp_from_stash``
  an index of the last stash;
- proposals are asked at the sequence's next position (``pos == seq_len``), batched ones once per
  live sequence; a catch-up names distinct stash slots (4·i), at most 4 drafts each;
- a serial verify of fixed width gets exactly that many tokens (K = 2 / 3 / 4, the fused K = 4),
  a DFlash block verify five or more; a speculative verify (serial or batched) feeds the anchor
  then a prefix of the drafts the device itself last proposed for the sequence, and in a proposer
  mode (``strict_drafts``) none comes without a proposal since the sequence's allocation or last
  verify, none verifies a sequence twice in a tick, and (MTP) none takes a proposal of its own
  tick; ``commit_accepted_prefix`` commits exactly the drafts that verify accepted + 1, counted
  from its own inputs and rows; ``rollback_ssm_states`` rolls back exactly the rows the KV kept
  past the verify's base; a catch-up's position is ``seq_len − len(tokens)`` of the batch's
  sequence its stash slot names;
- an MTP proposal follows a hidden-row save since the last forward, from the stash entry of its
  own sequence when it came from the stash; the checkpoint after a proposal is the async one after
  a bootstrap decode and the Marconi one after a K = 2 verify, never the async one otherwise;
- ``save_sequence_state`` saves a sequence not saved already; ``restore_sequence_state`` needs a
  saved, sound file (``spill_corrupt_for`` damages one, ``spill_missing_for`` loses it) into a
  fresh sequence;
- the ledgers (``ledger``, specs/checker.md §11.8): slots, adapter slots and spill files are
  acquired and released once each; ``acquire_adapter_slot`` takes the adapter slot of the sequence
  allocated last (its request's, ``adapter_of``) and no forward runs a sequence before it; the EP
  release word names a slot a release freed, a verify's accept word the drafts it accepted; with
  ``wave_budget`` (prefill_new_together) a batched forward of two or more prompts fits
  ``max_batch_tokens``; under the mixed-prefill bound (``mixed_bound``) the chunks of a forward
  beside d decode rows (and a chunk while d prompted sequences are on the device) take at most
  max(floor, per_decode * d) rows.

What a real device varies (the recording device never does, so the goldens stay as they are):
``short_proposals`` (a seed) cuts now and then a proposal's drafts short, to none sometimes;
``late_drafts`` (a seed) answers now and then a proposal with ``LATE_DRAFT`` placeholders, as the
torch device does (specs/async.md §16.3), and fills them in at the verify that consumes them; now
and then (``sim_proposals.LATE_FAILURE_CHANCE`` of the late ones) such a proposal fails after its answer went
out, and the verify that consumes its drafts answers that failure;
``keep_decodes`` (a seed) keeps a plain decode's tokens on the device when its plan allows it
(``keep_ahead``: the decode is answered ahead, specs/async.md §16.6), feeds them to the next decode
(``LATE_TOKEN`` inputs) and gives them back at ``read_ahead``; now and then
(``sim_decodes.AHEAD_FAILURE_CHANCE`` of the decodes kept) such a decode fails after its answer went
out, and the read of its tokens answers that failure;
``capacities`` are the answers of ``mtp_slot_draft_capacity`` in turn (0 included); a
self-speculative draft decode is wrong at the script's ``draft_wrong_every`` positions. The device
keeps for the invariants the drafts it proposed (``proposed``, ``proposed_at``), the capacities it
answered (``capacity_log``) and the last batched verify's sequences (``batch_seqs``).
"""

from __future__ import annotations

from typing import Optional

from fxsched.runtime.devices.sim_base import _agreed
from fxsched.runtime.devices.sim_proposals import SimProposals


class SimDevice(SimProposals):
    """Implements the Device protocol for the random walk and the hypothesis machine."""

    # --- verifies and what they leave to commit -------------------------------------------------------

    WIDTHS = {"decode_verify_graphed": 2, "decode_verify_graphed_k3": 3, "decode_verify_graphed_k4": 4,
              "decode_and_verify_fused": 4}
    """The verifies of a fixed width (anchor + drafts)."""

    def _check_drafts(self, call: str, seq: int, tokens) -> None:
        """A verify after a proposal feeds the anchor then a prefix of the drafts that proposal
        returned (specs/speculation.md §6.5: keep ≤ the drafts held; the surplus is dropped)."""
        drafts = self.proposed.pop(seq, None)
        at = self.proposed_at.pop(seq, None)
        self.verify_tick = self.tick
        if self.strict_drafts:
            if self.verified_tick.get(seq) == self.tick:
                raise self._bad(call, f"sequence {seq} verified twice in tick {self.tick}")
            if at == self.tick and not self.dflash:  # an MTP bootstrap is verified from the next step on
                raise self._bad(call, f"sequence {seq} verifies the drafts proposed in this step (tick {self.tick})")
        self.verified_tick[seq] = self.tick
        self.last_forward[seq] = call
        self.hidden_saved = False
        if drafts is None:
            if self.strict_drafts and len(tokens) > 1:
                raise self._bad(call, f"inputs {list(tokens)} for sequence {seq}, which has no proposal since its "
                                      f"allocation or last verify")
        elif list(tokens[1:]) != drafts[:len(tokens) - 1]:
            raise self._bad(call, f"inputs {list(tokens)} for sequence {seq}, whose proposal was {drafts}")

    def serial_verify(self, name: str, seq: int, tokens) -> list[int]:
        s = self._seq(seq)
        width = self.WIDTHS.get(name)
        if width is not None and len(tokens) != width:
            raise self._bad(name, f"{len(tokens)} tokens for a width-{width} verify")
        if name == "decode_verify_dflash" and len(tokens) < 5:  # keep >= 4 (specs/speculation.md §6.5)
            raise self._bad(name, f"a block verify of {len(tokens) - 1} drafts (four or more take it)")
        held = self.proposed.get(seq)  # DFlash keeps every draft: four or more take the block verify, not a K one
        if self.dflash and held is not None and len(held) >= 4 and name.startswith("decode_verify_graphed"):
            raise self._bad(name, f"sequence {seq} holds {len(held)} drafts, which take the DFlash block verify")
        self._adapted(name, (seq,))
        self._runs(name, verifies=((seq, tokens),))  # the EP words announced the inputs as the query holds them
        tokens = self._resolve(name, seq, tokens)
        if name != "decode_verify":
            self._check_drafts(name, seq, tokens)
        self.blamed = frozenset((self._rid(s),))
        self._ctx_committed(name, seq)
        self.verified[seq] = (len(tokens), s.seq_len)
        rows = super().serial_verify(name, seq, tokens)
        if self.dflash and len(tokens) >= 3 and name != "decode_verify":
            self.ctx_owed.add(seq)
        self.verify_io[seq] = (tuple(tokens), tuple(rows))
        self.verify_order = ((seq, name != "decode_verify"),)
        self.blamed = None
        return rows

    def _accepted(self, seq: int) -> Optional[int]:
        """The drafts the last verify of ``seq`` accepted, from its own inputs and rows (None: no
        verify since the last plain decode)."""
        io = self.verify_io.get(seq)
        return None if io is None else _agreed(*io)

    def decode_verify_batched(self, tokens, ks, seqs, stream: int, woa: bool) -> list[int]:
        if len(set(seqs)) != len(seqs) or len(ks) != len(seqs) or sum(ks) != len(tokens):
            raise self._bad("decode_verify_batched", f"ks={list(ks)} seqs={list(seqs)} for {len(tokens)} tokens")
        self._adapted("decode_verify_batched", seqs)
        self._blame(seqs)
        verifies, offset = [], 0
        for k, seq_id in zip(ks, seqs, strict=True):
            verifies.append((seq_id, tokens[offset:offset + k]))
            offset += k
        self._runs("decode_verify_batched", verifies=tuple(verifies))
        tokens = tuple(t for seq_id, run in verifies for t in self._resolve("decode_verify_batched", seq_id, run))
        offset = 0
        for k, seq_id in zip(ks, seqs, strict=True):
            self.verified[seq_id] = (k, self._seq(seq_id).seq_len)
            self._check_drafts("decode_verify_batched", seq_id, tokens[offset:offset + k])
            offset += k
        rows = super().decode_verify_batched(tokens, ks, seqs, stream, woa)
        offset = 0
        for k, seq_id in zip(ks, seqs, strict=True):
            self.verify_io[seq_id] = (tuple(tokens[offset:offset + k]), tuple(rows[offset:offset + k]))
            offset += k
        self.batch_seqs = tuple(seqs)
        self.verify_order = tuple((seq_id, True) for seq_id in seqs)
        self.blamed = None
        return rows

    def _verified(self, call: str, seq: int) -> tuple[int, int]:
        self._seq(seq)
        got = self.verified.get(seq)
        if got is None:
            raise self._bad(call, f"sequence {seq} has no verify to commit")
        return got

    def commit_accepted_prefix(self, seq: int, na: int, k: int) -> None:
        self._ctx_committed("commit_accepted_prefix", seq)
        rows, _ = self._verified("commit_accepted_prefix", seq)
        if not 0 <= na <= min(k, rows):
            raise self._bad("commit_accepted_prefix", f"na={na}, k={k} for sequence {seq}, whose verify had {rows} rows")
        accepted = self._accepted(seq)
        if accepted is not None and na != accepted + 1:
            raise self._bad("commit_accepted_prefix", f"na={na} for sequence {seq}, whose verify accepted {accepted} "
                                                      f"drafts (commit accepted + 1)")
        super().commit_accepted_prefix(seq, na, k)

    def commit_ctx(self, seq: int, n: int, base: int, row: int) -> None:
        rows, before = self._verified("commit_ctx", seq)
        if not 1 <= n <= rows or base != before:
            raise self._bad("commit_ctx", f"n={n}, base={base} for sequence {seq}, whose verify had {rows} rows "
                                          f"from {before}")
        self.ctx_owed.discard(seq)
        super().commit_ctx(seq, n, base, row)

    def trim_proposer_state(self, seq: int, na: int, stream: int) -> None:
        self._ctx_committed("trim_proposer_state", seq)
        rows, _ = self._verified("trim_proposer_state", seq)
        if not 0 <= na <= rows:
            raise self._bad("trim_proposer_state", f"na={na} for sequence {seq}, whose verify had {rows} rows")
        accepted = self._accepted(seq)
        if accepted is not None and na != accepted:  # the proposer keeps the accepted drafts' state
            raise self._bad("trim_proposer_state", f"na={na} for sequence {seq}, whose verify accepted {accepted} "
                                                   f"drafts (speculation.md §6.6-§6.12: trim to the accepted)")
        super().trim_proposer_state(seq, na, stream)

    def gdn_fold_accepted(self, slots, accepted, k: int) -> bool:
        live = {s.slot for s in self.live.values()}
        if (len(slots) != len(accepted) or len(set(slots)) != len(slots) or not set(slots) <= live
                or any(not 1 <= a <= k for a in accepted)):
            raise self._bad("gdn_fold_accepted", f"slots={list(slots)} accepted={list(accepted)} k={k}, "
                                                 f"live slots {sorted(live)}")
        return super().gdn_fold_accepted(slots, accepted, k)

    def rollback_ssm_states(self, seq: int, n: int) -> None:
        """Roll the SSM state back to ``n`` steps past the last verify's base, which is where the
        KV now ends (the truncate came first)."""
        s = self._seq(seq)
        _, before = self._verified("rollback_ssm_states", seq)
        if n != s.seq_len - before:
            raise self._bad("rollback_ssm_states", f"n={n} for sequence {seq}, which holds {s.seq_len - before} "
                                                   f"tokens past its verify's base {before}")
        super().rollback_ssm_states(seq, n)
