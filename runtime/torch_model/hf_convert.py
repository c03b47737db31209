"""A Hugging Face checkpoint's tensors converted to the canonical layout (`_Converter`, which checks
every tensor's shape and rejects a tensor no part of the model uses).

Conversion to the canonical names of weights.py (the forward only knows those):

* zero-centred RMSNorms (`(1 + w) * x_hat`: every norm of the Qwen3.5 / Qwen3-Next families except
  the GDN output norm, whose weight is plain) become plain weights `1 + w`, added in fp32;
* gated attention: HF's q_proj [Hq * 2 * Dh, D] holds, per head, Dh query rows then Dh gate rows;
  they split into `attn.q_proj` and `attn.gate_proj`;
* GDN: Qwen3.5's in_proj_qkv rows split into q / k / v (conv channel order), in_proj_z -> g_proj;
  Qwen3-Next's in_proj_qkvz is laid out per key head as [q (Dk), k (Dk), v (r*Dv), z (r*Dv)] and
  in_proj_ba as [b (r), a (r)] with r = Hv / Hk; they are un-interleaved so that value head
  j = key head * r + i, the order transformers' fix_query_key_value_ordering produces;
  `conv1d.weight` [C, 1, W] -> `conv` [C, W];
* MoE: per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` (what save_pretrained writes and real
  checkpoints ship) or transformers' fused in-memory `mlp.experts.gate_up_proj` [E, 2I, D] /
  `mlp.experts.down_proj` [E, D, I] are stacked into [E, ...] tensors; `mlp.gate` -> `moe.router`;
* published MTP tensors (`mtp.*`, dropped by transformers) map to `mtp.*` canonical names; if a
  checkpoint has none, the model gets mtp_layers = 0.
"""

from __future__ import annotations

import torch

from .config import ModelConfig
from .errors import ModelDirError
from .hf_model_config import HYBRID_FAMILIES
from .hf_shards import _Shards
from .moe import ExpertShard, moe_prefixes
from .weights import Weights, param_dtype, param_shapes

_VISION_PREFIXES = ("model.visual.", "visual.")  # a Qwen3.5 composite checkpoint's vision tower: skipped


