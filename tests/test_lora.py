"""LoRA adapters (specs/lora.md §18.1–18.5): PEFT adapters loaded into the engine's pool give PEFT's
own logits, alone and mixed in one batch with each other and the base model (prefill, decode and
verify rows), on tiny checkpoints of the four families: Qwen3; Qwen3.5 (GDN projections and the
gated q_proj); Qwen3.5-MoE (the fused shared expert); Qwen3-Next (the interleaved in_proj_qkvz and
in_proj_ba). Bad adapters are refused with one line naming the file; the torch device's adapter
calls (specs/lora.md §18.5).

The reference is PEFT itself: `peft.get_peft_model` over the transformers model the tiny checkpoint
was saved from (tests/support/hf_tiny.py), with B initialised non-zero (init_lora_weights=False),
saved with save_pretrained and run without cache over the whole sequence.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.hf_tiny import TinyCheckpoint, build, transformers_torch_gdn

from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.devices.torch import TorchDevice
from fxsched.runtime.torch_model import HybridEngine
from fxsched.runtime.torch_model.errors import AdapterError
from fxsched.runtime.torch_model import lora_rows
from fxsched.runtime.torch_model.lora_rows import grouped_lora
from fxsched.runtime.torch_model.packing import packing_ready

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATOL = 1e-4
ENGINE_ARGS: dict[str, Any] = {"max_seq_len": 64, "max_slots": 6, "block_size": 4}
STEPS = 4
FIGURES: dict[str, float] = {}  # case -> max abs diff against PEFT (printed by test_report_parity)

# (name, LoraConfig arguments): different ranks, alphas and targets, one rsLoRA
QWEN3_ADAPTERS: list[tuple[str, dict[str, Any]]] = [
    ("qv_r4", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}),
    ("all_r8_rs", {"r": 8, "lora_alpha": 6, "target_modules": "all-linear", "use_rslora": True}),
    ("mlp_o_r2", {"r": 2, "lora_alpha": 5, "target_modules": ["o_proj", "k_proj", "gate_proj", "up_proj",
                                                               "down_proj"]}),
]
QWEN35_ADAPTERS: list[tuple[str, dict[str, Any]]] = [
    ("all_r4", {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}),
    ("gdn_q_r6_rs", {"r": 6, "lora_alpha": 4, "use_rslora": True,
                     "target_modules": ["in_proj_qkv", "in_proj_b", "out_proj", "q_proj", "o_proj"]}),
]
# Qwen3.5-MoE: the shared expert (fused at load, moe.fuse_shared_experts) and the GDN / attention
# projections; routed experts are refused (REFUSALS)
QWEN35_MOE_ADAPTERS: list[tuple[str, dict[str, Any]]] = [
    ("shared_r4", {"r": 4, "lora_alpha": 8, "target_modules": ["shared_expert.gate_proj", "shared_expert.up_proj",
                                                               "shared_expert.down_proj", "shared_expert_gate",
                                                               "in_proj_z", "k_proj"]}),
]


@dataclass
class Adapted:
    """A tiny checkpoint, its PEFT adapters (saved directory and the PEFT model of each)."""

    ck: TinyCheckpoint
    dirs: dict[str, Path]
    models: dict[str, Any]


def _adapters(ck: TinyCheckpoint, root: Path, specs: list[tuple[str, dict[str, Any]]], seed: int) -> Adapted:
    dirs, models = {}, {}
    for i, (name, kwargs) in enumerate(specs):
        torch.manual_seed(seed + i)
        model = peft.get_peft_model(copy.deepcopy(ck.model),
                                    peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **kwargs)).eval()
        with torch.no_grad():  # B non-zero at a scale that moves the logits well beyond the tolerance
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.copy_(torch.randn(p.shape) * 0.5 / p.shape[-1] ** 0.5)
        model.save_pretrained(root / name)
        dirs[name], models[name] = root / name, model
    return Adapted(ck, dirs, models)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Adapted:
    root = tmp_path_factory.mktemp("lora_qwen3")
    return _adapters(build("Qwen3ForCausalLM", root / "base", seed=0), root, QWEN3_ADAPTERS, seed=10)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Adapted]:
    with transformers_torch_gdn():
        root = tmp_path_factory.mktemp("lora_qwen35")
        yield _adapters(build("Qwen3_5ForCausalLM", root / "base", seed=1), root, QWEN35_ADAPTERS, seed=20)


# Qwen3-Next: the fused, per-key-head interleaved in_proj_qkvz / in_proj_ba (B rows split as the weights')
QWEN3_NEXT_ADAPTERS: list[tuple[str, dict[str, Any]]] = [
    ("fused_r4", {"r": 4, "lora_alpha": 8, "target_modules": ["in_proj_qkvz", "in_proj_ba", "out_proj",
                                                              "shared_expert_gate", "v_proj"]}),
]


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Adapted]:
    with transformers_torch_gdn():
        root = tmp_path_factory.mktemp("lora_qwen3_next")
        yield _adapters(build("Qwen3NextForCausalLM", root / "base", seed=3), root, QWEN3_NEXT_ADAPTERS, seed=40)


@pytest.fixture(scope="module")
def qwen35_moe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Adapted]:
    with transformers_torch_gdn():
        root = tmp_path_factory.mktemp("lora_qwen35_moe")
        yield _adapters(build("Qwen3_5MoeForCausalLM", root / "base", seed=2), root, QWEN35_MOE_ADAPTERS, seed=30)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 150, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _ref_logits(ad: Adapted, name: str | None, tokens: list[int]) -> torch.Tensor:
    """PEFT's logits [T, V] of `tokens` with adapter `name` (None: the base model)."""
    model = ad.ck.model if name is None else ad.models[name]
    return model(torch.tensor([tokens])).logits[0].float()


