"""Grammar-constrained rows: token masks from llguidance matchers, applied to the logits rows of a
forward on the device before anything picks from them (argmax, sampling, verify); serve.md §12.2–12.3.

Who does what. The host (``fxsched serve``'s engine thread) registers a request's grammar with a
``GrammarBook`` (``add``: the request id, its prompt length and an ``llguidance.LLMatcher``) and
drops it when the request ends (``drop``). The device (``TorchDevice``) asks the book for the masks
of a forward's rows (``constrain``): for each row it knows the request (the sequence's session) and
the row's *path*, every token of the sequence up to and including the row's input (the committed
tokens, then the forward's inputs up to the row). The row's logits predict the token after the
path, so its mask is the matcher's after the generated part of the path (``path[prompt_len:]``).

Syncing a matcher to a path. The book keeps, per request, the tokens its matcher has consumed.
A path shares a prefix with them; the matcher rolls back the rest (a rejected draft, or the drafts
of the last verify) and consumes the path's new tokens. So the matcher advances with the accepted
tokens, and along a verify's draft path row by row (row j's mask is the state after drafts 1..j);
the next forward's rows roll it back to the accepted length. A rollback the matcher refuses is
done by a reset and a replay of the path. A draft the grammar refuses (its row before it masks it
out, so the target never accepts it) leaves the rows after it unmasked: no pick ever reads them.

Masks. One bit per vocabulary id (llguidance's layout, little-endian 32-bit words); the rows'
bitmasks go to the logits' device in one copy and every refused id of a masked row gets −∞ there
(``apply_bitmask``), in a copy of the logits (the engine's own tensor is left alone). A greedy row
is then the argmax among the allowed ids, a sampled row draws from them (its logprobs are those of
the masked distribution). A matcher whose grammar is complete allows only the EOS ids, so the
sequence ends there (finish reason "stop"); so does a matcher that failed (a parser resource limit):
its rows allow the EOS ids only, never a row of −∞ alone.

Invariant: a row's mask depends only on its request's grammar and the row's path, never on the
batch, the rows' order or the order forwards asked for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence as Seq

import structlog
import torch

log = structlog.get_logger("fxsched.grammar")


@dataclass
class _Track:
    """One request's matcher and the generated tokens it has consumed."""

    matcher: Any  # llguidance.LLMatcher
    prompt_len: int
    consumed: list[int] = field(default_factory=list)

    def sync(self, generated: Seq[int]) -> bool:
        """Bring the matcher to the state after ``generated``; False when the grammar refuses a
        token of it (the matcher then stands after the longest accepted prefix)."""
        consumed = self.consumed
        common = _common_prefix(consumed, generated)
        extra = len(consumed) - common
        if extra:
            if not self.matcher.rollback(extra) or self.matcher.is_error():
                self.matcher.reset()
                ok = self.matcher.try_consume_tokens(list(consumed[:common]))
                if ok != common:  # cannot happen: these tokens were accepted before
                    log.warning("grammar_replay_failed", accepted=ok, of=common)
            del consumed[common:]
        rest = [int(t) for t in generated[common:]]
        if not rest:
            return True
        took = self.matcher.try_consume_tokens(rest)
        consumed.extend(rest[:took])
        return took == len(rest)

    def bitmask(self) -> bytes:
        return self.matcher.compute_bitmask()


def _common_prefix(a: list[int], b: Seq[int]) -> int:
    """The length of the common prefix of ``a`` and ``b``; the usual cases (``a`` a prefix of ``b``,
    or the two parting in the last few tokens: rejected drafts) by list compares, not a Python loop."""
    n = min(len(a), len(b))
    if list(b[:n]) == a[:n]:
        return n
    start = max(0, n - 32)
    if list(b[:start]) != a[:start]:
        start = 0
    while start < n and a[start] == b[start]:
        start += 1
    return start


class GrammarBook:
    """The grammars of the running requests (engine thread only)."""

    def __init__(self, eos_ids: Seq[int] = ()) -> None:
        self.eos_ids = tuple(eos_ids)
        self._tracks: dict[int, _Track] = {}
        self._sessions: dict[int, int] = {}  # device sequence id -> request id (kept across a spill)

    def add(self, request_id: int, prompt_len: int, matcher: Any) -> None:
        self._tracks[request_id] = _Track(matcher, prompt_len)

    def drop(self, request_id: int) -> None:
        self._tracks.pop(request_id, None)
        for seq in [s for s, r in self._sessions.items() if r == request_id]:
            del self._sessions[seq]

    def __bool__(self) -> bool:
        return bool(self._tracks)

    def bind(self, seq: int, session: int) -> None:
        """The device allocated sequence ``seq`` for request ``session`` (a swap-in names session 0:
        the sequence keeps the request it had)."""
        if session in self._tracks:
            self._sessions[seq] = session

    def request_of(self, seq: int) -> Optional[int]:
        rid = self._sessions.get(seq)
        return rid if rid is not None and rid in self._tracks else None

    def masks(self, rows: Seq[tuple[int, int, Seq[int]]]) -> tuple[list[int], list[bytes]]:
        """For rows ``(row index, request id, path)``, the rows that get a mask and their bitmasks."""
        out_rows: list[int] = []
        out_masks: list[bytes] = []
        dead: set[int] = set()
        for row, rid, path in rows:
            track = self._tracks.get(rid)
            if track is None or rid in dead or len(path) < track.prompt_len:
                continue  # no grammar, a path past a refused draft, or a prompt row before the last
            if not track.sync(path[track.prompt_len:]):
                dead.add(rid)
                continue
            mask = track.bitmask()
            if not any(mask):  # the matcher failed (a resource limit): end the sequence, never a row of -inf
                log.warning("grammar_matcher_failed", request=rid, error=track.matcher.get_error()[:200])
                mask = _only(self.eos_ids, len(mask))
            out_rows.append(row)
            out_masks.append(mask)
        return out_rows, out_masks


def _only(ids: Seq[int], nbytes: int) -> bytes:
    raw = bytearray(nbytes)
    for i in ids:
        if 0 <= i < nbytes * 8:
            raw[i // 8] |= 1 << (i % 8)
    return bytes(raw)


def apply_bitmask(logits: torch.Tensor, rows: Seq[int], masks: Seq[bytes]) -> torch.Tensor:
    """A copy of ``logits [R, V]`` whose ``rows`` keep only the ids their bitmask allows (the
    others −∞). ``masks[i]`` has one bit per id (id j: bit j % 32 of little-endian word j // 32)."""
    if not rows:
        return logits
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    # the bitmask words and the row indices in one pinned host buffer, one non-blocking copy
    # (specs/async.md §16.2 rule 1)
    host = torch.zeros(len(rows) * words + len(rows), dtype=torch.int32)
    for i, mask in enumerate(masks):
        got = torch.frombuffer(bytearray(mask), dtype=torch.int32)[:words]
        host[i * words:i * words + got.numel()] = got
    host[len(rows) * words:] = torch.as_tensor(list(rows), dtype=torch.int32)
    device = logits.device
    if device.type == "cuda":
        host = host.pin_memory()
    sent = host.to(device, non_blocking=True)
    bits = sent[:len(rows) * words].view(len(rows), words)
    index = sent[len(rows) * words:].to(torch.int64)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((bits[:, :, None] >> shifts) & 1).reshape(len(rows), words * 32)[:, :vocab].bool()
    out = logits.clone()
    picked = out.index_select(0, index).masked_fill_(~allowed, -torch.inf)
    out.index_copy_(0, index, picked)
    return out
