"""Drafters of published checkpoints (hf_drafters.py, hf_dflash_dir.py): the MTP module and DFlash drafter directories.

References, independent of the engine's caches:
* MTP: transformers' own decoder layer and RMSNorm classes of the family (Qwen3.5 dense, Qwen3-Next
  MoE) loaded with the checkpoint's raw `mtp.*` tensors, fed the target's hidden states from
  transformers (`hidden_states[-1]`, final-normed, as vLLM feeds its MTP module), re-run without a
  cache over every row from scratch for each draft;
* DFlash: a plain from-scratch block forward written here after z-lab/dflash (context features =
  transformers' `hidden_states[l + 1]` of the target_layer_ids -> fc -> hidden_norm; K/V of the
  context and of the block computed together, non-causal attention), on the drafter's raw tensors;
* lossless: transformers' `generate(do_sample=False)` on the same checkpoint, against 32 tokens
  through the whole scheduler path (`fxsched.runtime.generate.generate`) in every speculation mode.
"""

from __future__ import annotations

import copy
import importlib
import json
import math
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from support.hf_tiny import TinyCheckpoint, build, transformers_torch_gdn
from support.toy_model import run_fxsched
from support.hf_tiny_dflash import (dflash_config, dflash_tensors, target_sizes, write_tiny_dflash,
                                    write_tiny_dflash_for)

from fxsched.runtime.generate import generate
from fxsched.runtime.torch_model import HybridEngine
from fxsched.runtime.torch_model.errors import ModelDirError
from fxsched.runtime.torch_model.hf_dflash_dir import load_dflash_drafter
from fxsched.runtime.torch_model.hf_drafters import PublishedDFlash, PublishedMtp

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATOL = 2e-4
ENGINE_ARGS: dict[str, Any] = {"max_seq_len": 96, "max_slots": 4, "block_size": 4}
MTP_ARCHS = ("Qwen3_5ForCausalLM", "Qwen3NextForCausalLM")
MAX_TOKENS = 32


@pytest.fixture(scope="module", autouse=True)
def _torch_gdn() -> Iterator[None]:
    with transformers_torch_gdn():
        yield


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyCheckpoint]:
    root = tmp_path_factory.mktemp("hf_drafters")
    return {arch: build(arch, root / arch, seed=10 + i)
            for i, arch in enumerate((*MTP_ARCHS, "Qwen3ForCausalLM"))}


