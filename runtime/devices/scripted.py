"""The scripted fake model's answer rules (recording-device.md §3.3), shared by the recording
device and the simulated device so that both answer every call the same way."""

from __future__ import annotations

from typing import Optional

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
        g = max(g, 0)
        return self.tokens[g] if g < len(self.tokens) else self.tokens[-1]


def script_key(session: int, tokens) -> int:
    """Whose script answers a sequence: its session number, or (once swap-in lost it) the first
    token it holds, which is the request id (scenarios.md §2.1)."""
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


def script_verify(script: Script, first_position: int, inputs) -> list[int]:
    """Verify rows: ``tok(g + 1)`` per input until an input differs from the script, then 1s."""
    poisoned = False
    out = []
    for t, token in enumerate(inputs):
        g_in = first_position + t - script.prompt_len
        if t > 0 and script.tok(g_in) != token:
            poisoned = True
        out.append(1 if poisoned else script.tok(g_in + 1))
    return out
