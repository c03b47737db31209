"""TorchDevice state handling: spill and restore, the prefix cache, KV exhaustion, logits readers,
the self-speculative draft chain, rewinds and streams (device calls driven directly, in the order
the scheduler issues them, and through the scheduler where the core supports the feature)."""

from __future__ import annotations

import gc
import struct

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from fxsched.runtime.devices.device import DeviceError  # noqa: E402
from fxsched.runtime.generate import generate  # noqa: E402
from fxsched.runtime.devices.sampling import decode_bf16_row  # noqa: E402
from fxsched.runtime.devices.spill_files import SpillFiles  # noqa: E402
from fxsched.runtime.devices.streams import CpuStream, StreamError, StreamSet  # noqa: E402
from fxsched.runtime.devices.torch import DeviceStateError, TorchDevice  # noqa: E402
from fxsched.runtime.torch_model import HybridEngine, ModelConfig, default_config  # noqa: E402
from fxsched.runtime.bench.prompts import random_prompts  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def cfg():
    return default_config()


@pytest.fixture()
def engine(cfg):
    return HybridEngine(cfg)


def plain_steps(dev: TorchDevice, seq: int, token: int, n: int) -> tuple[list[int], int]:
    """n plain decode steps the way the interpreter runs the Decode plan."""
    out = []
    for _ in range(n):
        base = dev.seq_len(seq)
        dev.decode_batch([token], [seq], 0)
        dev.commit_ctx(seq, 1, base, 0)
        token = dev.argmax_batch(0, 1, 0)[0]
        out.append(token)
    return out, token


def start(dev: TorchDevice, seq: int, prompt: list[int]) -> int:
    dev.alloc_sequence(seq, seq)
    dev.prefill(seq, prompt, 0)
    return dev.argmax_on_device(0, 0)


# --- spill / restore ----------------------------------------------------------------------------


def test_spill_and_restore_continues_exactly(cfg, engine):
    prompt = random_prompts(11, 1, cfg.vocab_size, min_len=30, max_len=30)[0]
    want = HybridEngine(cfg).greedy_generate(prompt, 20)
    dev = TorchDevice(engine)
    first = start(dev, 1, prompt)
    got, last = plain_steps(dev, 1, first, 7)
    dev.save_sequence_state(1)
    dev.free_sequence(1)
    # another sequence takes the slot (and its blocks) in between
    other = random_prompts(12, 1, cfg.vocab_size, min_len=40, max_len=40)[0]
    assert dev.alloc_sequence(2, 2) == 0
    dev.prefill(2, other, 0)
    plain_steps(dev, 2, dev.argmax_on_device(0, 0), 3)
    dev.free_sequence(2)
    slot = dev.alloc_sequence(1, 0)
    dev.restore_sequence_state(1, blocks=3)
    assert dev.seq_len(1) == len(prompt) + 7
    rest, _ = plain_steps(dev, 1, last, 12)
    assert [first] + got + rest == want
    assert dev.stats.spills == 1 and dev.stats.restores == 1 and slot == 0
    spill_dir = dev._spill_dir
    assert spill_dir.is_dir() and not any(spill_dir.iterdir())  # the restored file is gone
    dev.teardown()
    assert not spill_dir.exists()


def test_a_spill_directory_never_outlives_its_device(cfg):
    """A device dropped without teardown (a failed run, a caller that forgot) still removes the
    spill directory it made, with any spill file left in it."""
    prompt = random_prompts(14, 1, cfg.vocab_size, min_len=12, max_len=12)[0]
    dev = TorchDevice(HybridEngine(cfg))
    start(dev, 1, prompt)
    dev.save_sequence_state(1)  # the file stays: never restored
    spill_dir = dev._spill_dir
    assert spill_dir is not None and any(spill_dir.iterdir())
    del dev
    gc.collect()
    assert not spill_dir.exists()


def test_the_recording_devices_spill_files_never_outlive_them(tmp_path):
    """The recording device's own spill directory goes with it too; a directory the caller gave
    is the caller's and is kept."""
    files = SpillFiles()
    root = files.root
    files.write(3, {"tokens": [1, 2]})
    del files
    gc.collect()
    assert not root.exists()
    given = SpillFiles(tmp_path)
    given.write(4, {"tokens": [5]})
    given.close()
    assert (tmp_path / "seq-4.spill").exists()  # the caller's directory is the caller's