def _ref_greedy(ad: Adapted, name: str | None, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(_ref_logits(ad, name, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def _engine(ad: Adapted, max_loras: int = 3, max_lora_rank: int = 8,
            device: str = "cpu") -> tuple[HybridEngine, dict[str, int]]:
    engine = HybridEngine.from_pretrained(ad.ck.path, max_loras=max_loras, max_lora_rank=max_lora_rank,
                                          device=device, **ENGINE_ARGS)
    slots = {}
    for slot, name in enumerate(ad.dirs):
        assert engine.load_adapter(slot, ad.dirs[name]) == slot + 1
        slots[name] = slot
    return engine, slots


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max())


def _alone(ad: Adapted, family: str) -> None:
    """Each adapter alone: prefill then decode steps, every logits row against PEFT; greedy equal."""
    engine, slots = _engine(ad)
    for i, name in enumerate(ad.dirs):
        prompt = _prompt(100 + i, 9)
        gen = _ref_greedy(ad, name, prompt, STEPS)
        ref = _ref_logits(ad, name, prompt + gen)
        base = _ref_logits(ad, None, prompt + gen)
        assert _diff(ref, base) > 100 * ATOL, "the adapter must move the logits for the check to mean anything"
        engine.alloc(0, lora_slot=slots[name])
        diffs = [_diff(engine.prefill(0, prompt), ref[len(prompt) - 1])]
        for step, token in enumerate(gen[:-1]):
            diffs.append(_diff(engine.decode_batch([0], [token])[0], ref[len(prompt) + step]))
        engine.free(0)
        FIGURES[f"{family} {name} alone"] = max(diffs)
        assert max(diffs) <= ATOL, (name, diffs)
        assert engine.greedy_generate(prompt, STEPS, lora_slot=slots[name]) == gen


def _mixed(ad: Adapted, family: str, device: str = "cpu", atol: float = ATOL) -> None:
    """One batch mixing every adapter and the base model: a prefill of prompts of different lengths,
    a decode, then a speculative verify of 3 rows per sequence; each row against PEFT's model of its
    sequence's adapter (on the CPU)."""
    engine, slots = _engine(ad, device=device)
    names: list[str | None] = [*ad.dirs, None]
    prompts = [_prompt(200 + i, 6 + 2 * i) for i in range(len(names))]
    for b, name in enumerate(names):
        engine.alloc(b, lora_slot=-1 if name is None else slots[name])
    batch = list(range(len(names)))
    diffs: list[float] = []
    first = engine.commit_forward(batch, prompts)
    tokens = [int(row.argmax()) for row in first]
    for b, name in enumerate(names):
        diffs.append(_diff(first[b], _ref_logits(ad, name, prompts[b])[-1]))
    dec = engine.decode_batch(batch, tokens)
    for b, name in enumerate(names):
        diffs.append(_diff(dec[b], _ref_logits(ad, name, prompts[b] + [tokens[b]])[-1]))
    drafts = [[int(dec[b].argmax()), 7 + b, 11] for b in batch]
    rows = engine.verify_batched(batch, drafts)
    for b, name in enumerate(names):
        ref = _ref_logits(ad, name, prompts[b] + [tokens[b]] + drafts[b])
        diffs.append(_diff(rows[b], ref[-3:]))
    FIGURES[f"{family} mixed batch ({len(names) - 1} adapters + base)"] = max(diffs)
    assert max(diffs) <= atol, diffs


def test_qwen3_each_adapter_alone_matches_peft(qwen3):
    _alone(qwen3, "Qwen3")


@pytest.mark.parametrize("product", ["dense", "grouped"])
def test_qwen3_mixed_batch_matches_peft(qwen3, monkeypatch, product):
    """On the CPU both products of §18.2: the dense one (the slots' span masked per row) and the
    grouped one (what the CPU takes beyond DENSE_MAX_COLUMNS, and the GPU always)."""
    if product == "grouped":
        monkeypatch.setattr(lora_rows, "DENSE_MAX_COLUMNS", 0)
    _mixed(qwen3, f"Qwen3 ({product})")


@pytest.mark.skipif(not packing_ready(),
                    reason="no kernel reads packed weights here (AVX512-BF16 or AMX): bf16 adapters take lora.py's "
                           "fp32 products, tested above")
def test_qwen3_bf16_mixed_batch_on_packed_weights_matches_peft(qwen3, monkeypatch):
    """A bf16 model on packed weights takes the packed adapter product (lora_cpu.py): a mixed batch of
    the three adapters and the base against PEFT (fp32), within bf16 rounding of the logits, and
    against the same engine's fp32 dense product."""
    from fxsched.runtime.torch_model import lora_cpu

    calls: list[str] = []
    real_add = lora_cpu.PackedDeltas.add
    monkeypatch.setattr(lora_cpu.PackedDeltas, "add", lambda self, name, *a: calls.append(name) or real_add(self, name, *a))

    def run(packed: bool) -> tuple[list[torch.Tensor], list[list[int]]]:
        engine = HybridEngine.from_pretrained(qwen3.ck.path, max_loras=3, max_lora_rank=8, dtype="bfloat16",
                                              **ENGINE_ARGS)
        assert engine.lora is not None and (engine.lora.packed is not None)
        if not packed:
            engine.lora.packed = None
        for slot, name in enumerate(qwen3.dirs):
            engine.load_adapter(slot, qwen3.dirs[name])
        prompts = [_prompt(300 + i, 7 + i) for i in range(4)]
        for b in range(4):
            engine.alloc(b, lora_slot=b if b < 3 else -1)
        out = [engine.commit_forward(list(range(4)), prompts).float()]
        out.append(engine.decode_batch(list(range(4)), [5, 6, 7, 8]).float())
        return out, prompts

    (packed, prompts), (dense, _) = run(True), run(False)
    assert calls, "the packed product was not taken"
    names: list[str | None] = [*qwen3.dirs, None]
    for b, name in enumerate(names):
        ref = _ref_logits(qwen3, name, prompts[b] + [5 + b])
        for got, row in ((packed[0][b], ref[-2]), (packed[1][b], ref[-1])):
            scale = row.abs().max().item()
            assert _diff(got, row) <= 0.05 * scale, (name, _diff(got, row), scale)
    for a, b in zip(packed, dense, strict=True):
        assert _diff(a, b) <= 0.03 * b.abs().max().item()


def test_qwen35_hybrid_each_adapter_alone_matches_peft(qwen35):
    with transformers_torch_gdn():
        _alone(qwen35, "Qwen3.5")


def test_qwen35_hybrid_mixed_batch_matches_peft(qwen35):
    with transformers_torch_gdn():
        _mixed(qwen35, "Qwen3.5")


def test_qwen35_moe_shared_expert_adapter_matches_peft(qwen35_moe):
    with transformers_torch_gdn():
        _alone(qwen35_moe, "Qwen3.5-MoE")
        _mixed(qwen35_moe, "Qwen3.5-MoE")


def test_qwen3_next_fused_projection_adapter_matches_peft(qwen3_next):
    with transformers_torch_gdn():
        _alone(qwen3_next, "Qwen3-Next")
        _mixed(qwen3_next, "Qwen3-Next")


def test_batch_without_adapted_rows_takes_the_base_path(qwen3):
    """The adapter-free path: a batch whose sequences have no adapter carries no LoRA rows (every
    hook is one None test), even with adapters loaded; an adapted sequence's batch carries them."""
    engine, slots = _engine(qwen3)
    engine.alloc(0)
    engine.alloc(1, lora_slot=slots["qv_r4"])
    assert engine.prepare([0], [[1, 2, 3]]).lora is None
    batch = engine.prepare([1], [[1, 2, 3]])
    assert batch.lora is not None and batch.lora.present == {slots["qv_r4"]}


def test_prefix_cache_is_keyed_by_adapter(qwen3):
    """Blocks cached under an adapter serve that adapter's sequences only."""
    engine, slots = _engine(qwen3)
    prompt = _prompt(300, 13)
    engine.alloc(0, lora_slot=slots["qv_r4"])
    engine.prefill(0, prompt)
    assert engine.cache_sequence(0) > 0
    engine.alloc(1)
    engine.prefill(1, prompt)
    assert engine.cached_prompt_tokens(1) == 0
    engine.alloc(2, lora_slot=slots["qv_r4"])
    engine.prefill(2, prompt)
    assert engine.cached_prompt_tokens(2) > 0


def test_grouped_product_matches_per_segment_products():
    """The grouped op (torch._grouped_mm) and its per-segment fallback agree, empty slots included."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 8, 16, generator=gen), torch.randn(4, 12, 8, generator=gen)
    x = torch.randn(7, 16, generator=gen)
    ends = torch.tensor([2, 2, 7, 7], dtype=torch.int32)
    want = torch.cat([x[:2] @ a[0].T @ b[0].T, x[2:] @ a[2].T @ b[2].T])
    assert _diff(grouped_lora(x, a, b, ends), want) < 1e-5
    assert _diff(grouped_lora(x, a, b, ends, [(0, 0, 2), (2, 2, 7)]), want) < 1e-5
    odd_b = torch.randn(4, 3, 8, generator=gen)  # 12-byte rows: the grouped product does not take them
    want = torch.cat([x[:2] @ a[0].T @ odd_b[0].T, x[2:] @ a[2].T @ odd_b[2].T])
    assert _diff(grouped_lora(x, a, odd_b, ends), want) < 1e-5


# ---- refusals (specs/lora.md §18.4) --------------------------------------------------------------

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **fields: Any) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(fields)
    (path / "adapter_config.json").write_text(json.dumps(config))


def _edit_tensors(path: Path, edit: Any) -> None:
    file = path / "adapter_model.safetensors"
    save_file(edit(load_file(str(file))), str(file))


_Q = "base_model.model.model.layers.0.self_attn.q_proj"


def _bad_shape(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**t, f"{_Q}.lora_A.weight": torch.zeros(4, 32)}


def _no_b(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in t.items() if k != f"{_Q}.lora_B.weight"}


def _lm_head(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**t, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(160, 4)}


def _add_lm_head(path: Path) -> None:
    _edit_config(path, target_modules=["q_proj", "v_proj", "lm_head"])
    _edit_tensors(path, _lm_head)


REFUSALS: list[tuple[str, Any, str, str]] = [
    # (case, edit of a copy of the r=4 q/v adapter, the file named, what the line says)
    ("dims", lambda p: _edit_tensors(p, _bad_shape), "adapter_model.safetensors", "has shape [4, 32], expected [4, 64]"),
    ("missing_tensor", lambda p: _edit_tensors(p, _no_b), "adapter_model.safetensors", "missing tensor"),
    ("target_model_lacks", lambda p: _edit_config(p, target_modules=["q_proj", "v_proj", "foo_proj"]),
     "adapter_config.json", "'foo_proj' matches no module of Qwen3ForCausalLM"),
    ("untargeted_tensors", lambda p: _edit_config(p, target_modules=["q_proj"]), "adapter_model.safetensors",
     "target_modules does not name it"),
    ("targeted_without_tensors", lambda p: _edit_config(p, target_modules=["q_proj", "v_proj", "k_proj"]),
     "adapter_model.safetensors", "missing tensors"),
    ("lm_head", lambda p: _add_lm_head(p), "adapter_model.safetensors", "LoRA on the LM head"),
    ("dora", lambda p: _edit_config(p, use_dora=True), "adapter_config.json", "field 'use_dora'"),
    ("experts", lambda p: _edit_config(p, target_parameters=["gate_up_proj"]), "adapter_config.json",
     "MoE routed experts"),
    ("bad_json", lambda p: (p / "adapter_config.json").write_text("{"), "adapter_config.json", "not valid JSON"),
    ("no_config", lambda p: (p / "adapter_config.json").unlink(), "adapter_config.json", "missing"),
    ("no_weights", lambda p: (p / "adapter_model.safetensors").unlink(), "adapter_model.safetensors", "missing"),
]


@pytest.mark.parametrize("case,edit,file,says", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_bad_adapter_is_refused_with_one_line(qwen3, tmp_path, case, edit, file, says):
    engine, slots = _engine(qwen3)
    bad = _copy(qwen3.dirs["qv_r4"], tmp_path / case)
    edit(bad)
    before = engine.lora.adapter_id(0) if engine.lora is not None else 0
    with pytest.raises(AdapterError) as err:
        engine.load_adapter(0, bad)
    line = str(err.value)
    assert "\n" not in line and line.startswith(str(bad / file)) and says in line, line
    assert engine.lora is not None and engine.lora.adapter_id(0) == before  # the slot is unchanged


def test_rank_above_the_pool_max_is_refused(qwen3):
    engine = HybridEngine.from_pretrained(qwen3.ck.path, max_loras=1, max_lora_rank=4, **ENGINE_ARGS)
    with pytest.raises(AdapterError, match=r"adapter_config.json: rank r=8 is above the pool's max LoRA rank 4"):
        engine.load_adapter(0, qwen3.dirs["all_r8_rs"])


def test_adapter_of_another_model_is_refused(qwen3, qwen35):
    engine = HybridEngine.from_pretrained(qwen3.ck.path, max_loras=1, max_lora_rank=8, **ENGINE_ARGS)
    with pytest.raises(AdapterError, match="is not a linear module of Qwen3ForCausalLM"):
        engine.load_adapter(0, qwen35.dirs["all_r4"])


# ---- the device's adapter calls (specs/lora.md §18.5) --------------------------------------------

def _greedy_on_device(dev: TorchDevice, seq: int, adapter_slot: int, prompt: list[int], steps: int) -> list[int]:
    """The scheduler's order (specs/scheduler.md §5.10): alloc, adapter_id_for, acquire, prefill,
    then plain decodes."""
    dev.alloc_sequence(seq, seq)
    assert dev.adapter_id_for(adapter_slot) != -1
    dev.acquire_adapter_slot(adapter_slot)
    dev.prefill(seq, prompt, 0)
    out = [dev.argmax_on_device(0, 0)]
    while len(out) < steps:
        dev.decode_batch([out[-1]], [seq], 0)
        out.append(dev.argmax_batch(0, 1, 0)[0])
    return out


def test_device_rotation_binding_and_lru_eviction(qwen3):
    engine = HybridEngine.from_pretrained(qwen3.ck.path, max_loras=2, max_lora_rank=8, **ENGINE_ARGS)
    dev = TorchDevice(engine, adapters={name: str(path) for name, path in qwen3.dirs.items()})
    assert dev.adapter_id_for(-1) == 0 and dev.adapter_id_for(0) == -1 and dev.adapter_id_for(5) == -1
    dev.set_active_lora("qv_r4")
    dev.set_active_lora("all_r8_rs")
    a, b = dev.adapter_slot_of("qv_r4"), dev.adapter_slot_of("all_r8_rs")
    assert (a, b) == (0, 1) and dev.adapter_id_for(0) > 0 and dev.adapter_id_for(1) > 0
    prompt = _prompt(400, 8)
    # a sequence bound to the first (least recently used) adapter keeps it loaded
    got = _greedy_on_device(dev, 1, a, prompt, STEPS)
    assert got == _ref_greedy(qwen3, "qv_r4", prompt, STEPS)
    assert engine.slot_state(dev._seqs[1].slot).lora_slot == a
    dev.set_active_lora("all_r8_rs")  # already loaded: recency only
    dev.set_active_lora("mlp_o_r2")  # evicts the unused adapter, although the other is older
    assert dev.adapter_slot_of("mlp_o_r2") == b and dev.adapter_slot_of("all_r8_rs") == -1
    assert dev.adapter_slot_of("qv_r4") == a
    got = _greedy_on_device(dev, 2, b, prompt, STEPS)
    assert got == _ref_greedy(qwen3, "mlp_o_r2", prompt, STEPS)
    with pytest.raises(DeviceError, match="all 2 slots hold adapters sequences run with"):
        dev.set_active_lora("all_r8_rs")
    with pytest.raises(DeviceError, match="'nope' is not registered"):
        dev.set_active_lora("nope")
    dev.free_sequence(1)
    dev.set_active_lora("all_r8_rs")  # the freed sequence's adapter can go now
    assert dev.adapter_slot_of("all_r8_rs") == a and dev.adapter_slot_of("qv_r4") == -1
    base = _greedy_on_device(dev, 3, -1, prompt, STEPS)
    assert base == _ref_greedy(qwen3, None, prompt, STEPS)


def test_device_spilled_sequence_keeps_its_adapter(qwen3):
    """A spilled sequence pins its adapter (rotation cannot evict it) and continues with it after
    the swap-in's restore and acquire (specs/scheduler.md §5.19 step 4)."""
    engine = HybridEngine.from_pretrained(qwen3.ck.path, max_loras=1, max_lora_rank=8, **ENGINE_ARGS)
    dev = TorchDevice(engine, adapters={name: str(path) for name, path in qwen3.dirs.items()})
    dev.set_active_lora("mlp_o_r2")
    prompt = _prompt(500, 10)
    want = _ref_greedy(qwen3, "mlp_o_r2", prompt, 2 * STEPS)
    got = _greedy_on_device(dev, 1, 0, prompt, STEPS)
    dev.save_sequence_state(1)
    dev.free_sequence(1)
    with pytest.raises(DeviceError, match="all 1 slots hold adapters sequences run with"):
        dev.set_active_lora("qv_r4")
    dev.alloc_sequence(1, 0)
    dev.restore_sequence_state(1, blocks=4)
    dev.acquire_adapter_slot(0)
    while len(got) < 2 * STEPS:
        dev.decode_batch([got[-1]], [1], 0)
        got.append(dev.argmax_batch(0, 1, 0)[0])
    assert got == want
    dev.free_sequence(1)
    dev.set_active_lora("qv_r4")  # nothing pins the slot now
    assert dev.adapter_slot_of("qv_r4") == 0


def test_device_refuses_a_bad_registered_adapter_in_one_line(qwen3, tmp_path):
    bad = _copy(qwen3.dirs["qv_r4"], tmp_path / "bad")
    _edit_config(bad, r=99)
    engine = HybridEngine.from_pretrained(qwen3.ck.path, max_loras=1, max_lora_rank=8, **ENGINE_ARGS)
    dev = TorchDevice(engine, adapters={"bad": bad})
    with pytest.raises(DeviceError) as err:
        dev.set_active_lora("bad")
    assert "\n" not in str(err.value) and "rank r=99 is above" in str(err.value)
    assert dev.adapter_slot_of("bad") == -1 and dev.adapter_id_for(0) == -1


def test_report_parity():
    """The parity figures of this run (max abs diff against PEFT, fp32), for the record."""
    for case, diff in sorted(FIGURES.items()):
        print(f"{case}: {diff:.2e}")
