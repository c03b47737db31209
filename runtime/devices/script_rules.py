"""The scripted fake model's answer rules (specs/recording-device.md §3.3): a request's ``Script``
and what it answers for a sequence (the next token, drafts, verify rows, the client's cancel), which
the scripted devices (``scripted.ScriptedDevice``: recording and simulated) both follow."""

from __future__ import annotations

from typing import Mapping, Optional

import attrs


@attrs.frozen
class Script:
    """What the fake model answers for one request."""

    prompt_len: int
    tokens: tuple[int, ...]
    draft_wrong_every: int = 0
    beam_hyp: tuple[int, ...] = ()
    cancel_at: Optional[int] = None

    def tok(self, g: int) -> int:
        """Script token at generated index ``g`` (floored at 0; past the end, the last token)."""
        tokens = self.tokens
        if g < 0:
            g = 0
        return tokens[g] if g < len(tokens) else tokens[-1]


def script_key(session: int, tokens) -> int:
    """Whose script answers a sequence: its session number, or (once swap-in lost it) the first
    token it holds, which is the request id (specs/scenarios.md §2.1)."""
    return session if session else (tokens[0] if tokens else 0)


def cancel_due(script: Script, tokens_held: int) -> bool:
    """The scripted client cancels when a cancel-checking call starts with exactly ``cancel_at``
    generated tokens in the sequence's KV."""
    return script.cancel_at is not None and script.cancel_at == tokens_held - script.prompt_len


def script_next(script: Script, position: int) -> int:
    """The answer after feeding ``position``: the script token at ``position + 1 - prompt_len``."""
    return script.tok(position + 1 - script.prompt_len)


def script_drafts(script: Script, position: int, n: int, vocab: int) -> list[int]:
    """Drafts ``tok(base + j)``, j = 1 .. n, wrong (``+ 1 mod (vocab - 1)``) at every m-th index."""
    base = position - script.prompt_len
    out = []
    m = script.draft_wrong_every
    for j in range(1, n + 1):
        tok = script.tok(base + j)
        if m > 0 and (base + j) % m == 0:
            tok = (tok + 1) % (vocab - 1)
        out.append(tok)
    return out


def script_verify(script: Script, first_position: int, inputs, drawn: Mapping[int, int] | None = None) -> list[int]:
    """Verify rows: ``tok(g + 1)`` per input until an input differs from the script, then 1s.

    ``drawn`` maps a row to the token a pick drew there instead of the script's (an EOS masked below
    ``min_tokens``, specs/speculation.md §6.16): that row answers the drawn token, and the next input
    is checked against it, so a draft equal to the drawn token goes on with the script, as a plain
    decode of the drawn token would."""
    drawn = drawn or {}
    poisoned = False
    out = []
    for t, token in enumerate(inputs):
        g_in = first_position + t - script.prompt_len
        if t > 0 and drawn.get(t - 1, script.tok(g_in)) != token:
            poisoned = True
        out.append(1 if poisoned else drawn.get(t, script.tok(g_in + 1)))
    return out