def test_spill_settles_a_pending_verify_and_keeps_the_drafter_context(cfg):
    """Spill right after a DFlash verify (rows pending, rewound): the restored sequence proposes
    and verifies exactly like a twin that never left the device."""
    prompt = random_prompts(13, 1, cfg.vocab_size, min_len=20, max_len=20)[0]
    answers = []
    for spill in (False, True):
        dev = TorchDevice(HybridEngine(cfg), proposer="dflash")
        first = start(dev, 1, prompt)
        drafts = dev.run_mtp_propose_multi(first, len(prompt), 5, 1, 0, False)
        pre = dev.seq_len(1)
        rows = dev.serial_verify("decode_verify_dflash", 1, [first] + drafts)
        dev.truncate_sequence(1, pre + 1)  # keep the anchor only
        dev.commit_ctx(1, 1, pre, 0)
        if spill:
            dev.save_sequence_state(1)
            dev.free_sequence(1)
            dev.alloc_sequence(1, 0)
            dev.restore_sequence_state(1, blocks=2)
        dev.commit_accepted_prefix(1, 1, 6)  # already folded by the spill: nothing left to do
        again = dev.run_mtp_propose_multi(rows[0], pre + 1, 5, 1, 0, False)
        answers.append((rows, again, dev.serial_verify("decode_verify_dflash", 1, [rows[0]] + again)))
    assert answers[0] == answers[1]


def test_restore_errors_are_device_errors(cfg, engine, tmp_path):
    dev = TorchDevice(engine, spill_dir=tmp_path)
    start(dev, 1, [1, 2, 3, 4, 5])
    with pytest.raises(DeviceError, match="sequence 1 has no spilled state"):
        dev.restore_sequence_state(1, 1)
    dev.save_sequence_state(1)
    dev.free_sequence(1)
    path = tmp_path / "seq-1.spill"
    path.write_bytes(path.read_bytes()[:40])  # truncated on disk
    dev.alloc_sequence(1, 0)
    with pytest.raises(DeviceError, match=r"restore_sequence_state.*spill file"):
        dev.restore_sequence_state(1, 1)


# --- prefix cache ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["none", "dflash", "mtp"])
def test_same_prompt_twice_hits_the_prefix_cache_with_identical_output(cfg, spec):
    prompt = random_prompts(21, 1, cfg.vocab_size, min_len=40, max_len=40)[0]
    engine = HybridEngine(cfg)
    # batch 1: the second request starts after the first was released into the prefix cache
    result = generate(engine, [prompt, prompt], 12, spec, batch=1, strict=True)
    first, second = result.results
    assert first.tokens == second.tokens == HybridEngine(cfg).greedy_generate(prompt, 12)
    assert first.cached_tokens == 0
    assert second.cached_tokens == 32  # two full 16-token blocks; the last block is recomputed
    assert (first.reported_cached, second.reported_cached) == (0, 32)  # Done(cached=...) says so too
    assert result.summary.cached_prompt_tokens == 32
    # and again in a later run on the same engine
    again = generate(engine, [prompt], 12, spec, batch=1, strict=True)
    assert again.outputs == [first.tokens] and again.results[0].cached_tokens == 32


@pytest.mark.parametrize("spec", ["none", "mtp", "dflash"])
def test_prompts_prefilled_together_start_from_the_prefix_cache(cfg, spec):
    """``generate`` prefills prompts that arrive together in one batched forward (production's
    ``prefill_new_together``): each first chunk there reuses the prefix cache as a lone prefill
    does, reports its own count, and the tokens are a fresh engine's."""
    prompt = random_prompts(21, 1, cfg.vocab_size, min_len=40, max_len=40)[0]
    tails = random_prompts(22, 3, cfg.vocab_size, min_len=5, max_len=9)
    prompts = [prompt + tail for tail in tails]
    want = [HybridEngine(cfg).greedy_generate(p, 8) for p in prompts]
    engine = HybridEngine(cfg)
    generate(engine, [prompt], 8, spec, batch=1, strict=True)  # the shared head goes into the cache
    result = generate(engine, prompts, 8, spec, batch=3, strict=True)
    assert result.device.stats.calls["prefill_batch_chunk"] >= 1  # the batched path ran
    assert result.outputs == want
    assert [r.cached_tokens for r in result.results] == [32, 32, 32]  # two full blocks of the head each
    assert [r.reported_cached for r in result.results] == [32, 32, 32]  # and the scheduler reports them
    assert result.summary.cached_prompt_tokens == 96


