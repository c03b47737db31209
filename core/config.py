"""Configuration records: what the model can do and how the scheduler is set up.

Both are fixed for a run; ``step`` reads them, never changes them. Sizes are checked when a
record is made (a batch, a block, a vocabulary of at least 1, counts of at least 0, finite
numbers): a value no run can work with raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import attrs

from fxsched.core.kv import blocks_for
from fxsched.effects.base import int_tuple


def _at_least(low: int) -> Any:
    """An attrs validator: an integer (never a bool) of at least ``low``."""

    def check(instance: object, attribute: Any, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{type(instance).__name__}.{attribute.name} = {value!r}: must be an integer >= {low}")

    return check


def _optional_at_least(low: int) -> Any:
    check = _at_least(low)

    def optional(instance: object, attribute: Any, value: Any) -> None:
        if value is not None:
            check(instance, attribute, value)

    return optional


def _finite_at_least_zero(instance: object, attribute: Any, value: Any) -> None:
    try:
        good = not isinstance(value, bool) and math.isfinite(value) and value >= 0
    except (TypeError, OverflowError):  # not a number, or an integer too large for a float
        good = False
    if not good:
        raise ValueError(f"{type(instance).__name__}.{attribute.name} = {value!r}: must be a finite number >= 0")


SCRIPTED_EOS = 63
"""The end token of the scripted fake model the recording and simulated devices play (vocab 64,
its last id): the one home of that number. A real model's end tokens come from its own config."""


@attrs.frozen
class ModelInfo:
    """Fixed answers of the device that record nothing (specs/recording-device.md §3.9)."""

    vocab: int = attrs.field(default=64, validator=_at_least(1))
    block_size: int = attrs.field(default=16, validator=_at_least(1))
    total_blocks: int = attrs.field(default=1000, validator=_at_least(0))
    has_ssm_layers: bool = False
    ring_slots: int = attrs.field(default=0, validator=_at_least(0))
    has_proposer: bool = False
    dflash_gamma: Optional[int] = attrs.field(default=None, validator=_optional_at_least(1))
    has_self_speculative: bool = False
    supports_beam: bool = False
    supports_rollback: bool = True

    def blocks_for(self, tokens: int) -> int:
        """KV blocks a sequence of ``tokens`` tokens holds: always room for the next token."""
        return blocks_for(tokens, self.block_size)


@attrs.frozen
class SchedulerConfig:
    """Scheduler settings (specs/runner.md §4.2, specs/scheduler.md §5.1)."""

    eos_ids: tuple[int, ...] = attrs.field(default=(SCRIPTED_EOS,), converter=int_tuple)
    max_batch_size: int = attrs.field(default=8, validator=_at_least(1))
    use_speculative: bool = False
    dflash: bool = False
    num_drafts: int = attrs.field(default=1, validator=_at_least(0))
    max_prefill_tokens: int = attrs.field(default=0, validator=_at_least(0))
    max_batch_tokens: int = attrs.field(default=8192, validator=_at_least(1))
    self_speculative: bool = False
    ngram_speculative: bool = False
    swap_space_gb: float = attrs.field(default=0.0, validator=_finite_at_least_zero)
    policy: str = attrs.field(default="fifo", validator=attrs.validators.in_(("fifo", "slai")))
    slai_deadline_ms: float = attrs.field(default=1_000_000.0, validator=_finite_at_least_zero)
    max_seq_len: int = attrs.field(default=4096, validator=_at_least(1))
    admission_watermark: int = attrs.field(default=4096, validator=_at_least(0))
    loop_watchdog: bool = False
    boundary_tokens: tuple[int, ...] = attrs.field(default=(), converter=int_tuple)
    mtp_width_limit: int = 32
    ngram_max_match: int = 16
    # n-gram proposals from the KV tokens only, leaving out the pending last token (the reference
    # ngram trace's rule; specs/speculation.md §6.14). Off: the pending token ends the history.
    ngram_history_without_pending_token: bool = False
    rollback_resteer: bool = True
    max_rollbacks: int = 2
    preemption_immunity_tokens: int = 64
    # chunked prefill only: a new request's chunk 0 waits for lane 2 instead of running alone in
    # lane 1, so prompts that arrive together are prefilled together in one batched forward
    # (specs/scheduler.md §5.10 step 5). Off: the reference traces' one-prompt chunk 0.
    prefill_new_together: bool = False
    # with prefill_new_together: while no sequence is decoding, a prompt's chunk may take the whole
    # max_batch_tokens (no running stream waits on it); while some decode, a chunk stays at most
    # max_prefill_tokens and a step's chunks together too, so a stream waits on one chunk's rows,
    # never on a whole prompt or a queue of them (specs/scheduler.md §5.13). Off: every lane-2 chunk
    # at most max_prefill_tokens, a wave up to max_batch_tokens, as the reference traces have it.
    idle_prefill_fills_budget: bool = False
    # beside d decoding sequences a step's prompt rows (every chunk together) are at most
    # max(mixed_prefill_floor, mixed_prefill_per_decode * d), and never over max_prefill_tokens: a
    # stream waits on a few rows per row it decodes, not on a whole chunk (specs/scheduler.md §5.13 C).
    # Both 0: off, as the reference traces have it.
    mixed_prefill_floor: int = attrs.field(default=0, validator=_at_least(0))
    mixed_prefill_per_decode: int = attrs.field(default=0, validator=_at_least(0))
    # a plain decode may be answered ahead: its tokens stay on the device, the next decode feeds them
    # from there and the host reads them one tick late, while that decode runs (specs/async.md §16.6)
    async_scheduling: bool = False
    # a batch may mix adapters: admission keeps no adapter cohort, every request whose adapter slot
    # is known rides (the device runs each row with its own adapter, specs/lora.md §18.2). Off: one
    # cohort per batch (specs/scheduler.md §5.5 step 3), as the reference traces have it.
    mixed_adapters: bool = False

    def uses_mtp(self, model: ModelInfo) -> bool:
        """MTP / DFlash speculation runs when asked for and the model has a proposer."""
        return self.use_speculative and model.has_proposer

    def base_draft_count(self, model: ModelInfo) -> int:
        """``max(num_drafts, 1)`` when any speculation is on, else 0."""
        if self.uses_mtp(model) or self.self_speculative or self.ngram_speculative:
            return max(self.num_drafts, 1)
        return 0

    eos_set: frozenset[int] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "eos_set", frozenset(self.eos_ids))

    @property
    def spill_pool(self) -> bool:
        return self.swap_space_gb > 0

    @property
    def chunked_prefill(self) -> bool:
        return self.max_prefill_tokens > 0

    @property
    def speculation_slot_cap(self) -> int:
        """Speculation runs only while every active slot is below this."""
        return self.max_batch_size
