"""Spill/restore and compaction move a sequence without changing its continuation."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from fxsched.runtime.torch_model.config import default_config  # noqa: E402
from fxsched.runtime.torch_model.engine import HybridEngine  # noqa: E402
from fxsched.runtime.torch_model.errors import SlotError, SpillError  # noqa: E402
from fxsched.runtime.bench.prompts import random_prompts  # noqa: E402

TOTAL = 30
BEFORE_SPILL = 12


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine() -> HybridEngine:
    return HybridEngine(default_config())


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    return random_prompts(31, 1, engine.cfg.vocab_size, 27, 27)[0]


@pytest.fixture(scope="module")
def expected(engine, prompt) -> list[int]:
    return engine.greedy_generate(prompt, TOTAL)


def _start(engine: HybridEngine, slot: int, prompt: list[int], steps: int) -> list[int]:
    """Prefill + `steps` greedy decodes with MTP/DFlash state maintained; returns generated tokens."""
    engine.alloc(slot)
    out = [int(engine.prefill(slot, prompt).argmax())]
    engine.commit_ctx(slot, len(prompt))
    for _ in range(steps):
        out.append(int(engine.decode_batch([slot], [out[-1]])[0].argmax()))
        engine.commit_ctx(slot, 1)
    engine.save_hidden_for_mtp(slot, -1)
    return out


def _finish(engine: HybridEngine, slot: int, out: list[int]) -> list[int]:
    while len(out) < TOTAL:
        out.append(int(engine.decode_batch([slot], [out[-1]])[0].argmax()))
    engine.free(slot)
    return out


@pytest.fixture
def spilled(engine, prompt, tmp_path):
    out = _start(engine, 2, prompt, BEFORE_SPILL)
    path = tmp_path / "seq.spill"
    drafts = (engine.dflash_propose([2], [out[-1]]), engine.mtp_propose([2], [out[-1]], 3))
    engine.save_sequence_state(2, path)
    engine.free(2)
    assert engine.num_free_blocks() == engine.cfg.num_blocks
    yield path, out, drafts
    for slot in range(engine.cfg.max_slots):
        if engine.is_allocated(slot):
            engine.free(slot)


def test_spill_restore_into_other_slot_continues_identically(engine, expected, spilled):
    path, out, drafts = spilled
    engine.restore_sequence_state(9, path)
    assert engine.seq_len(9) == 27 + BEFORE_SPILL and engine.ctx_len(9) == engine.seq_len(9)
    assert (engine.dflash_propose([9], [out[-1]]), engine.mtp_propose([9], [out[-1]], 3)) == drafts
    assert _finish(engine, 9, out) == expected
    assert engine.num_free_blocks() == engine.cfg.num_blocks


def test_spill_restore_into_allocated_empty_slot_and_cache_sequence(engine, prompt, expected, spilled):
    path, out, _ = spilled
    engine.alloc(4)
    engine.restore_sequence_state(4, path)
    assert engine.cache_sequence(4) == (27 + BEFORE_SPILL) // 16  # boundary states were restored too
    assert _finish(engine, 4, list(out)) == expected
    assert engine.greedy_generate(prompt, TOTAL, slot=5, free_slot=False) == expected
    assert engine.cached_prompt_tokens(5) == 16
    engine.free(5)
    engine.reclaim(100)


def test_spill_missing_file(engine, tmp_path):
    missing = tmp_path / "nope.spill"
    with pytest.raises(SpillError, match="nope.spill: file not found"):
        engine.restore_sequence_state(0, missing)
    assert not engine.is_allocated(0)


@pytest.mark.parametrize("damage,message", [
    (lambda b: b[:len(b) // 2], "truncated"),
    (lambda b: b[:10], "truncated"),
    (lambda b: b[:-100] + bytes([b[-100] ^ 0xFF]) + b[-99:], "checksum mismatch"),
    (lambda b: b"XXXXXXXX" + b[8:], "bad magic"),
    (lambda b: b[:8] + (99).to_bytes(4, "little") + b[12:], "unsupported version 99"),
    (lambda b: b + b"\0", "trailing bytes"),
    (lambda b: b"", "truncated"),
])
def test_spill_corrupted_file_raises_clear_error(engine, spilled, damage, message):
    path, _, _ = spilled
    path.write_bytes(damage(path.read_bytes()))
    free = engine.num_free_blocks()
    with pytest.raises(SpillError, match=message) as info:
        engine.restore_sequence_state(0, path)
    assert str(path) in str(info.value)
    assert not engine.is_allocated(0) and engine.num_free_blocks() == free


def test_spill_incompatible_engine(spilled):
    path, _, _ = spilled
    other = HybridEngine(dataclasses.replace(default_config(), seed=1))
    with pytest.raises(SpillError, match=r"different model config \(fields \['seed'\]\)"):
        other.restore_sequence_state(0, path)
    smaller_pool = HybridEngine(dataclasses.replace(default_config(), num_blocks=64, max_slots=4))
    smaller_pool.restore_sequence_state(3, path)  # pool sizes may differ
    assert smaller_pool.seq_len(3) == 27 + BEFORE_SPILL


def test_spill_restore_into_busy_slot_fails(engine, spilled):
    path, _, _ = spilled
    engine.alloc(0)
    engine.prefill(0, [1, 2, 3])
    with pytest.raises(SlotError, match="free or empty slot"):
        engine.restore_sequence_state(0, path)


def test_compact_moves_sequence(engine, prompt, expected):
    out = _start(engine, 6, prompt, BEFORE_SPILL)
    table = engine.block_table(6)
    drafts = engine.dflash_propose([6], [out[-1]])
    engine.compact(6, 1)
    assert not engine.is_allocated(6) and engine.block_table(1) == table
    assert engine.dflash_propose([1], [out[-1]]) == drafts
    with pytest.raises(SlotError):
        engine.compact(6, 2)
    engine.alloc(6)
    with pytest.raises(SlotError, match="free slot"):
        engine.compact(1, 6)
    engine.free(6)
    assert _finish(engine, 1, out) == expected


def test_compact_between_verify_and_commit(engine, prompt, expected):
    out = _start(engine, 0, prompt, 0)
    logits = engine.verify(0, [out[-1], expected[1], 0])
    engine.compact(0, 7)
    engine.commit_accepted_prefix(7, 2)
    out += [expected[1], int(logits[1].argmax())]
    assert _finish(engine, 7, out) == expected
    assert torch.equal(engine.gdn.recurrent[0][0], torch.zeros_like(engine.gdn.recurrent[0][0]))


def test_spill_empty_sequence_round_trip(engine, tmp_path):
    engine.alloc(3, adapter_id=5)
    engine.save_sequence_state(3, tmp_path / "empty.spill")
    engine.free(3)
    engine.restore_sequence_state(8, tmp_path / "empty.spill")
    assert engine.seq_len(8) == 0 and engine.block_table(8) == [] and engine.slot_state(8).adapter_id == 5
    assert engine.greedy_generate([1, 2, 3], 5, slot=0) == engine.greedy_generate([1, 2, 3], 5, slot=1)
    engine.prefill(8, [1, 2, 3])
    engine.free(8)