def test_a_mixed_forward_first_chunk_starts_from_the_prefix_cache(cfg):
    """A new prompt whose first chunk rides beside a running decode reuses the cache: the forward
    answers (sequence, cached tokens), and its last row predicts what a fresh engine predicts."""
    from fxsched.effects.device_calls import PrefillSlice

    head = random_prompts(23, 1, cfg.vocab_size, min_len=40, max_len=40)[0]
    prompt = head + [7, 8, 9, 10, 11]
    engine = HybridEngine(cfg)
    generate(engine, [head], 4, "none", batch=1, strict=True)
    dev = TorchDevice(engine)
    token = start(dev, 1, random_prompts(24, 1, cfg.vocab_size, min_len=20, max_len=20)[0])
    dev.alloc_sequence(2, 2)
    hits = dev.mixed_forward_batch([token], [1], (PrefillSlice(2, tuple(prompt), 0, len(prompt), True),), 0)
    assert hits == [(2, 32)]
    assert dev.argmax_batch(0, 2, 0)[1] == HybridEngine(cfg).greedy_generate(prompt, 1)[0]
    assert dev.seq_len(2) == len(prompt)


def test_cached_blocks_are_evicted_when_a_forward_needs_room(cfg):
    """A full prefix cache never makes a forward fail: unused cached blocks are reclaimed."""
    small = ModelConfig(num_blocks=40, max_seq_len=256, max_slots=4)
    engine = HybridEngine(small)
    prompts = random_prompts(31, 12, small.vocab_size, min_len=60, max_len=70)
    want = [HybridEngine(small).greedy_generate(p, 6) for p in prompts]
    result = generate(engine, prompts, 6, "none", batch=2, strict=True)
    assert result.outputs == want
    assert result.device.stats.cached_blocks > small.num_blocks  # more was cached than fits at once


# --- KV exhaustion, errors -----------------------------------------------------------------------


def test_kv_exhaustion_is_a_recoverable_device_error(cfg):
    small = ModelConfig(num_blocks=16, max_seq_len=256, max_slots=4)
    dev = TorchDevice(HybridEngine(small))
    start(dev, 1, list(range(1, 33)) * 4)  # 128 tokens: 8 full blocks
    start(dev, 2, list(range(2, 34)) * 4)  # 8 more: the pool is full
    free_before = dev.num_free_blocks()
    assert free_before == 0
    with pytest.raises(DeviceError) as info:
        dev.decode_batch([5, 6], [1, 2], 0)
    assert info.value.kv_exhausted and "KV cache exhausted" in info.value.message
    assert dev.seq_len(1) == dev.seq_len(2) == 128  # nothing changed
    dev.free_sequence(2)
    dev.decode_batch([5], [1], 0)  # room again
    assert dev.seq_len(1) == 129


def test_unknown_sequence_and_impossible_rewinds(engine):
    dev = TorchDevice(engine)
    with pytest.raises(DeviceError, match="unknown sequence 9"):
        dev.decode_batch([1], [9], 0)
    start(dev, 1, [1, 2, 3, 4])
    with pytest.raises(DeviceStateError, match="cannot rewind a committed state"):
        dev.truncate_sequence(1, 2)
    with pytest.raises(DeviceStateError, match="cannot grow"):
        dev.truncate_sequence(1, 9)
    dev.truncate_sequence(1, 4)  # no change is fine
    with pytest.raises(DeviceError, match="no LoRA adapters"):
        dev.set_active_lora("x")