class _Converter:
    """Builds the canonical weights of `cfg` from the checkpoint, tracking which tensors it used."""

    def __init__(self, cfg: ModelConfig, family: str, shards: _Shards,
                 bounds: tuple[int, int, int, int] | None = None, device: str | torch.device = "cpu") -> None:
        self.cfg, self.family, self.shards = cfg, family, shards
        self.zero_centred = family in HYBRID_FAMILIES
        self.used: set[str] = set()
        self.alias = self._aliases()
        self.out: Weights = {}
        self.expected = param_shapes(cfg)
        self.bounds = bounds  # (rank, world, first expert, count) of an expert shard, else None
        self.device = device
        self.layer_ids = {prefix: i for i, prefix in enumerate(moe_prefixes(cfg))}
        self.expert_shards: list[ExpertShard] = []

    def _aliases(self) -> dict[str, str]:
        """Checkpoint-name -> stored-name for text models saved under model.language_model."""
        alias: dict[str, str] = {}
        prefix = "model.language_model."
        for name in self.shards.names:
            if name.startswith(prefix):
                alias["model." + name[len(prefix):]] = name
        return alias

    # -- reading --
    def has(self, name: str) -> bool:
        return name in self.shards.files or name in self.alias

    def take(self, name: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name` of `shape` (only `rows` = (first, count) of its first dimension, if given)."""
        stored = self._check(name, shape)
        return self.shards.read(stored, rows)

    def skip(self, name: str, shape: tuple[int, ...]) -> None:
        """Tensor `name` is there with `shape` and belongs to the model, but is not read."""
        self._check(name, shape)

    def _check(self, name: str, shape: tuple[int, ...]) -> str:
        stored = name if name in self.shards.files else self.alias.get(name)
        if stored is None:
            raise ModelDirError(self.shards.listing or self.shards.root, f"missing tensor '{name}'")
        got = self.shards.shape(stored)
        if got != tuple(shape):
            raise ModelDirError(self.shards.files[stored],
                                f"tensor '{stored}' has shape {list(got)}, expected {list(shape)}")
        self.used.add(stored)
        return stored

    def put(self, name: str, tensor: torch.Tensor) -> None:
        shape = self.expected[name]
        self.out[name] = tensor.reshape(shape).to(param_dtype(name, self.cfg)).contiguous()

    def norm(self, canonical: str, name: str, size: int, zero_centred: bool | None = None) -> None:
        t = self.take(name, (size,)).float()
        if self.zero_centred if zero_centred is None else zero_centred:
            t = t + 1.0  # (1 + w) * x_hat -> a plain multiplicative weight, in fp32
        self.put(canonical, t)

    def copy(self, canonical: str, name: str) -> None:
        self.put(canonical, self.take(name, self.expected[canonical]))

    # -- whole model --
    def convert(self) -> Weights:
        cfg, d = self.cfg, self.cfg.hidden_size
        self.copy("embed", "model.embed_tokens.weight")
        for i, kind in enumerate(cfg.layer_pattern):
            src, dst = f"model.layers.{i}", f"layers.{i}"
            self.norm(f"{dst}.input_norm", f"{src}.input_layernorm.weight", d)
            if kind == "gdn":
                self.gdn(f"{dst}.gdn", f"{src}.linear_attn")
            else:
                self.attention(f"{dst}.attn", f"{src}.self_attn")
            self.norm(f"{dst}.post_norm", f"{src}.post_attention_layernorm.weight", d)
            self.ffn(dst, f"{src}.mlp", i)
        self.norm("final_norm", "model.norm.weight", d)
        if cfg.tie_word_embeddings:
            if self.has("lm_head.weight"):  # some tied checkpoints still ship a copy: accept it
                self.take("lm_head.weight", (cfg.vocab_size, d))
            self.out["lm_head"] = self.out["embed"]
        else:
            self.copy("lm_head", "lm_head.weight")
        if cfg.mtp_layers:
            self.mtp()
        self._reject_unused()
        return self.out

    def _reject_unused(self) -> None:
        for name in self.shards.names:
            if name in self.used or (self.family in ("qwen3_5", "qwen3_5_moe") and name.startswith(_VISION_PREFIXES)):
                continue
            if name.startswith("mtp.") and not self.cfg.mtp_layers:
                continue
            raise ModelDirError(self.shards.files[name],
                                f"unexpected tensor '{name}' (not part of {self.cfg.architecture} as configured)")

    def attention(self, dst: str, src: str) -> None:
        cfg, d = self.cfg, self.cfg.hidden_size
        hq, dh = cfg.num_attention_heads, cfg.head_dim
        if cfg.attn_output_gate:  # per head: Dh query rows, then Dh gate rows
            q = self.take(f"{src}.q_proj.weight", (hq * 2 * dh, d)).view(hq, 2, dh, d)
            self.put(f"{dst}.q_proj", q[:, 0])
            self.put(f"{dst}.gate_proj", q[:, 1])
        else:
            self.copy(f"{dst}.q_proj", f"{src}.q_proj.weight")
        for proj in ("k_proj", "v_proj", "o_proj"):
            self.copy(f"{dst}.{proj}", f"{src}.{proj}.weight")
        if cfg.qk_norm:
            self.norm(f"{dst}.q_norm", f"{src}.q_norm.weight", dh)
            self.norm(f"{dst}.k_norm", f"{src}.k_norm.weight", dh)

    def gdn(self, dst: str, src: str) -> None:
        cfg, d = self.cfg, self.cfg.hidden_size
        hk, hv, dk, dv = cfg.gdn_num_heads, cfg.gdn_v_heads, cfg.gdn_key_dim, cfg.gdn_value_dim
        if self.family == "qwen3_next":
            r = hv // hk
            qkvz = self.take(f"{src}.in_proj_qkvz.weight", (2 * hk * dk + 2 * hv * dv, d))
            q, k, v, z = torch.split(qkvz.view(hk, 2 * dk + 2 * r * dv, d), [dk, dk, r * dv, r * dv], dim=1)
            ba = self.take(f"{src}.in_proj_ba.weight", (2 * hv, d))
            b, a = torch.split(ba.view(hk, 2 * r, d), [r, r], dim=1)
            for name, t in (("q_proj", q), ("k_proj", k), ("v_proj", v), ("g_proj", z), ("b_proj", b), ("a_proj", a)):
                self.put(f"{dst}.{name}", t)
        else:
            qkv = self.take(f"{src}.in_proj_qkv.weight", (2 * hk * dk + hv * dv, d))
            q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=0)
            self.put(f"{dst}.q_proj", q)
            self.put(f"{dst}.k_proj", k)
            self.put(f"{dst}.v_proj", v)
            self.copy(f"{dst}.g_proj", f"{src}.in_proj_z.weight")
            self.copy(f"{dst}.b_proj", f"{src}.in_proj_b.weight")
            self.copy(f"{dst}.a_proj", f"{src}.in_proj_a.weight")
        self.put(f"{dst}.conv", self.take(f"{src}.conv1d.weight", (cfg.gdn_conv_channels, 1, cfg.conv_width))[:, 0, :])
        self.put(f"{dst}.A_log", self.take(f"{src}.A_log", (hv,)).float())
        self.put(f"{dst}.dt_bias", self.take(f"{src}.dt_bias", (hv,)).float())
        self.norm(f"{dst}.o_norm", f"{src}.norm.weight", dv, zero_centred=False)  # gated norm: plain weight
        self.copy(f"{dst}.o_proj", f"{src}.out_proj.weight")

    def ffn(self, dst: str, src: str, layer: int) -> None:
        if self.cfg.mlp_kind(layer) == "dense":
            for proj in ("gate_proj", "up_proj", "down_proj"):
                self.copy(f"{dst}.mlp.{proj}", f"{src}.{proj}.weight")
            return
        cfg = self.cfg
        dst = f"{dst}.moe"
        self.copy(f"{dst}.router", f"{src}.gate.weight")
        self.experts(dst, src)
        if cfg.shared_expert_intermediate_size:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                self.copy(f"{dst}.shared.{proj}", f"{src}.shared_expert.{proj}.weight")
            self.copy(f"{dst}.shared_gate", f"{src}.shared_expert_gate.weight")

    def experts(self, dst: str, src: str) -> None:
        """The stacked experts of MoE layer `dst` ("....moe") from the checkpoint's `src` ("....mlp"):
        every expert, or with a shard only its range (see hf_checkpoint.py's module docstring)."""
        cfg, d = self.cfg, self.cfg.hidden_size
        e, i = cfg.num_experts, cfg.moe_intermediate_size
        first, count = (0, e) if self.bounds is None else self.bounds[2:]
        rows = None if self.bounds is None else (first, count)
        parts: dict[str, torch.Tensor] = {}
        if self.has(f"{src}.experts.gate_up_proj"):  # transformers' fused in-memory layout
            gate_up = self.take(f"{src}.experts.gate_up_proj", (e, 2 * i, d), rows)
            parts = {"gate_proj": gate_up[:, :i], "up_proj": gate_up[:, i:],
                     "down_proj": self.take(f"{src}.experts.down_proj", (e, d, i), rows)}
        else:
            shapes: dict[str, tuple[int, ...]] = {"gate_proj": (i, d), "up_proj": (i, d), "down_proj": (d, i)}
            for proj, shape in shapes.items():
                names = [f"{src}.experts.{x}.{proj}.weight" for x in range(e)]
                for x, name in enumerate(names):
                    if not first <= x < first + count:
                        self.skip(name, shape)
                parts[proj] = torch.stack([self.take(name, shape) for name in names[first:first + count]])
        if self.bounds is None:
            for proj, t in parts.items():
                self.put(f"{dst}.{proj}", t)
            return
        local = {proj: t.to(param_dtype(f"{dst}.{proj}", cfg)).contiguous().to(self.device)
                 for proj, t in parts.items()}
        rank, world = self.bounds[:2]
        shard = ExpertShard(dst, self.layer_ids[dst], first, e, rank, world, local["gate_proj"], local["up_proj"],
                            local["down_proj"])
        self.expert_shards.append(shard)
        self.out.update(shard.placeholders())

    def expert_layers(self) -> list[ExpertShard]:
        """This shard of every MoE layer, nothing else read (load_expert_shards)."""
        for prefix in self.layer_ids:
            layer = prefix[: -len(".moe")]
            self.experts(prefix, f"{layer}.mlp" if layer.startswith("mtp.") else f"model.{layer}.mlp")
        return self.expert_shards

    def mtp(self) -> None:
        d = self.cfg.hidden_size
        self.copy("mtp.fc", "mtp.fc.weight")
        self.norm("mtp.embed_norm", "mtp.pre_fc_norm_embedding.weight", d)
        self.norm("mtp.hidden_norm", "mtp.pre_fc_norm_hidden.weight", d)
        for j in range(self.cfg.mtp_layers):
            src, dst = f"mtp.layers.{j}", f"mtp.layers.{j}"
            self.norm(f"{dst}.input_norm", f"{src}.input_layernorm.weight", d)
            self.attention(f"{dst}.attn", f"{src}.self_attn")
            self.norm(f"{dst}.post_norm", f"{src}.post_attention_layernorm.weight", d)
            self.ffn(dst, f"{src}.mlp", j)
        self.norm("mtp.final_norm", "mtp.norm.weight", d)