@pytest.fixture(scope="module")
def drafts_dir(ckpts: dict[str, TinyCheckpoint], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two drafters for the tiny Qwen3: middle layers, and a causal one reading the last layer (final-normed)."""
    root, target = tmp_path_factory.mktemp("dflash"), ckpts["Qwen3ForCausalLM"].path
    return {"mid": write_tiny_dflash_for(root / "mid", target, seed=1, target_layer_ids=(1, 2), block_size=4,
                                         mask_token_id=150),
            "last": write_tiny_dflash_for(root / "last", target, seed=2, target_layer_ids=(0, 3), block_size=5,
                                          num_layers=2, mask_token_id=151, causal=True)}


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 150, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _stored(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# ==========================================================================================
# MTP: a from-scratch reference out of transformers' modules
# ==========================================================================================


class HfMtp:
    """The published MTP structure (vLLM's qwen3_next_mtp / qwen3_5_mtp) out of transformers parts."""

    def __init__(self, ck: TinyCheckpoint) -> None:
        family = "qwen3_next" if ck.architecture.startswith("Qwen3Next") else "qwen3_5"
        mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        prefix = "Qwen3Next" if family == "qwen3_next" else "Qwen3_5"
        cfg = copy.deepcopy(ck.model.config)
        cfg.layer_types = ["full_attention", *cfg.layer_types[1:]]  # MTP layer 0: attention, MLP kind of index 0
        cfg._attn_implementation = "eager"
        raw = {k: v for k, v in _stored(ck.path).items() if k.startswith("mtp.")}
        self.layer = getattr(mod, f"{prefix}DecoderLayer")(cfg, 0).eval()
        state = {k[len("mtp.layers.0."):]: v for k, v in raw.items() if k.startswith("mtp.layers.0.")}
        experts = sorted({int(k.split(".")[2]) for k in state if k.startswith("mlp.experts.")})
        if experts:  # per-expert checkpoint tensors -> transformers' fused expert parameters
            ex = "mlp.experts"
            state[f"{ex}.gate_up_proj"] = torch.stack([torch.cat([state.pop(f"{ex}.{e}.gate_proj.weight"),
                                                                  state.pop(f"{ex}.{e}.up_proj.weight")])
                                                       for e in experts])
            state[f"{ex}.down_proj"] = torch.stack([state.pop(f"{ex}.{e}.down_proj.weight") for e in experts])
        self.layer.load_state_dict(state, strict=True)
        norm_cls, d, eps = getattr(mod, f"{prefix}RMSNorm"), cfg.hidden_size, cfg.rms_norm_eps
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            self.norms[name] = norm_cls(d, eps=eps).eval()
            self.norms[name].load_state_dict({"weight": raw[f"mtp.{name}.weight"]})
        self.fc = raw["mtp.fc.weight"]
        self.model = ck.model

    @torch.no_grad()
    def _outputs(self, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """Module outputs [T, D] of rows (token i + 1, hidden i) at positions 0..T-1, no cache."""
        e = self.model.get_input_embeddings()(torch.tensor([tokens]))
        x = F.linear(torch.cat([self.norms["pre_fc_norm_embedding"](e), self.norms["pre_fc_norm_hidden"](hidden[None])],
                               dim=-1), self.fc)
        t = len(tokens)
        positions = torch.arange(t)[None]
        mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None, None]
        pe = self.model.model.rotary_emb(x, positions)
        y = self.layer(x, position_embeddings=pe, attention_mask=mask, position_ids=positions)
        return self.norms["norm"](y)[0]

    @torch.no_grad()
    def draft_logits(self, committed: list[int], anchor: int, k: int) -> torch.Tensor:
        """Logits [k, V] of k chained drafts, every step recomputed over all rows from scratch."""
        hidden = self.model(torch.tensor([committed]), output_hidden_states=True).hidden_states[-1][0]
        tokens, rows, out = committed[1:] + [anchor], hidden, []
        for _ in range(k):
            m = self._outputs(tokens, rows)[-1]
            out.append(self.model.lm_head(m))
            tokens = tokens + [int(out[-1].argmax())]
            rows = torch.cat([rows, m[None]])
        return torch.stack(out)


def _engine_mtp_logits(engine: HybridEngine, slots: list[int], anchors: list[int], k: int) -> torch.Tensor:
    assert isinstance(engine.mtp, PublishedMtp)
    logits = engine.mtp.propose_logits(slots, [engine.tokens(s) for s in slots], engine.hidden_history, anchors, k)
    assert engine.mtp_propose(slots, anchors, k) == logits.argmax(-1).tolist()  # the engine's call agrees
    return logits


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_mtp_cached_proposals_equal_from_scratch_recomputation(ckpts, arch):
    ck = ckpts[arch]
    ref = HfMtp(ck)
    engine = HybridEngine.from_pretrained(ck.path, **ENGINE_ARGS)
    assert isinstance(engine.mtp, PublishedMtp)
    mtp = engine.mtp

    def check(slots: list[int], anchors: list[int], k: int, what: str) -> list[list[int]]:
        got = _engine_mtp_logits(engine, slots, anchors, k)
        for b, (slot, anchor) in enumerate(zip(slots, anchors, strict=True)):
            want = ref.draft_logits(engine.tokens(slot), anchor, k)
            assert _maxdiff(got[b], want) <= ATOL, (arch, what, slot, k)
            assert got[b].argmax(-1).tolist() == want.argmax(-1).tolist(), (arch, what, slot, k)
            n = engine.seq_len(slot)
            assert mtp.valid_rows(slot) == n and mtp.row_tokens[slot] == engine.tokens(slot)[1:] + [anchor]
        return got.argmax(-1).tolist()

    engine.alloc(0)
    anchor = int(engine.prefill(0, _prompt(1, 9)).argmax())
    for k in range(1, 5):  # after prefill: the catch-up covers the whole prompt, then K = 1..4 chained drafts
        drafts = check([0], [anchor], k, "after prefill")[0]
    # an accepted verify: anchor + 2 drafts kept (forced: the engine keeps what it is told)
    logits = engine.verify(0, [anchor, *drafts])
    engine.commit_accepted_prefix(0, 3)
    anchor = int(logits[2].argmax())
    drafts = check([0], [anchor], 4, "after an accepted verify")[0]
    # a rejected verify: only the anchor is kept; the MTP rows of the rejected drafts are stale
    logits = engine.verify(0, [anchor, (drafts[0] + 1) % 150, drafts[1]])
    engine.commit_accepted_prefix(0, 1)
    anchor = int(logits[0].argmax())
    check([0], [anchor], 3, "after a rejected verify")
    # another anchor than the proposal's (row n-1 recomputed), then plain decodes, batched with a new slot
    check([0], [(anchor + 7) % 150], 2, "a changed anchor")
    engine.decode_batch([0], [anchor])
    engine.alloc(2)
    other = int(engine.prefill(2, _prompt(2, 5)).argmax())
    check([2, 0], [other, anchor], 4, "batched slots of different lengths")
    # moved and spilled sequences keep proposing the same drafts (the K/V cache moves or is rebuilt)
    engine.compact(0, 1)
    check([1], [anchor], 2, "after compaction")
    assert mtp.valid_rows(0) == 0
    path = ck.path.parent / f"{arch}.spill"
    engine.save_sequence_state(1, path)
    engine.free(1)
    engine.restore_sequence_state(3, path)
    assert mtp.valid_rows(3) == 0
    check([3], [anchor], 3, "after spill and restore")


def test_mtp_needs_one_layer_and_a_prefilled_slot(ckpts):
    engine = HybridEngine.from_pretrained(ckpts["Qwen3_5ForCausalLM"].path, **ENGINE_ARGS)
    engine.alloc(0)
    with pytest.raises(Exception, match="prefilled"):
        engine.mtp_propose([0], [1], 2)
    with pytest.raises(ValueError, match="exactly one MTP layer"):
        PublishedMtp(engine.cfg.__class__(**{**engine.cfg.to_dict(), "mtp_layers": 2}), engine.model.w)
    assert HybridEngine.from_pretrained(ckpts["Qwen3ForCausalLM"].path, **ENGINE_ARGS).mtp is None


# ==========================================================================================
# DFlash: a from-scratch block forward
# ==========================================================================================


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [H, T, Dh] rotated (rotate_half convention) at positions [T]."""
    dh = x.shape[-1]
    freqs = positions[:, None].float() * theta ** (-torch.arange(0, dh, 2).float() / dh)
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
    return x * cos + torch.cat([-x[..., dh // 2:], x[..., :dh // 2]], -1) * sin


@torch.no_grad()
def dflash_reference(ck: TinyCheckpoint, draft_dir: Path, committed: list[int], anchor: int) -> torch.Tensor:
    """Draft logits [block_size - 1, V] of one block after `committed`, recomputed from scratch."""
    c = json.loads((draft_dir / "config.json").read_text())
    w = {k.removesuffix(".weight"): v for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
    ids, mask, bs = c["dflash_config"]["target_layer_ids"], c["dflash_config"]["mask_token_id"], c["block_size"]
    eps, theta = c["rms_norm_eps"], c["rope_parameters"]["rope_theta"]
    causal = c["dflash_config"].get("causal", False)
    hq, hkv, dh = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    hs = ck.model(torch.tensor([committed]), output_hidden_states=True).hidden_states
    ctx = _rms(F.linear(torch.cat([hs[i + 1][0] for i in ids], -1), w["fc"]), w["hidden_norm"], eps)
    n = len(committed)
    x = ck.model.get_input_embeddings()(torch.tensor([anchor] + [mask] * (bs - 1)))
    for j in range(c["num_hidden_layers"]):
        p = f"layers.{j}"
        r = _rms(x, w[f"{p}.input_layernorm"], eps)
        both = torch.cat([ctx, r])  # context rows (no input norm) then the block's rows
        q = _rms(F.linear(r, w[f"{p}.self_attn.q_proj"]).view(bs, hq, dh), w[f"{p}.self_attn.q_norm"], eps)
        k = _rms(F.linear(both, w[f"{p}.self_attn.k_proj"]).view(n + bs, hkv, dh), w[f"{p}.self_attn.k_norm"], eps)
        v = F.linear(both, w[f"{p}.self_attn.v_proj"]).view(n + bs, hkv, dh)
        q = _rope(q.transpose(0, 1), torch.arange(n, n + bs), theta)
        k = _rope(k.transpose(0, 1), torch.arange(n + bs), theta).repeat_interleave(hq // hkv, 0)
        v = v.transpose(0, 1).repeat_interleave(hq // hkv, 0)
        scores = q @ k.transpose(-1, -2) / math.sqrt(dh)  # non-causal: every context and block row
        if causal:  # block row i sees the context and block rows 0..i
            scores = scores.masked_fill(torch.arange(n + bs)[None] > torch.arange(n, n + bs)[:, None], float("-inf"))
        attn = torch.softmax(scores, -1) @ v
        x = x + F.linear(attn.transpose(0, 1).reshape(bs, hq * dh), w[f"{p}.self_attn.o_proj"])
        y = _rms(x, w[f"{p}.post_attention_layernorm"], eps)
        x = x + F.linear(F.silu(F.linear(y, w[f"{p}.mlp.gate_proj"])) * F.linear(y, w[f"{p}.mlp.up_proj"]),
                         w[f"{p}.mlp.down_proj"])
    return ck.model.lm_head(_rms(x[1:], w["norm"], eps))


@pytest.mark.parametrize("which", ["mid", "last"])
def test_dflash_proposals_equal_from_scratch_block_forward(ckpts, drafts_dir, which):
    ck, draft = ckpts["Qwen3ForCausalLM"], drafts_dir[which]
    engine = HybridEngine.from_pretrained(ck.path, draft_model=draft, **ENGINE_ARGS)
    drafter = engine.dflash
    assert isinstance(drafter, PublishedDFlash)
    gamma = drafter.gamma
    assert engine.cfg.dflash_gamma == gamma == json.loads((draft / "config.json").read_text())["block_size"] - 1

    def check(slots: list[int], anchors: list[int], what: str) -> list[list[int]]:
        for s in slots:
            assert engine.ctx_len(s) == engine.seq_len(s), what
        got = drafter.propose_logits(slots, anchors, engine.device)
        for b, (slot, anchor) in enumerate(zip(slots, anchors, strict=True)):
            want = dflash_reference(ck, draft, engine.tokens(slot), anchor)
            assert _maxdiff(got[b], want) <= ATOL, (which, what, slot)
        drafts = engine.dflash_propose(slots, anchors)
        assert drafts == got.argmax(-1).tolist()
        return drafts

    engine.alloc(0)
    anchor = int(engine.prefill(0, _prompt(3, 10)).argmax())
    engine.ctx_extend(0, engine.seq_len(0))
    drafts = check([0], [anchor], "after prefill")[0]
    # an accepted verify, its context rows taken from the pending forward before the commit (commit_ctx)
    logits = engine.verify(0, [anchor, *drafts])
    engine.commit_ctx(0, 3)
    engine.commit_accepted_prefix(0, 3)
    anchor = int(logits[2].argmax())
    drafts = check([0], [anchor], "after an accepted verify")[0]
    # context rows past a rejection: taken, then trimmed back to the committed length
    logits = engine.verify(0, [anchor, *drafts])
    engine.commit_ctx(0, 3)
    engine.commit_accepted_prefix(0, 1)
    engine.trim_proposer_state(0, 2)
    anchor = int(logits[0].argmax())
    check([0], [anchor], "after a rejected verify and a trim")
    # committed decodes caught up from the committed features, batched with another slot
    engine.decode_batch([0], [anchor])
    engine.ctx_extend(0, engine.seq_len(0))
    engine.alloc(1)
    other = int(engine.prefill(1, _prompt(4, 6)).argmax())
    engine.ctx_extend(1, engine.seq_len(1))
    check([1, 0], [other, 5], "batched slots of different lengths")


def test_dflash_contexts_of_several_slots_grow_in_one_append(ckpts, drafts_dir):
    """``ctx_extend_many`` and ``commit_ctx_many`` (a decode's or a batched verify's context rows, one
    projection for every slot) put each slot's rows at its own positions: after a catch-up from the
    committed features and after a batched verify whose slots keep different row counts, every
    slot's proposal equals the from-scratch block forward over its committed tokens."""
    ck, draft = ckpts["Qwen3ForCausalLM"], drafts_dir["mid"]
    engine = HybridEngine.from_pretrained(ck.path, draft_model=draft, **ENGINE_ARGS)
    drafter = engine.dflash
    assert isinstance(drafter, PublishedDFlash)
    slots = [2, 0, 1]
    anchors = []
    for slot, (seed, n) in zip(slots, [(3, 10), (4, 6), (6, 17)], strict=True):
        engine.alloc(slot)
        anchors.append(int(engine.prefill(slot, _prompt(seed, n)).argmax()))

    def check(what: str) -> list[list[int]]:
        got = drafter.propose_logits(slots, anchors, engine.device)
        for b, (slot, anchor) in enumerate(zip(slots, anchors, strict=True)):
            assert engine.ctx_len(slot) == engine.seq_len(slot), what
            assert _maxdiff(got[b], dflash_reference(ck, draft, engine.tokens(slot), anchor)) <= ATOL, (what, slot)
        return got.argmax(-1).tolist()

    engine.ctx_extend(0, 4)  # one context part-way already: the batch starts each slot at its own length
    engine.ctx_extend_many(slots, [engine.seq_len(s) for s in slots])
    drafts = check("caught up together")
    logits = engine.verify_batched(slots, [[a, *d] for a, d in zip(anchors, drafts, strict=True)])
    keep = [3, 1, 2]
    engine.commit_ctx_many(slots, keep)  # from the pending forward, before the commit (as commit_ctx)
    engine.gdn_fold_accepted(slots, keep)
    anchors = [int(rows[k - 1].argmax()) for rows, k in zip(logits, keep, strict=True)]
    check("after a batched verify keeping 3, 1 and 2 rows")
    with pytest.raises(ValueError, match="duplicate slots"):
        engine.ctx_extend_many([0, 0], [engine.seq_len(0)] * 2)


def test_dflash_context_survives_prefix_cache_spill_and_compaction(ckpts, drafts_dir, tmp_path):
    ck = ckpts["Qwen3ForCausalLM"]
    engine = HybridEngine.from_pretrained(ck.path, draft_model=drafts_dir["mid"], **ENGINE_ARGS)
    prompt = _prompt(5, 13)
    engine.alloc(0)
    engine.prefill(0, prompt)
    assert engine.cache_sequence(0) == 3
    engine.alloc(1)
    anchor = int(engine.prefill(1, prompt + [7, 8]).argmax())
    assert engine.cached_prompt_tokens(1) == 12  # the cached blocks come with their context features
    engine.ctx_extend(1, engine.seq_len(1))
    want = dflash_reference(ck, drafts_dir["mid"], engine.tokens(1), anchor).argmax(-1).tolist()
    assert engine.dflash_propose([1], [anchor]) == [want]
    engine.save_sequence_state(1, tmp_path / "seq.spill")
    engine.free(1)
    engine.restore_sequence_state(2, tmp_path / "seq.spill")
    assert engine.ctx_len(2) == engine.seq_len(2) and engine.dflash_propose([2], [anchor]) == [want]
    engine.compact(2, 3)
    assert engine.dflash_propose([3], [anchor]) == [want]


# ==========================================================================================
# Lossless through the scheduler
# ==========================================================================================


_HF: dict[str, list[list[int]]] = {}
PROMPTS = [_prompt(6, 9), [11, 12, 13, 14, 11, 12, 13, 14, 11, 12], _prompt(7, 4)]


def _hf_outputs(ck: TinyCheckpoint) -> list[list[int]]:
    if ck.architecture not in _HF:
        with torch.no_grad():
            _HF[ck.architecture] = [ck.model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)
                                    [0, len(p):].tolist() for p in PROMPTS]
    return _HF[ck.architecture]


CASES = [(arch, spec) for arch in MTP_ARCHS for spec in ("none", "mtp", "ngram")]
CASES += [("Qwen3ForCausalLM", spec) for spec in ("none", "dflash", "ngram")]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(("arch", "spec"), CASES)
def test_generate_is_lossless_in_every_speculation_mode(ckpts, drafts_dir, arch, spec, batch):
    ck = ckpts[arch]
    extra = {"draft_model": drafts_dir["mid"]} if spec == "dflash" else {}
    engine = HybridEngine.from_pretrained(ck.path, **ENGINE_ARGS, **extra)
    want = _hf_outputs(ck)
    assert all(len(w) == MAX_TOKENS for w in want)
    result = generate(engine, PROMPTS, MAX_TOKENS, spec=spec, batch=batch, eos_ids=(), strict=True)
    assert result.outputs == want, (arch, spec, batch)
    if spec in ("mtp", "dflash"):
        assert result.summary.verifies > 0 and result.device.stats.drafts_proposed > 0


def _fxsched(*argv: str) -> int:
    return run_fxsched(*argv, toy=False)


def _cli_tokens(out: str) -> list[list[int]]:
    lines = [line for line in out.splitlines() if line.startswith("request ")]
    return [[int(t) for t in line.split(": ", 1)[1].split(" (")[0].split()] for line in lines]


def test_cli_generate_model_dir_mtp_is_lossless(ckpts, capsys):
    ck = ckpts["Qwen3NextForCausalLM"]
    ids = " ".join(map(str, PROMPTS[1]))
    assert _fxsched("generate", "--model", str(ck.path), "--prompt-ids", ids, "--max-tokens", str(MAX_TOKENS),
                    "--spec", "mtp", "--ignore-eos", "--no-progress") == 0
    assert _cli_tokens(capsys.readouterr().out) == [_hf_outputs(ck)[1]]


def test_cli_generate_draft_model_dflash_is_lossless(ckpts, drafts_dir, capsys):
    ck = ckpts["Qwen3ForCausalLM"]
    ids = " ".join(map(str, PROMPTS[0]))
    assert _fxsched("generate", "--model", str(ck.path), "--draft-model", str(drafts_dir["mid"]), "--prompt-ids", ids,
                    "--max-tokens", str(MAX_TOKENS), "--spec", "dflash", "--ignore-eos", "--no-progress") == 0
    assert _cli_tokens(capsys.readouterr().out) == [_hf_outputs(ck)[0]]


def test_cli_bad_draft_model_is_one_line_naming_the_flag(ckpts, tmp_path, capsys):
    config = dflash_config(**target_sizes(ckpts["Qwen3ForCausalLM"].path), target_layer_ids=(1, 9))
    draft = write_tiny_dflash(tmp_path / "draft", config, tensors=dflash_tensors({**config, "dflash_config": {
        **config["dflash_config"], "target_layer_ids": [1, 2]}}))
    assert _fxsched("generate", "--model", str(ckpts["Qwen3ForCausalLM"].path), "--draft-model", str(draft),
                    "--prompt-ids", "1 2 3", "--spec", "dflash", "--no-progress") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fxsched generate: --draft-model {draft}: ") and "\n" not in err
    assert "layers [9] are outside the target's 4 layers" in err


# ==========================================================================================
# Bad drafter directories: one-line errors naming the directory (or file)
# ==========================================================================================


def _edit_config(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path, Path], None]:
    def apply(draft: Path, target: Path) -> None:
        config = dflash_config(**target_sizes(target))
        tensors = dflash_tensors(config)
        edit(config)
        write_tiny_dflash(draft, config, tensors=tensors)
    return apply


