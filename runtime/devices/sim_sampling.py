"""The simulated device's sampled rows: ``SimSampling``, the layer of ``simulated.SimDevice`` that
picks a row's token as the host would (``sample_rows``, and the picks of a decode answered ahead)
and a verify's rows under their picks (``sample_verify``, specs/speculation.md §6.16).

Sampled rows: the device offers ``sample_rows``, so the interpreter asks it for a sampled row's
token instead of copying the row to the host; it answers what the host copy would give, by the same
``sampling.host_pick`` over the same row (30.0 at the scripted answer, 0.0 elsewhere), memoised per
(answer, pick), with the row's weights memoised apart from the seed: the walk's seeds and answers
repeat, and a pick is its costliest call. (The
recording device keeps the host copy: its reference traces list ``copy_logits_to_host``.)
"""

from __future__ import annotations

from typing import NamedTuple

from fxsched.effects.device_calls import HostPick
from fxsched.runtime.devices.sampling import draw, pick_weights
from fxsched.runtime.devices.script_rules import script_verify
from fxsched.runtime.devices.sim_base import _agreed
from fxsched.runtime.devices.sim_sequences import SimSequences


class Picked(NamedTuple):
    """What ``SimDevice.sample_rows`` answers: one token per row."""

    tokens: list[int]


_PICKED: dict[tuple, int] = {}
"""(scripted answer, vocabulary size, HostPick, EOS ids) -> the token ``host_pick`` picks from that row."""
_WEIGHED: dict[tuple, int | list[float]] = {}
"""(scripted answer, vocabulary size, the pick's temperature, filters and EOS mask, EOS ids) -> what
``sampling.pick_weights`` makes of that row: picks that differ in their seed alone share it."""


class SimSampling(SimSequences):
    """The sampled rows of ``SimDevice``."""

    def sample_rows(self, row: int, n: int, picks, eos_ids) -> Picked:
        """Rows ``row`` .. ``row + n - 1`` picked by their ``HostPick``s exactly as the interpreter
        picks a host copy of them (``sampling.host_pick`` over the floats of the BF16 rows
        ``copy_logits_to_host`` gives: 30.0 at the scripted answer, 0.0 elsewhere), without the
        copy. A pick is a function of the answer, the pick and the EOS ids alone, so each one is
        worked out once (``_PICKED``: the walk's seeds and answers repeat across episodes), and
        the row's weights once for all the seeds (``_WEIGHED``): only the draw is the seed's."""
        self._picks_follow_the_rule("sample_rows", row, picks)
        return Picked([self._pick(self._row(r), pick, eos_ids) for r, pick in zip(range(row, row + n), picks,
                                                                                   strict=True)])

    def _picks_follow_the_rule(self, call: str, row: int, picks) -> None:
        """Each pick is the one its row's output position g fixes (specs/scheduler.md §5.11,
        specs/speculation.md §6.16): the request's temperature and filters, seed + g, EOS masked
        while g < min_tokens, and the request's logprob records but at the first token (g = 0,
        which carries none). g is the device's own count: the KV position of the token the row
        was fed, + 1, - the prompt's length."""
        requests = self.requests
        if requests is None:
            return
        at = self.row_at
        for r, pick in enumerate(picks, start=row):
            if not 0 <= r < len(at):
                return  # (a row the last forward did not make: the reader refuses it)
            seq, fed = at[r]
            s = self.sequences[seq]
            request = requests.get(self._rid(s))
            if request is None:
                continue
            g = fed + 1 - self._script(s).prompt_len
            want = HostPick(request.temperature, request.seed + g, g < request.min_tokens,
                            request.top_logprobs if g else 0, top_p=request.top_p, top_k=request.top_k,
                            min_p=request.min_p)
            if pick != want:
                raise self._bad(call, f"row {r} (sequence {seq}, output position {g}) is picked by {pick}; its "
                                      f"request and position make {want}")

    def _pick(self, answer: int, pick, eos_ids) -> int:
        """The token ``pick`` draws from a row whose scripted answer is ``answer``."""
        vocab = self.vocab
        key = (answer, vocab, pick, eos_ids)
        token = _PICKED.get(key)
        if token is None:
            shape = (answer, vocab, pick.temperature, pick.top_p, pick.top_k, pick.min_p, pick.mask_eos, eos_ids)
            weights = _WEIGHED.get(shape)
            if weights is None:
                logits = [0.0] * vocab
                if 0 <= answer < vocab:
                    logits[answer] = 30.0
                if len(_WEIGHED) >= 4096:
                    _WEIGHED.clear()
                weights = _WEIGHED[shape] = pick_weights(logits, pick, eos_ids)
            if len(_PICKED) >= 65536:
                _PICKED.clear()
            token = _PICKED[key] = weights if isinstance(weights, int) else draw(weights, pick.seed)
        return token

    def sample_verify(self, picks, eos_ids) -> list[int]:
        """The last verify's rows under their picks (specs/speculation.md §6.16): a row whose pick
        masks EOS (its output position is below ``min_tokens``) and whose scripted answer is EOS
        answers what the pick draws instead, as a plain decode's host pick does; every other row
        keeps its answer (the scripted logits put all the mass on it, so a rejection-sampled
        verify keeps exactly the greedy verify's drafts). The accepted-draft count follows."""
        rows = list(self.rows)
        if len(picks) != len(rows):
            raise self._bad("sample_verify", f"{len(picks)} picks for the {len(rows)} rows of the last verify")
        self._picks_follow_the_rule("sample_verify", 0, picks)
        offset = 0
        for seq_id, counted in self.verify_order:
            inputs, old = self.verify_io[seq_id]
            new = list(old)
            drawn: dict[int, int] = {}
            for i in range(len(new)):
                pick = picks[offset + i]
                if pick.mask_eos and new[i] in eos_ids:
                    drawn[i] = self._pick(new[i], pick, eos_ids)
                    # the rows after a drawn one follow from it: a draft equal to the drawn token
                    # goes on with the script (script_verify's rule), any other is rejected
                    new = script_verify(self._script(self._seq(seq_id)), self.verified[seq_id][1], inputs, drawn)
            if new != list(old):
                if counted and self.count_accepted:
                    rid = self.live[seq_id].request_id
                    self.accepted[rid] = self.accepted.get(rid, 0) - _agreed(inputs, old) + _agreed(inputs, new)
                self.verify_io[seq_id] = (inputs, tuple(new))
                rows[offset:offset + len(new)] = new
            offset += len(new)
        self.rows = rows
        return rows
