"""How a committed forward over several sequences is cut into forwards of bounded size.

A forward's batch is [B, T] with T its longest sequence's rows: every shorter sequence is padded
to T, and every activation of every layer is B x T rows. On a CPU that padding is compute thrown
away (a mixed forward of seven decode rows and one 128-token prompt chunk is 8 x 128 rows for 135
real ones), and the activations of one big forward are the process's peak memory (a Qwen3.5
hybrid's GDN layer holds about 170 KB of fp32 temporaries a row). Sequences are independent within
a forward, so the engine may run them as several forwards instead and commit each (specs/cpu-kernels.md
§15.7): `forward_rows` sizes a forward from the model's widest layer, `row_groups` picks the groups.
"""

from __future__ import annotations

from typing import Sequence

from .config import ModelConfig

# The fp32 activations one forward's widest layer may hold at once, and the bounds on its rows. A
# CPU product of 64 rows or more is compute-bound (each weight is read once per forward), so a cap
# costs little time; the floor keeps it so for the widest models.
ACTIVATION_BYTES = 32 * 2**20
MIN_ROWS, MAX_ROWS, ROW_STEP = 64, 2048, 64


def row_values(cfg: ModelConfig) -> int:
    """An estimate of the fp32 values a row holds live in the widest layer of the model: an MLP's
    gate, up and product (3 x intermediate; a MoE layer's routed experts and shared expert); a GDN
    layer's conv input, conv output and activation (3 x conv channels) plus its chunked-recurrence
    terms (about 12 per value-head element); an attention layer's q, k, v twice over."""
    widths = [3 * cfg.intermediate_size if any(cfg.mlp_kind(i) == "dense" for i in range(cfg.num_layers)) else 0]
    if cfg.num_experts:
        widths.append(3 * (cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size))
    if cfg.gdn_layers:
        widths.append(3 * cfg.gdn_conv_channels + 12 * cfg.gdn_v_heads * cfg.gdn_value_dim)
    if cfg.attn_layers:
        widths.append(2 * (cfg.num_attention_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)
    return max(max(widths), cfg.hidden_size)


def forward_rows(cfg: ModelConfig) -> int:
    """The most padded rows (sequences x longest) of one committed CPU forward: as many as keep
    `row_values` fp32 values a row within ACTIVATION_BYTES, a multiple of ROW_STEP within
    [MIN_ROWS, MAX_ROWS] (Qwen3-0.6B-like: 896; a Qwen3.5 hybrid of that size, whose GDN layers
    hold ~170 KB a row: 192)."""
    rows = ACTIVATION_BYTES // (4 * row_values(cfg)) // ROW_STEP * ROW_STEP
    return min(MAX_ROWS, max(MIN_ROWS, rows))


def row_groups(lengths: Sequence[int], max_rows: int) -> list[list[int]]:
    """Indices of `lengths` cut into groups, each run as one forward: longest first; a sequence
    joins the open group while the group's padded rows (members x its longest) stay within
    max_rows and the sequence has at least half the group's longest rows (padding at most doubles
    its rows). A sequence longer than max_rows is a group of its own. The groups cover every index
    once; with lengths of one size and B x T <= max_rows there is a single group."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be at least 1, got {max_rows}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups:
            group = groups[-1]
            longest = lengths[group[0]]
            if (len(group) + 1) * longest <= max_rows and 2 * lengths[i] >= longest:
                group.append(i)
                continue
        groups.append([i])
    return groups