def _edit_tensors(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path, Path], None]:
    def apply(draft: Path, target: Path) -> None:
        write_tiny_dflash_for(draft, target)
        tensors = load_file(str(draft / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(draft / "model.safetensors"))
    return apply


def _no_config(draft: Path, target: Path) -> None:
    write_tiny_dflash_for(draft, target)
    (draft / "config.json").unlink()


def _bad_json(draft: Path, target: Path) -> None:
    write_tiny_dflash_for(draft, target)
    (draft / "config.json").write_text("{not json")


BAD_DIRS: list[tuple[str, Callable[[Path, Path], None], str]] = [
    ("missing dir", lambda draft, target: None, "not a directory"),
    ("no config", _no_config, "no config.json"),
    ("bad json", _bad_json, "not valid JSON"),
    ("not dflash", _edit_config(lambda c: c.update(architectures=["Qwen3ForCausalLM"])), "not a DFlash drafter"),
    ("no layer ids", _edit_config(lambda c: c["dflash_config"].pop("target_layer_ids")), "target_layer_ids"),
    ("layer outside", _edit_config(lambda c: c["dflash_config"].update(target_layer_ids=[1, 4])),
     r"layers \[4\] are outside the target's 4 layers"),
    ("hidden mismatch", _edit_config(lambda c: c.update(hidden_size=32)), "hidden_size.*differs from the target's 64"),
    ("no mask token", _edit_config(lambda c: c["dflash_config"].pop("mask_token_id")), "mask_token_id"),
    ("dflash2", _edit_config(lambda c: c["dflash_config"].update(conv_kernel_size=4)), "DFlash2"),
    ("missing tensor", _edit_tensors(lambda t: t.__delitem__("layers.0.self_attn.k_norm.weight")),
     "missing drafter tensors: layers.0.self_attn.k_norm"),
    ("fc shape", _edit_tensors(lambda t: t.update({"fc.weight": torch.zeros(64, 64)})), "tensor 'fc' has shape"),
    ("extra tensor", _edit_tensors(lambda t: t.update({"candidate_selector.x": torch.zeros(2)})),
     "unexpected tensors"),
]


@pytest.mark.parametrize(("what", "make", "message"), BAD_DIRS, ids=[b[0] for b in BAD_DIRS])
def test_bad_drafter_dirs_raise_one_line_errors(ckpts, tmp_path, what, make, message):
    target = ckpts["Qwen3ForCausalLM"]
    draft = tmp_path / "draft"
    make(draft, target.path)
    engine = HybridEngine.from_pretrained(target.path, **ENGINE_ARGS)
    with pytest.raises(ModelDirError, match=message) as info:
        load_dflash_drafter(draft, engine.cfg, engine.model.w)
    assert "\n" not in str(info.value) and str(draft) in str(info.value), what
    with pytest.raises(ModelDirError, match=message):
        HybridEngine.from_pretrained(target.path, draft_model=draft, **ENGINE_ARGS)
