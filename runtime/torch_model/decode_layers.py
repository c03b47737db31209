"""A dense bf16 CPU model's decode and verify layers in one C call (kernels/cpu_layers.py,
specs/cpu-kernels.md §15.11).

After fused.py a layer still crossed from Python into C about ten times: five products, the q/k
norm and rotation, the K/V write, the attention, two add-norms and SwiGLU, each with its Python
wrapper and its torch allocations, each running cold after the weights streamed through the caches.
Here a forward whose rows all go to the row attention kernel (decode and verify batches, every row
valid) hands the whole stack of layers to kernels/cpu_layers.c, which calls the same kernels in the
same order on the same values: the logits are the step-by-step forward's bit for bit
(tests/test_fused_layer.py). Taken only for models whose every layer is attention with a dense MLP
and no output gate (Qwen3 dense); every other forward runs layer by layer in model.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fxsched.kernels import cpu_attention, cpu_layers, cpu_pointwise

from .config import ModelConfig

if TYPE_CHECKING:
    from .attention import RopeTables
    from .model import RowBatch
    from .paged_kv import PagedKVCache

__all__ = ["LayerStack"]


class LayerStack:
    """One model's layers as cpu_layers.c reads them: the packed matrices' and fp32 norms' addresses
    per layer (the norms' fp32 copies held here), and the cache's per forward."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], fused: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.ok = self._model_fits(cfg, w, fused)
        self._norms: list[torch.Tensor] = []
        self._weights: list[list[int]] = []
        self._ptrs: tuple[tuple[int, ...], torch.Tensor] | None = None
        if not self.ok:
            return
        n = cfg.num_layers

        def norm(name: str) -> int:
            t = w[name].float().contiguous()
            self._norms.append(t)
            return t.data_ptr()

        for i in range(n):
            attn, mlp = f"layers.{i}.attn", f"layers.{i}.mlp"
            self._weights.append([
                fused[attn].data_ptr(), w[f"{attn}.o_proj"].data_ptr(), fused[mlp].data_ptr(),
                w[f"{mlp}.down_proj"].data_ptr(),
                norm(f"{attn}.q_norm") if cfg.qk_norm else 0, norm(f"{attn}.k_norm") if cfg.qk_norm else 0,
                norm(f"layers.{i}.post_norm"), norm(f"layers.{i + 1}.input_norm") if i + 1 < n else 0])

    @staticmethod
    def _model_fits(cfg: ModelConfig, w: dict[str, torch.Tensor], fused: dict[str, torch.Tensor]) -> bool:
        d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_kv_heads
        return (cfg.num_layers > 0 and all(kind == "attn" for kind in cfg.layer_pattern)
                and all(cfg.mlp_kind(i) == "dense" for i in range(cfg.num_layers)) and not cfg.attn_output_gate
                and all(f"layers.{i}.{part}" in fused for i in range(cfg.num_layers) for part in ("attn", "mlp"))
                and cfg.hidden_size % 16 == 0 and d % 32 == 0 and d <= 512 and hq % hkv == 0 and hq <= 128
                and cpu_pointwise.takes_rope(d, cfg.rotary_dim) and w["layers.0.input_norm"].device.type == "cpu"
                and cpu_layers.ready())

    def takes(self, batch: RowBatch, kv: PagedKVCache, h: torch.Tensor, capture_layers: tuple[int, ...]) -> bool:
        """Whether `run` takes this forward: the model fits, no adapters or captured layers, every
        row valid and served by the row attention kernel, bf16 rows and cache on the CPU."""
        if not self.ok or capture_layers or batch.lora is not None or not batch.uniform or batch.attn is None:
            return False
        rows = batch.attn.rows
        b, t = batch.tokens.shape
        return (rows is not None and len(rows.entries) == b and rows.q_rows.shape[0] == b * t
                and h.dtype == torch.bfloat16 and kv.k[0].dtype == torch.bfloat16 and kv.k[0].is_contiguous())

    def _pointers(self, kv: PagedKVCache) -> torch.Tensor:
        key = tuple(t.data_ptr() for t in (*kv.k, *kv.v))
        if self._ptrs is None or self._ptrs[0] != key:
            flat = [p for i, wp in enumerate(self._weights) for p in (*wp, kv.k[i].data_ptr(), kv.v[i].data_ptr())]
            assert len(flat) == cpu_layers.N_PTRS * len(self._weights)
            self._ptrs = (key, torch.tensor(flat, dtype=torch.int64))
        return self._ptrs[1]

    def run(self, batch: RowBatch, kv: PagedKVCache, h: torch.Tensor, x: torch.Tensor, rope: RopeTables
            ) -> torch.Tensor:
        """h [B, T, D] after every layer (pre final norm), given x its first input norm (`takes` holds)."""
        cfg = self.cfg
        table = cpu_layers.kernel_table()
        assert table is not None and batch.attn is not None and batch.attn.rows is not None
        rows = batch.attn.rows
        m = h.shape[0] * h.shape[1]
        h = h.reshape(m, -1).clone()
        x = x.reshape(m, -1).contiguous()
        rot = rope.rotary_dim
        threads = torch.get_num_threads()
        hkv = cfg.num_kv_heads
        splits, units = cpu_attention.work_units(rows.q_rows.shape[0], hkv, threads)
        dims = torch.tensor([m, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, hkv, cfg.head_dim,
                             rot, rows.tables.shape[1], kv.block_size, splits, units, min(threads, units), threads],
                            dtype=torch.int64)
        cpu_layers.decode_layers(table, self._pointers(kv), dims, cfg.rms_norm_eps, cfg.head_dim ** -0.5, h, x,
                                 rope.cos.reshape(m, rot).contiguous(), rope.sin.reshape(m, rot).contiguous(),
                                 batch.write_index.to(torch.int64).contiguous(), rows.q_rows.contiguous(),
                                 rows.ctx.contiguous(), rows.tables.contiguous())
        return h.view(*batch.tokens.shape, -1)
