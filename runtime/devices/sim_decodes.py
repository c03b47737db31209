"""The simulated device's decodes: ``SimDecodes``, the layer of ``simulated.SimDevice`` that checks
and runs plain decodes (each one row, remembered for its commit), single and self-speculative
draft decodes, and decodes answered ahead (specs/async.md §16.6): with ``keep_decodes`` (a seed) a
plain decode's tokens stay on the device when its plan allows it (``keep_ahead``), are fed to the
next decode (``LATE_TOKEN`` inputs) and given back at ``read_ahead``; now and then
(``AHEAD_FAILURE_CHANCE`` of the decodes kept) such a decode fails after its answer went out, and
the read of its tokens answers that failure."""

from __future__ import annotations

from fxsched.core.events import LATE_TOKEN
from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.devices.sim_prompts import SimPrompts

AHEAD_FAILURE = "the decode answered ahead"  # how the fault of a read of its lost tokens begins its reason
AHEAD_FAILURE_CHANCE = 0.02  # of the decodes answered ahead


class SimDecodes(SimPrompts):
    """The decodes of ``SimDevice``, answered ahead too."""

    def decode_batch(self, tokens, seqs, stream: int) -> None:
        if len(set(seqs)) != len(seqs):
            raise self._bad("decode_batch", f"a sequence appears twice in {list(seqs)}")
        self._adapted("decode_batch", seqs)
        tokens = self._fed(tuple(tokens), tuple(seqs))
        self._runs("decode_batch", decodes=tuple(zip(tokens, seqs, strict=False)))
        self._blame(seqs)
        self.last_decode = ()
        before = [(i, self._seq(i).seq_len) for i in seqs]
        super().decode_batch(tokens, seqs, stream)
        for i, seq_len in before:  # a plain decode commits one row per sequence (commit_ctx n=1)
            self.verified[i] = (1, seq_len)
            self.verify_io.pop(i, None)
        self.blamed = None
        self.last_decode = tuple(seqs)

    # --- decodes answered ahead (specs/async.md §16.6) -----------------------------------------------

    def _fed(self, tokens: tuple[int, ...], seqs: tuple[int, ...]) -> tuple[int, ...]:
        """A decode's inputs with each ``LATE_TOKEN`` replaced by the token its sequence's last
        decode kept. A sequence that holds a kept token is fed nothing else (its last token is on
        the device), and a ``LATE_TOKEN`` needs a kept token."""
        if not self.kept and LATE_TOKEN not in tokens:
            return tokens
        fed = []
        for token, seq in zip(tokens, seqs, strict=True):
            held = seq in self.kept or seq in self.kept_failed
            if token == LATE_TOKEN:
                if not held or seq in self.fed_kept:
                    raise self._bad("decode_batch", f"sequence {seq} is fed its kept token, but it holds none "
                                                    f"that was not fed already")
                if seq in self.kept:
                    value = self.kept.pop(seq)
                    self.fed_kept[seq] = value
                    fed.append(value)
                else:  # a failed decode's token: the read reports the failure
                    self.fed_kept[seq] = self.kept_failed.pop(seq)
                    fed.append(0)
            elif held or seq in self.fed_kept:
                raise self._bad("decode_batch", f"sequence {seq} holds a kept token but is fed {token}")
            else:
                fed.append(token)
        return tuple(fed)

    def keep_ahead(self, row: int, n: int, picks, eos_ids) -> bool:
        """Keep the tokens of the last decode's rows ``row``.. on the device, picked as the
        interpreter would pick them, and answer it ahead (None for a device without the seed)."""
        rng = self.ahead_rng
        seqs = self.last_decode[row:row + n]
        self._picks_follow_the_rule("keep_ahead", row, picks)
        if any(p.top_logprobs > 0 for p in picks):  # the plan may say ahead only without logprob records
            raise self._bad("keep_ahead", "a decode answered ahead has rows asking for logprob records")
        if rng is None or len(seqs) != n or rng.random() < 0.25:  # now and then answered with the tokens
            return False
        failures = AHEAD_FAILURE_CHANCE if self.ahead_failures is None else self.ahead_failures
        for r, seq in enumerate(seqs):
            answer = self._row(row + r)
            token = self._pick(answer, picks[r], eos_ids) if picks else answer
            if rng.random() < failures:
                self.kept_failed[seq] = f"{AHEAD_FAILURE} of sequence {seq} failed: device error (simulated)"
            else:
                self.kept[seq] = token
        self.decodes_kept += 1
        return True

    def read_ahead(self, seqs, fed=()) -> list[int]:
        """The kept tokens of ``seqs``, forgotten once read; a decode that kept one and then failed
        answers its failure (its tokens are lost, and so is the decode ``fed`` this read answers
        with: the scheduler fails the sequences of both, specs/async.md §16.6)."""
        if len(set(seqs)) != len(seqs):
            raise self._bad("read_ahead", f"a sequence appears twice in {list(seqs)}")
        got: list[int | str] = []
        for s in seqs:  # the token a decode fed is the one to give back, else the one still kept
            if s in self.fed_kept:
                got.append(self.fed_kept.pop(s))
            elif s in self.kept:
                got.append(self.kept.pop(s))
            elif s in self.kept_failed:
                got.append(self.kept_failed.pop(s))
            else:
                raise self._bad("read_ahead", f"sequence {s} holds no kept token (of {list(seqs)})")
        failed = [g for g in got if isinstance(g, str)]
        if failed:  # the decode that kept them failed after its answer: every token read is lost
            self.blamed = frozenset(self._rid(self.live[s]) for s in (*seqs, *fed) if s in self.live)
            raise DeviceError(failed[0])
        return [int(g) for g in got]

    def _single_decode(self, name: str, token: int, seq: int, stream: int, cancel: bool) -> None:
        self._adapted(name, (seq,))
        self._runs(name, decodes=((token, seq),))
        super()._single_decode(name, token, seq, stream, cancel)
        self.last_forward[seq] = name
        self.hidden_saved = False

    def decode_draft(self, token: int, seq: int, stream: int) -> None:
        """A self-speculative draft decode: the script's answer, but wrong (``+ 1 mod (vocab - 1)``)
        at every ``draft_wrong_every``-th generated index, like the proposers' drafts, so the
        verify that follows sometimes rejects and the SSM state is rolled back."""
        super().decode_draft(token, seq, stream)
        s = self._seq(seq)
        script = self._script(s)
        m = script.draft_wrong_every
        if m > 0 and (s.seq_len - script.prompt_len) % m == 0:
            self.rows = [(self.rows[0] + 1) % (self.vocab - 1)]
