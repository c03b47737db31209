"""What a client must receive, as a plain model of the rule book that shares no code with ``core/``
(specs/checker.md §11.2): for a request nothing disturbs, its final frame is known before it runs.

A request on the plain path (no drafting, no beams, no watchdogs), with no deadline, no cancel and
no fault, gets the tokens of its script (``invariants.expected_output``: up to EOS or its budget,
EOS masked below ``min_tokens``) until the context stops it: its first token comes from the prefill,
which finishes a sequence only at EOS or a spent budget (specs/scheduler.md §5.12), and every later
token finishes it once ``seq_len + 1 ≥ max_seq_len`` with ``seq_len = prompt_len + n − 1``
(§5.17 step 4), so the context lets through ``max(max_seq_len − prompt_len, 2)`` tokens. The finish
reason is ``stop`` when the last token is EOS, else ``length`` (§5.19 step 2).
"""

from __future__ import annotations

from fxsched.runtime.check.violation import Violation


def predicted_final(expected: tuple[int, ...], prompt_len: int, max_seq_len: int, eos: int) -> tuple[int, str]:
    """(tokens, finish reason) of an undisturbed plain-path request whose script gives ``expected``."""
    n = min(len(expected), max(max_seq_len - prompt_len, 2))
    return n, "stop" if expected[n - 1] == eos else "length"


def client_final(rid: int, want: tuple[int, str], n: int, reason: str) -> None:
    """client model: an undisturbed request's final frame is the one the plain model predicts."""
    if (n, reason) != want:
        raise Violation("client_final", f"request {rid} ended with {reason} after {n} tokens; undisturbed, the rule "
                                        f"book gives {want[1]} after {want[0]}")
