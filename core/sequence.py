"""A sequence in flight: the request plus everything the scheduler knows of its device state.

Invariant: the tokens in the KV are ``(prompt + output)[:seq_len]``; the last output token
(``last_token``) is produced but not yet fed, so ``seq_len == prompt_len + len(output) - 1``
between steps. ``blocks`` mirrors the device's block table, which never shrinks until freed.

A sequence whose last decode was answered ahead (``ahead``, specs/async.md §16.6) has fed its last
output token and holds one more on the device, not yet read: ``last_token`` is ``LATE_TOKEN``, the
output does not hold it yet, and ``seq_len == prompt_len + len(output)``.
"""

from __future__ import annotations

import enum
from typing import Optional

import attrs

from fxsched.core.events import LATE_TOKEN
from fxsched.core.request import Request
from fxsched.core.token_log import TokenLog, as_log


class Guard(enum.StrEnum):
    """Why a sequence was stopped by the scheduler rather than by its own tokens
    (specs/scheduler.md §5.19, specs/watchdog.md §7.5)."""

    REQUEST_TIMEOUT = "request_timeout"
    CONTENT_LOOP = "content_loop_watchdog"
    FUZZY_REPETITION = "fuzzy_repetition"


@attrs.frozen(slots=False)
class Sequence:
    seq_id: int
    request: Request
    slot: int
    seq_len: int
    blocks: int
    output: TokenLog = attrs.field(converter=as_log)
    remaining: int
    last_token: int
    finished: bool = False
    guard: Optional[Guard] = None
    content_count: int = 0
    acc: int = 0
    logprob_records: int = 0
    rollbacks: int = 0
    has_cancel_flag: bool = True
    cancel_requested: bool = False
    immune_until: int = 0
    cached: int = 0
    ring: tuple[tuple[int, int], ...] = ()
    ring_cursor: int = 0

    @property
    def ahead(self) -> bool:
        """Whether the sequence's last decode was answered ahead: its next token is on the device
        (``last_token`` is ``LATE_TOKEN``, specs/async.md §16.6)."""
        return self.last_token == LATE_TOKEN

    @property
    def request_id(self) -> int:
        return self.request.id

    def kv_tokens(self) -> tuple[int, ...]:
        """The tokens the device holds in this sequence's KV."""
        return (self.request.prompt + self.output.tokens())[: self.seq_len]
