"""LoRA adapters: PEFT adapter directories loaded into a fixed pool of device slots, and the grouped
product that adds each row's adapter to a projection (specs/lora.md §18.1–18.6).

Loading (`load_adapter`, specs/lora.md §18.3–18.4): a PEFT directory (adapter_config.json +
adapter_model.safetensors) is checked against the model and converted to the canonical projection
names of weights.py, the way hf_convert.py converts the checkpoint: an adapter of a fused or
interleaved checkpoint projection (Qwen3.5's gated q_proj and in_proj_qkv, Qwen3-Next's
in_proj_qkvz / in_proj_ba) keeps its A for every canonical part and has its B rows split exactly as
the weight's rows are. The scale (lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora) is
folded into B at load.

The pool (`LoraPool`, §18.1): per adapted canonical projection, A [max_loras, R, in] and B
[max_loras, out, R] on the device (zeros where a slot's adapter has no such target or a smaller
rank; R = max_lora_rank rounded up to a multiple of 8), allocated when an adapter first targets the
projection; a slot holds one adapter, named by an id unique over the pool's life (0: no adapter),
which is what the prefix cache keys blocks by.

The grouped op (`LoraRows`, §18.2): a forward's batch carries, when one of its sequences has an
adapter, the flat indices of the adapted rows sorted by adapter slot and each slot's end offset
(host-built, sent with the batch's other inputs). Each adapted projection then gathers those rows,
runs one grouped product for x @ A^T and one for (x A^T) @ B^T over the slots' segments (punica's
SGMV shrink and expand; `torch._grouped_mm` where it takes the shapes, a product per segment
otherwise) and adds the result back to its rows. On the CPU, where the grouped product is a loop over
segments, a batch whose slots span few columns takes a dense product instead: every row against the
span's A at once, masked to each row's own slot, then the span's B (the pool is fp32 there). A batch
without adapted rows has no `LoraRows`: every hook is one `is None` test.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from safetensors import SafetensorError, safe_open

from .config import ModelConfig
from .errors import AdapterError, read_json_object
from .lora_cpu import PackedDeltas
from .lora_rows import DENSE_MAX_COLUMNS, LoraRows
from .weights import param_shapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
DEFAULT_MAX_LORA_RANK = 64
_PEFT_PREFIX = "base_model.model."
_VL_PREFIX = "model.language_model."
# HF module families fxsched does not adapt (refused with this reason when a target names them)
_UNSUPPORTED = (
    (re.compile(r"(.*\.)?lm_head$"), "the LM head"),
    (re.compile(r"(.*\.)?embed_tokens$"), "the embedding"),
    (re.compile(r".*\.conv1d$"), "the GDN short convolution"),
    (re.compile(r".*\.mlp\.experts(\..*)?$"), "routed MoE experts"),
    (re.compile(r"(model\.)?visual\..*"), "the vision tower"),
)
# adapter_config.json fields whose non-default values fxsched refuses (field -> its accepted values)
_REFUSED_FIELDS: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None), "fan_in_fan_out": (False, None), "bias": ("none", None),
    "lora_bias": (False, None), "modules_to_save": (None, [], ()), "layers_to_transform": (None, [], ()),
    "layers_pattern": (None, [], (), ""), "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
    "trainable_token_indices": (None, {}, []), "use_qalora": (False, None), "target_parameters": (None, [], ()),
    "alora_invocation_tokens": (None, []),
}

Split = Callable[[torch.Tensor], list[torch.Tensor]]


@dataclass(frozen=True)
class _Module:
    """One adaptable HF linear module: its (out, in) shape and the canonical projections it feeds,
    with `split` taking its B [out, r] to one B per canonical name (rows split as the weight's)."""

    shape: tuple[int, int]
    canonical: tuple[str, ...]
    split: Split


def _whole(b: torch.Tensor) -> list[torch.Tensor]:
    return [b]


def _rows(sizes: Sequence[int]) -> Split:
    return lambda b: list(torch.split(b, list(sizes), dim=0))


def _per_head(heads: int, sizes: Sequence[int]) -> Split:
    """Rows laid out per head as consecutive `sizes` blocks: one B per block, heads kept in order."""
    def split(b: torch.Tensor) -> list[torch.Tensor]:
        parts = torch.split(b.reshape(heads, sum(sizes), b.shape[-1]), list(sizes), dim=1)
        return [p.reshape(-1, b.shape[-1]) for p in parts]
    return split


def _family(cfg: ModelConfig) -> str:
    from .hf_model_config import ARCHITECTURES

    family = ARCHITECTURES.get(cfg.architecture)
    if family is None:
        raise AdapterError(cfg.architecture, "LoRA adapters need a Hugging Face checkpoint model "
                                             f"(architectures: {', '.join(ARCHITECTURES)})")
    return family


def hf_modules(cfg: ModelConfig) -> dict[str, _Module]:
    """Every adaptable linear module of the model, by its transformers name (specs/lora.md §18.3)."""
    family = _family(cfg)
    d, hq, hkv, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    hk, hv, dk, dv = cfg.gdn_num_heads, cfg.gdn_v_heads, cfg.gdn_key_dim, cfg.gdn_value_dim
    out: dict[str, _Module] = {}
    for i, kind in enumerate(cfg.layer_pattern):
        src, dst = f"model.layers.{i}", f"layers.{i}"
        if kind == "attn":
            a, p = f"{src}.self_attn", f"{dst}.attn"
            if cfg.attn_output_gate:  # per head: Dh query rows, then Dh gate rows
                out[f"{a}.q_proj"] = _Module((2 * hq * dh, d), (f"{p}.q_proj", f"{p}.gate_proj"),
                                             _per_head(hq, (dh, dh)))
            else:
                out[f"{a}.q_proj"] = _Module((hq * dh, d), (f"{p}.q_proj",), _whole)
            out[f"{a}.k_proj"] = _Module((hkv * dh, d), (f"{p}.k_proj",), _whole)
            out[f"{a}.v_proj"] = _Module((hkv * dh, d), (f"{p}.v_proj",), _whole)
            out[f"{a}.o_proj"] = _Module((d, hq * dh), (f"{p}.o_proj",), _whole)
        else:
            a, p = f"{src}.linear_attn", f"{dst}.gdn"
            if family == "qwen3_next":
                r = hv // hk
                out[f"{a}.in_proj_qkvz"] = _Module(
                    (2 * hk * dk + 2 * hv * dv, d), (f"{p}.q_proj", f"{p}.k_proj", f"{p}.v_proj", f"{p}.g_proj"),
                    _per_head(hk, (dk, dk, r * dv, r * dv)))
                out[f"{a}.in_proj_ba"] = _Module((2 * hv, d), (f"{p}.b_proj", f"{p}.a_proj"), _per_head(hk, (r, r)))
            else:
                out[f"{a}.in_proj_qkv"] = _Module((2 * hk * dk + hv * dv, d),
                                                  (f"{p}.q_proj", f"{p}.k_proj", f"{p}.v_proj"),
                                                  _rows((hk * dk, hk * dk, hv * dv)))
                out[f"{a}.in_proj_z"] = _Module((hv * dv, d), (f"{p}.g_proj",), _whole)
                out[f"{a}.in_proj_b"] = _Module((hv, d), (f"{p}.b_proj",), _whole)
                out[f"{a}.in_proj_a"] = _Module((hv, d), (f"{p}.a_proj",), _whole)
            out[f"{a}.out_proj"] = _Module((d, hv * dv), (f"{p}.o_proj",), _whole)
        m = f"{src}.mlp"
        if cfg.mlp_kind(i) == "dense":
            n = cfg.intermediate_size
            for proj, shape in (("gate_proj", (n, d)), ("up_proj", (n, d)), ("down_proj", (d, n))):
                out[f"{m}.{proj}"] = _Module(shape, (f"{dst}.mlp.{proj}",), _whole)
            continue
        p = f"{dst}.moe"
        out[f"{m}.gate"] = _Module((cfg.num_experts, d), (f"{p}.router",), _whole)
        s = cfg.shared_expert_intermediate_size
        if s:
            for proj, shape in (("gate_proj", (s, d)), ("up_proj", (s, d)), ("down_proj", (d, s))):
                out[f"{m}.shared_expert.{proj}"] = _Module(shape, (f"{p}.shared.{proj}",), _whole)
            out[f"{m}.shared_expert_gate"] = _Module((1, d), (f"{p}.shared_gate",), _whole)
    return out


@dataclass(frozen=True)
class LoraAdapter:
    """A loaded adapter in canonical form: per canonical projection (A [r, in], scale * B [out, r])."""

    path: Path
    rank: int
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _targets_match(targets: Any, name: str) -> bool:
    """PEFT's rule: a string is a regex the whole module name must match; a list entry matches the
    name itself or its last components."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def _unsupported(name: str) -> str | None:
    return next((why for pattern, why in _UNSUPPORTED if pattern.fullmatch(name)), None)


def _read_config(path: Path, max_rank: int) -> tuple[dict[str, Any], int, float]:
    """(config, rank, scale) of adapter_config.json, every refused field checked."""
    if not path.is_file():
        raise AdapterError(path, f"missing (a PEFT adapter directory needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    raw = read_json_object(path, AdapterError)
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(path, f"peft_type {peft_type!r} is not supported (only 'LORA')")
    params = raw.get("target_parameters")
    if params not in (None, [], ()):
        raise AdapterError(path, f"field 'target_parameters' ({params!r}): LoRA on parameters (MoE routed experts, "
                                 f"routers) is not supported; target linear modules only")
    for field, accepted in _REFUSED_FIELDS.items():
        if field in raw and raw[field] not in accepted:
            raise AdapterError(path, f"field '{field}': {raw[field]!r} is not supported "
                                     f"(accepted: {', '.join(repr(a) for a in accepted)})")
    r = raw.get("r", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise AdapterError(path, f"field 'r': expected a positive integer, got {r!r}")
    if r > max_rank:
        raise AdapterError(path, f"rank r={r} is above the pool's max LoRA rank {max_rank}")
    alpha = raw.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(path, f"field 'lora_alpha': expected a number, got {alpha!r}")
    rslora = raw.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterError(path, f"field 'use_rslora': expected true or false, got {rslora!r}")
    for field in ("target_modules", "exclude_modules"):
        value = raw.get(field)
        ok = value is None or isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(v, str) for v in value))
        if not ok:
            raise AdapterError(path, f"field '{field}': expected a string or a list of module names, got {value!r}")
        if isinstance(value, str) and value != "all-linear":
            try:
                re.compile(value)
            except re.error as err:
                raise AdapterError(path, f"field '{field}': {value!r} is not a valid regular expression ({err})") \
                    from None
    if raw.get("target_modules") is None:
        raise AdapterError(path, "field 'target_modules': missing (name the modules the adapter targets)")
    scale = alpha / math.sqrt(r) if rslora else alpha / r
    return raw, r, float(scale)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise AdapterError(path, f"missing (a PEFT adapter directory needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        with safe_open(str(path), framework="pt") as handle:
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise AdapterError(path, f"unreadable safetensors file ({err})") from None
    return tensors


def _module_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """HF module name -> {"A": lora_A, "B": lora_B} of the file (PEFT's names)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.default)?\.weight", key)
        if m is None:
            raise AdapterError(path, f"unexpected tensor '{key}' (a LoRA adapter holds only "
                                     f"<module>.lora_A.weight and <module>.lora_B.weight)")
        module = m.group(1)
        if module.startswith(_VL_PREFIX):  # a Qwen3.5 composite checkpoint's text model
            module = "model." + module[len(_VL_PREFIX):]
        out.setdefault(module, {})[m.group(2)] = tensor
    return out


def load_adapter(adapter_dir: str | Path, cfg: ModelConfig, max_rank: int = DEFAULT_MAX_LORA_RANK,
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> LoraAdapter:
    """The adapter in `adapter_dir`, checked against `cfg` and converted (specs/lora.md §18.3); every
    defect raises AdapterError naming the file (§18.4)."""
    root = Path(adapter_dir)
    if not root.is_dir():
        raise AdapterError(root, "no such adapter directory" if not root.exists() else "not a directory")
    config_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    raw, rank, scale = _read_config(config_path, max_rank)
    modules = hf_modules(cfg)
    targets, exclude = raw["target_modules"], raw.get("exclude_modules") or []
    found = _module_tensors(weights_path, _read_tensors(weights_path))

    def excluded(name: str) -> bool:
        return bool(exclude) and _targets_match(exclude, name)

    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    want = dtype or torch.float32
    for name, pair in sorted(found.items()):
        why = _unsupported(name)
        if why is not None:
            raise AdapterError(weights_path, f"module '{name}': LoRA on {why} is not supported")
        module = modules.get(name)
        if module is None:
            raise AdapterError(weights_path, f"module '{name}' is not a linear module of {cfg.architecture}")
        if targets != "all-linear" and not _targets_match(targets, name):
            raise AdapterError(weights_path, f"module '{name}' has tensors but target_modules does not name it")
        for part in ("A", "B"):
            if part not in pair:
                raise AdapterError(weights_path, f"missing tensor '{_PEFT_PREFIX}{name}.lora_{part}.weight'")
        out_dim, in_dim = module.shape
        a, b = pair["A"], pair["B"]
        for part, t, shape in (("A", a, (rank, in_dim)), ("B", b, (out_dim, rank))):
            if tuple(t.shape) != shape:
                raise AdapterError(weights_path, f"tensor '{_PEFT_PREFIX}{name}.lora_{part}.weight' has shape "
                                                 f"{list(t.shape)}, expected {list(shape)} (r={rank}; the "
                                                 f"model's {name} is [{out_dim}, {in_dim}])")
            if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                raise AdapterError(weights_path, f"tensor '{_PEFT_PREFIX}{name}.lora_{part}.weight' is not "
                                                 f"finite floating point")
        a32, b32 = a.float(), b.float() * scale
        for canonical, b_part in zip(module.canonical, module.split(b32), strict=True):
            weights[canonical] = (a32.to(device=device, dtype=want).contiguous(),
                                  b_part.to(device=device, dtype=want).contiguous())
    if targets != "all-linear":  # every entry names something of the model; every match has tensors
        entries = [targets] if isinstance(targets, str) else list(targets)
        names = list(modules) + list(found)
        for entry in entries:
            if not any(_targets_match(entry if isinstance(targets, str) else [entry], n) for n in names):
                raise AdapterError(config_path, f"target_modules entry {entry!r} matches no module of "
                                                f"{cfg.architecture}")
        for name in modules:
            if _targets_match(targets, name) and not excluded(name) and name not in found:
                raise AdapterError(weights_path, f"missing tensors '{_PEFT_PREFIX}{name}.lora_A.weight' / "
                                                 f"'lora_B.weight' (target_modules names {name})")
    if not weights:
        raise AdapterError(weights_path, "no LoRA tensors")
    return LoraAdapter(root, rank, scale, weights)


# ---- the pool -----------------------------------------------------------------------------------

class LoraPool:
    """max_loras adapter slots on the device (specs/lora.md §18.1)."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int = DEFAULT_MAX_LORA_RANK,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
            raise ValueError(f"max_loras must be a positive integer, got {max_loras!r}")
        if isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1:
            raise ValueError(f"max_lora_rank must be a positive integer, got {max_rank!r}")
        _family(cfg)
        self.cfg = cfg
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.rank = -(-max_rank // 8) * 8  # the pool's stored rank: bf16 grouped products want 16-byte strides
        self.device = torch.device(device)
        # on the CPU the pool is fp32: its small products are several times faster there than bf16's
        # (and exact on AVX2 machines without bf16 arithmetic); the delta is rounded once, when added
        self.dtype = torch.float32 if self.device.type == "cpu" else dtype
        self.shapes = param_shapes(cfg)
        self.a: dict[str, torch.Tensor] = {}  # canonical projection -> [max_loras, rank, in]
        self.b: dict[str, torch.Tensor] = {}  # canonical projection -> [max_loras, out, rank] (scaled)
        # the CPU's dense product (§18.2): B^T per slot, [max_loras, rank, out], so that the slots
        # lo..hi are one [k * rank, out] view
        self.bt: dict[str, torch.Tensor] = {}
        self.targets: dict[str, set[int]] = {}  # canonical projection -> the slots whose adapter adapts it
        # a bf16 model on packed weights: the adapters packed as well, a product over every slot (lora_cpu.py)
        from .packing import packing_ready

        packed = PackedDeltas(max_loras, self.rank)
        self.packed = (packed if self.device.type == "cpu" and dtype == torch.bfloat16
                       and packed.columns <= DENSE_MAX_COLUMNS and packing_ready() else None)
        self.ids = [0] * max_loras  # 0: the slot is empty
        self.paths: list[Path | None] = [None] * max_loras
        self._next_id = 1

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.max_loras:
            raise ValueError(f"adapter slot {slot!r} out of range [0, {self.max_loras})")

    def load(self, slot: int, adapter_dir: str | Path) -> int:
        """Read the adapter in `adapter_dir` (AdapterError if bad: the slot is then unchanged) into
        `slot`, replacing what it held; returns the adapter's new id."""
        self._check_slot(slot)
        adapter = load_adapter(adapter_dir, self.cfg, self.max_rank, self.device, self.dtype)
        self.clear(slot)
        r = adapter.rank
        for name, (a, b) in adapter.weights.items():
            if name not in self.a:
                out_dim, in_dim = self.shapes[name]
                self.a[name] = torch.zeros(self.max_loras, self.rank, in_dim, device=self.device, dtype=self.dtype)
                self.b[name] = torch.zeros(self.max_loras, out_dim, self.rank, device=self.device, dtype=self.dtype)
                self.targets[name] = set()
                if self.device.type == "cpu":
                    self.bt[name] = torch.zeros(self.max_loras, self.rank, out_dim, device=self.device,
                                                dtype=self.dtype)
            self.a[name][slot, :r].copy_(a)
            self.b[name][slot, :, :r].copy_(b)
            if name in self.bt:
                self.bt[name][slot, :r].copy_(b.transpose(0, 1))
            self.targets[name].add(slot)
            if self.packed is not None:
                self.packed.changed(name)
        self.ids[slot] = self._next_id
        self.paths[slot] = adapter.path
        self._next_id += 1
        return self.ids[slot]

    def clear(self, slot: int) -> None:
        """Empty `slot` (its rows of every projection zeroed)."""
        self._check_slot(slot)
        for name, slots in self.targets.items():
            if slot in slots:
                self.a[name][slot].zero_()
                self.b[name][slot].zero_()
                if name in self.bt:
                    self.bt[name][slot].zero_()
                slots.discard(slot)
                if self.packed is not None:
                    self.packed.changed(name)
        self.ids[slot] = 0
        self.paths[slot] = None

    def adapter_id(self, slot: int) -> int:
        """The id of the adapter in `slot` (0: empty)."""
        self._check_slot(slot)
        return self.ids[slot]

    def row_fields(self, lora_slots: Sequence[int], lengths: Sequence[int], t: int) -> tuple[list[int], list[int]] | None:
        """The host fields of a batch of entries (adapter slot of each, -1: none; its rows; the
        batch's row count T): the flat indices b * T + i of the adapted rows sorted by slot, and each
        slot's end offset among them. None when no entry has an adapter."""
        if all(s < 0 for s in lora_slots):
            return None
        counts = [0] * self.max_loras
        rows: list[int] = []
        for slot in sorted({s for s in lora_slots if s >= 0}):
            if not self.ids[slot]:
                raise ValueError(f"adapter slot {slot} holds no adapter")
            for b, (s, n) in enumerate(zip(lora_slots, lengths, strict=True)):
                if s == slot:
                    rows.extend(range(b * t, b * t + n))
                    counts[slot] += n
        ends, total = [], 0
        for c in counts:
            total += c
            ends.append(total)
        return rows, ends

    def batch_rows(self, lora_slots: Sequence[int], ends_host: Sequence[int], rows: torch.Tensor,
                   ends: torch.Tensor) -> "LoraRows":
        """The forward's `LoraRows` from row_fields' fields (`ends_host`) sent to the device (`rows`,
        `ends`)."""
        present = frozenset(s for s in lora_slots if s >= 0)
        bounds = [0, *ends_host]
        segments = tuple((s, bounds[s], bounds[s + 1]) for s in range(len(ends_host)) if bounds[s + 1] > bounds[s])
        return LoraRows(self, rows, ends.to(torch.int32), present, segments)