def test_commit_of_rows_the_target_rejected_is_caught(engine):
    dev = TorchDevice(engine, proposer="mtp", strict=True)
    first = start(dev, 1, [3, 1, 4, 1, 5])
    rows = dev.serial_verify("decode_verify_graphed_k4", 1, [first, 60, 61, 62])
    agreed = 1 + next((i for i, d in enumerate([60, 61, 62]) if rows[i] != d), 3)
    if agreed == 4:
        pytest.skip("random drafts happened to be right")
    with pytest.raises(DeviceStateError, match="the target agreed with only"):
        dev.commit_accepted_prefix(1, 4, 4)


# --- logits readers ------------------------------------------------------------------------------


def test_logits_rows_and_host_copies(cfg, engine):
    dev = TorchDevice(engine)
    start(dev, 1, [1, 2, 3])
    start(dev, 2, [4, 5, 6, 7])
    dev.decode_batch([8, 9], [1, 2], 0)
    tokens = dev.argmax_batch(0, 2, 0)
    assert dev.argmax_on_device(1, 0) == tokens[1]
    vocab = cfg.vocab_size
    slab = dev.copy_logits_to_host(0, 0, 2 * vocab * 2)
    assert len(slab) == 2 * vocab * 2
    for r in range(2):
        row = decode_bf16_row(slab, vocab, r)
        exact = dev._logits[r].to(torch.bfloat16).float().tolist()
        assert row == exact
        assert row[tokens[r]] == max(row)  # bf16 rounding is monotonic: the argmax stays a maximum
    first = struct.unpack("<f", b"\x00\x00" + slab[:2])[0]  # little-endian bf16, no header
    assert first == dev._logits[0, 0].to(torch.bfloat16).item()
    assert dev.copy_logits_to_host(1, 4, 6) == slab[vocab * 2 + 4:vocab * 2 + 10]  # byte offset within the rows
    with pytest.raises(DeviceError, match="were not produced by the last forward"):
        dev.argmax_batch(1, 2, 0)


def test_verify_rows_answer_the_argmax_of_every_row(engine):
    dev = TorchDevice(engine)
    first = start(dev, 1, [7, 7, 8])
    rows = dev.serial_verify("decode_verify_graphed_k3", 1, [first, 1, 2])
    assert rows == dev.argmax_batch(0, 3, 0)
    assert dev.seq_len(1) == 6  # the scheduler's view: three rows appended, nothing committed yet
    assert engine.seq_len(dev.slot_of(1)) == 3


# --- self-speculative draft chain, rollback ------------------------------------------------------


def test_self_speculative_call_order_is_lossless(cfg, engine):
    """decode, draft chain, rewind, checkpoint, verify, rollback: the specs/speculation.md §6.15 order."""
    prompt = [2, 7, 1, 8, 2, 8]
    want = HybridEngine(cfg).greedy_generate(prompt, 14)
    dev = TorchDevice(engine)
    out = [start(dev, 1, prompt)]
    last = out[0]
    while len(out) < 14:
        dev.decode(last, 1, 0)
        t0 = dev.argmax_on_device(0, 0)
        pre = dev.seq_len(1)
        drafts, x = [], t0
        for _ in range(2):
            dev.decode_draft(x, 1, 0)
            x = dev.argmax_on_device(0, 0)
            drafts.append(x)
        dev.truncate_sequence(1, pre)
        dev.checkpoint_ssm_states(1)
        rows = dev.serial_verify("decode_verify", 1, [t0] + drafts)
        out.append(t0)
        accepted = 0
        for i, d in enumerate(drafts):
            if d != rows[i]:
                out.append(rows[i])
                break
            out.append(d)
            accepted += 1
        else:
            out.append(rows[len(drafts)])
        last = out[-1]
        if dev.seq_len(1) > pre + 1 + accepted:
            dev.truncate_sequence(1, pre + 1 + accepted)
            dev.rollback_ssm_states(1, accepted + 1)
    assert out[:14] == want


def test_ngram_rollback_call_order(cfg, engine):
    """decode_verify_graphed, rewind by one, start_rollback_and_checkpoint_async(na=1)."""
    prompt = [4, 4, 4, 4]
    want = HybridEngine(cfg).greedy_generate(prompt, 6)
    dev = TorchDevice(engine)
    out = [start(dev, 1, prompt)]
    while len(out) < 6:
        pre = dev.seq_len(1)
        v = dev.serial_verify("decode_verify_graphed", 1, [out[-1], 0])
        if v[0] == 0:
            dev.start_checkpoint_async(1)
            out += [0, v[1]]
        else:
            dev.truncate_sequence(1, pre + 1)
            dev.start_rollback_and_checkpoint_async(1, 1)
            out.append(v[0])
    assert out[:6] == want


