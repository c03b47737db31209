"""What each client must get (specs/checker.md §11.2): the expected output of a script, lossless
streams, the final frame, early stops and errors justified, one terminal output, the guards'
loop checks. Called by ``invariants.Monitor`` on every client output."""

from __future__ import annotations


from typing import Optional


from fxsched.core.config import SCRIPTED_EOS as EOS
from fxsched.effects.client import DoneOut, ErrorOut, ResponseOut
from fxsched.runtime.check.violation import Violation


WILD = -1
"""An expected position any non-EOS token may fill: EOS is masked there (``min_tokens``) and the
host pick of the masked row is not the script's."""


def expected_output(tokens: tuple[int, ...], max_tokens: int, eos: int = EOS, min_tokens: int = 0) -> tuple[int, ...]:
    """What greedy decoding of a script gives: its tokens up to EOS (included) or the budget. While
    fewer than ``min_tokens`` tokens are out, EOS is masked (specs/scheduler.md §5.11): a script EOS
    there is a ``WILD`` position and the script goes on."""
    if not min_tokens:  # the script's first ``max_tokens`` tokens (the last one repeated), cut after EOS
        head = tokens[:max_tokens]
        if len(head) < max_tokens:
            head += tokens[-1:] * (max_tokens - len(head))
        return head[:head.index(eos) + 1] if eos in head else head
    out = []
    for g in range(max_tokens):
        tok = tokens[g] if g < len(tokens) else tokens[-1]
        if tok == eos and g < min_tokens:
            out.append(WILD)
            continue
        out.append(tok)
        if tok == eos:
            break
    return tuple(out)




def _fits(want: int, token: int) -> bool:
    return want == token or (want == WILD and token != EOS)


# --- the invariants -------------------------------------------------------------------------------


def lossless(expected: tuple[int, ...], streamed: list[int], incoming: tuple[int, ...], rid: int) -> None:
    """lossless: every token a client receives is the next token of its script (never EOS)."""
    at = len(streamed)
    for offset, token in enumerate(incoming):
        position = at + offset
        if position >= len(expected) or not _fits(expected[position], token) or token == EOS:
            want = expected[position] if position < len(expected) else "nothing"
            raise Violation("lossless", f"request {rid} got token {token} at index {position}, script says {want}")


def final_frame_matches(expected: tuple[int, ...], frame, streamed: list[int], max_tokens: int,
                        cancelled: bool, rid: int) -> None:
    """lossless (final): the final frame covers the script up to EOS or the budget, or a prefix of
    it; why it stopped early is ``early_stop_justified``'s to judge."""
    if isinstance(frame, ErrorOut):
        return
    if isinstance(frame, ResponseOut):
        tokens = tuple(frame.tokens)
        n = len(tokens)
        if n > len(expected) or not all(_fits(w, t) for w, t in zip(expected, tokens, strict=False)):
            raise Violation("lossless", f"request {rid} response {list(tokens)} is not a prefix of {list(expected)}")
    else:
        n = frame.n
        if n > len(expected) or len(streamed) != sum(1 for t in expected[:n] if t != EOS):
            raise Violation("lossless", f"request {rid} streamed {streamed} but Done says n={n}")


# --- why an output stopped: each early stop needs its cause (specs/scheduler.md §5.19) ------------------


def has_content_loop(out) -> bool:
    """Three consecutive copies of the last p tokens for some p in 2 .. 64 (specs/watchdog.md §7.2)."""
    n = len(out)
    for p in range(2, 65):
        if 3 * p > n:
            return False
        tail = out[n - p:]
        if tail == out[n - 2 * p:n - p] and tail == out[n - 3 * p:n - 2 * p]:
            return True
    return False


def has_fuzzy_repetition(out) -> bool:
    """Some window P in 40 .. 15 whose last three copies differ pairwise by at most max(P // 12, 1)
    tokens, on an output of 90 tokens or more (specs/watchdog.md §7.3)."""
    n = len(out)
    if n < 90:
        return False
    for p in range(15, 41):
        if 3 * p > n:
            break
        a, b, c = out[n - 3 * p:n - 2 * p], out[n - 2 * p:n - p], out[n - p:]
        tolerance = max(p // 12, 1)
        if (sum(x != y for x, y in zip(a, b, strict=True)) <= tolerance
                and sum(x != y for x, y in zip(b, c, strict=True)) <= tolerance):
            return True
    return False


def guard_held(guard: Optional[str], out, armed: bool) -> bool:
    """A watchdog guard finishes a sequence only when armed and its condition holds on the output
    it leaves (the content-loop check runs from 48 tokens on)."""
    if not armed:
        return False
    if guard in (None, "content_loop_watchdog") and len(out) >= 48 and has_content_loop(out):
        return True
    return guard in (None, "fuzzy_repetition") and has_fuzzy_repetition(out)


def content_loop_checked_when_due(rid: int, out) -> None:
    """content_loop_due: on the plain path with the watchdogs armed, the content-loop check runs on
    the output before each token that brings the content count (output length - 1, rollbacks
    included, specs/watchdog.md §7.1) to k >= 48 with k % 16 == 0 (specs/scheduler.md §5.17 step 2),
    and a hit drops that token. So in a final output, no prefix out[:k] at such a k that is followed
    by another token may hold a loop: the check would have caught it."""
    for k in range(48, len(out), 16):
        if has_content_loop(out[:k]):
            raise Violation("content_loop_due", f"request {rid} has a content loop in its first {k} tokens, "
                                                f"yet token {k + 1} followed: the check due at content count "
                                                f"{k} did not run or did not fire")


def plain_path_only(config, model, request) -> bool:
    """Whether every token after the first goes through the plain sink: no drafting of any kind and
    no beams (specs/scheduler.md §5.15-5.17)."""
    return (not config.use_speculative and not config.ngram_speculative and not config.self_speculative
            and getattr(request, "num_beams", 1) == 1)


def early_stop_justified(request, expected: tuple[int, ...], frame, out, *, cancelled: bool, now_ms: float,
                         max_seq_len: int, armed: bool, reach: int = 0) -> None:
    """early_stop: a final frame's reason matches what really happened (specs/scheduler.md §5.19):
    ``timeout`` only once the deadline passed on the scheduler's clock; ``stop`` only at EOS (EOS
    ends a request as ``stop`` even when it is the budget's last token) or after a cancel really
    delivered; ``length`` only with the budget spent, the context ceiling reached, or a watchdog
    guard whose condition held."""
    rid = request.id
    n = len(out)
    ended_eos = n > 0 and out[-1] == EOS
    guard = frame.guard if isinstance(frame, DoneOut) else None
    reason = str(frame.reason)
    if reason == "timeout":
        if request.deadline_ms is None or request.deadline_ms > now_ms:
            raise Violation("early_stop", f"request {rid} timed out at {now_ms} ms, deadline {request.deadline_ms}")
        if ended_eos or n >= request.max_tokens:
            # the deadline finishes only unfinished sequences (specs/scheduler.md §5.19 step 1)
            raise Violation("early_stop", f"request {rid} reports timeout after it finished "
                                          f"({'EOS' if ended_eos else 'budget spent'}, n={n})")
        return
    if guard == "request_timeout":
        raise Violation("early_stop", f"request {rid} has guard request_timeout but reason {reason}")
    if reason == "stop":
        if not ended_eos and not cancelled:
            raise Violation("early_stop", f"request {rid} stopped after {n} tokens without EOS or a cancel")
        if guard is not None:
            raise Violation("early_stop", f"request {rid} stopped with guard {guard}")
        return
    if reason == "length":
        if ended_eos:
            raise Violation("early_stop", f"request {rid} ended with EOS but reports length (EOS is stop)")
        budget = n >= request.max_tokens or max(request.prompt_len + n, reach + 1) >= max_seq_len
        if guard is not None:
            if not guard_held(guard, out, armed):
                raise Violation("early_stop", f"request {rid} finished by guard {guard} after {n} tokens, "
                                              f"which does not hold")
        elif not budget and not guard_held(None, out, armed):
            raise Violation("early_stop", f"request {rid} finished by length after {n} of {request.max_tokens} "
                                          f"tokens (prompt {request.prompt_len}, context {max_seq_len})")
        return
    raise Violation("early_stop", f"request {rid} finished with reason {reason}")


def one_terminal_output(rid: int, already_final: bool, output) -> None:
    """one terminal output: exactly one Done, Response or Error per request, and nothing after it."""
    if already_final:
        raise Violation("one_terminal_output", f"request {rid} got {type(output).__name__} after its final frame")


def refused_prompt(request, frame, max_seq_len: int) -> None:
    """refused prompt (specs/scheduler.md §5.5): a prompt as long as the context or longer is
    refused with an ``Error``; it never runs."""
    if request.prompt_len >= max_seq_len and not isinstance(frame, ErrorOut):
        raise Violation("refused_prompt", f"request {request.id} with a {request.prompt_len}-token prompt (context "
                                          f"{max_seq_len}) ended with {type(frame).__name__}, not an Error")


def error_justified(request, message: str, *, in_fault_step: bool, blamed, in_flight: bool, model,
                    config, adapter_id: int, requeued_kv: Optional[int] = None) -> None:
    """early_stop (errors): an ``Error`` only for a request the rule book fails
    (specs/faults.md §8.1–8.4, specs/scheduler.md §5.5, §5.19 step 5): one no device could serve (an
    unknown adapter, a prompt past the context or the block pool), one whose preempted KV could
    never fit again, or one in flight when a device call failed, and then, when the failing call
    named its sequences, one of them."""
    rid = request.id
    bs = model.block_size
    if adapter_id == -1 or request.prompt_len >= config.max_seq_len:
        return
    if model.total_blocks and request.prompt_len // bs + 1 > model.total_blocks:
        return
    if requeued_kv is None:
        if model.total_blocks and (request.prompt_len + request.max_tokens) // bs + 2 > model.total_blocks:
            return  # a requeue resume that can never fit (the bound of any KV it could hold)
    elif model.total_blocks and requeued_kv // bs + 2 > model.total_blocks:
        return  # a requeue resume that can never fit: want = len(tokens) // block_size + 1, plus 1 (§5.19 step 5)
    if in_fault_step:
        if not in_flight:
            raise Violation("early_stop", f"request {rid} failed by a fault before it arrived or after it ended")
        if blamed is not None and rid not in blamed:
            raise Violation("early_stop", f"request {rid} failed ({message}) by a fault of a call on {sorted(blamed)}")
        return
    raise Violation("early_stop", f"request {rid} failed ({message}) with no fault and no reason to refuse it")