# --- compaction, beam, streams ----------------------------------------------------------------------


def test_compaction_moves_a_sequence_with_its_pending_rows(cfg, engine):
    prompt = [9, 8, 7, 6, 5]
    dev = TorchDevice(engine, proposer="mtp")
    start(dev, 1, [1, 2])
    first = start(dev, 2, prompt)
    rows = dev.serial_verify("decode_verify_graphed", 2, [first, 3])
    dev.free_sequence(1)
    dev.compact_sequence(2, 0)
    assert dev.slot_of(2) == 0
    dev.truncate_sequence(2, len(prompt) + 1)
    dev.commit_accepted_prefix(2, 1, 2)
    got, _ = plain_steps(dev, 2, rows[0], 3)
    assert [first, rows[0]] + got == HybridEngine(cfg).greedy_generate(prompt, 5)
    assert dev.alloc_sequence(3, 3) == 1
    with pytest.raises(DeviceStateError, match="still holds"):
        dev.compact_sequence(3, 0)


def test_beam_search_answers_a_hypothesis(engine):
    dev = TorchDevice(engine)
    (hyp,) = dev.generate_beam_batch([[1, 2, 3]], [2])
    assert 1 <= len(hyp) <= 16 and all(0 <= t < 64 for t in hyp)
    assert engine.free_slots() == list(range(engine.cfg.max_slots))


def test_cpu_streams_and_events():
    streams = StreamSet("cpu")
    assert streams.create_stream() == 1 and streams.create_stream() == 2
    assert streams.create_event() == 2
    with pytest.raises(StreamError, match="never recorded"):
        streams.stream_wait_event(0, 2)
    streams.record_event(2, 1)
    streams.stream_wait_event(0, 2)
    streams.synchronize(1)
    streams.sync_secondary()
    assert isinstance(streams.stream(0), CpuStream)
    with pytest.raises(StreamError, match="unknown stream 7"):
        streams.synchronize(7)
    with streams.use(1):
        pass


def test_scheduler_run_uses_streams_and_tears_down(cfg, engine):
    result = generate(engine, [[1, 2, 3]], 4, "none", batch=1)
    dev = result.device
    assert dev.streams.secondary == [1]  # the prefill stream the scheduler created at start-up
    assert dev._closed and dev._spill_dir is None  # nothing was spilled, no directory was made
    assert engine.free_slots() == list(range(cfg.max_slots))


def test_every_device_call_is_implemented_with_the_protocol_signature():
    import inspect

    from fxsched.runtime.devices.device import Device
    from fxsched.runtime.devices.recording import RecordingDevice

    names = [n for n, v in vars(Device).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert len(names) > 60
    for name in names:
        mine = getattr(TorchDevice, name, None)
        assert mine is not None, f"TorchDevice lacks {name}"
        want = list(inspect.signature(getattr(Device, name)).parameters)
        assert list(inspect.signature(mine).parameters) == want, name
    # and whatever the reference device answers beyond the protocol's list
    extra = [n for n, v in vars(RecordingDevice).items()
             if inspect.isfunction(v) and not n.startswith("_") and n not in names
             and n not in ("take_cancels", "drafts_for", "verify_row", "free_count")]
    assert [n for n in extra if not hasattr(TorchDevice, n)] == []


def test_a_failed_run_gives_the_slots_back(cfg, engine):
    def broken_drafter(tokens, last, n):
        raise RuntimeError("drafter crashed")

    with pytest.raises(RuntimeError, match="drafter crashed"):
        generate(engine, [[1, 2, 3], [4, 5, 6]], 8, "mtp", batch=2, drafter=broken_drafter)
    assert engine.free_slots() == list(range(cfg.max_slots))
    assert generate(engine, [[1, 2, 3]], 4, "none").outputs == [HybridEngine(cfg).greedy_generate([1, 2, 3], 4)]
