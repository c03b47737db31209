"""The default model's training code (runtime/torch_model/training/).

References: the engine itself for the forwards (HybridEngine's prefill logits for the target,
PublishedMtp's K/V-cached chain, PublishedDFlash's block proposal, on the same random weights
written as a checkpoint and loaded by the loader), brute-force counting for the bigram baseline,
hand-written bytes of R's documented serialization format for the reader, and the package itself
where this machine can fetch it (Debian's r-cran-janeaustenr).
"""

from __future__ import annotations

import dataclasses
import gzip
import math
import struct
import zlib
from pathlib import Path

import pytest
import torch

from fxsched.runtime.torch_model import HybridEngine
from fxsched.runtime.torch_model.default_model import TokenIds, model_config
from fxsched.runtime.torch_model.hf_drafters import PublishedMtp
from fxsched.runtime.torch_model.hf_export import save_pretrained_dir
from fxsched.runtime.torch_model.training.austen import paragraphs, split
from fxsched.runtime.torch_model.training.dflash import DFlashSettings, drafter_spec, initial_drafter, write_drafter_dir
from fxsched.runtime.torch_model.training.distill import chain_data
from fxsched.runtime.torch_model.training.evaluate import bigram_loss, sentences, wilson_interval
from fxsched.runtime.torch_model.training.forward import (dflash_block_logits, dflash_features, mtp_chain_logits,
                                                          target_hidden, target_logits)
from fxsched.runtime.torch_model.training.rdata import RDataError, lazy_load_db, unserialize
from fxsched.runtime.torch_model.weights import init_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IDS = TokenIds(endoftext=91, im_start=92, im_end=93, think=94, think_end=95)


def small_config():
    """The default model's architecture at a small width (every feature: GDN + gated attention, MTP)."""
    cfg = model_config(IDS, max_seq_len=64, max_slots=4)
    return dataclasses.replace(cfg, vocab_size=96, hidden_size=64, intermediate_size=96, head_dim=16,
                               gdn_key_dim=16, gdn_value_dim=16, tie_word_embeddings=True, seed=3,
                               num_blocks=4 * 4, block_size=16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint of random weights with noisy norms (a mix-up of norms would show)."""
    cfg = small_config()
    w = init_weights(cfg)
    gen = torch.Generator().manual_seed(5)
    for name in sorted(w):
        if name.endswith("norm"):
            w[name] = 1.0 + 0.2 * torch.randn(w[name].shape, generator=gen)
    w["embed"] = w["embed"] * 0.5
    w["lm_head"] = w["embed"]
    out = tmp_path_factory.mktemp("ckpt")
    save_pretrained_dir(cfg, w, out)
    return cfg, w, out


def test_target_forward_equals_the_engines_prefill(checkpoint):
    cfg, w, path = checkpoint
    engine = HybridEngine.from_pretrained(path, max_seq_len=64, max_slots=2, block_size=4)
    tokens = torch.randint(0, 91, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden, _ = target_hidden(cfg, engine.model.w, tokens)
        mine = target_logits(cfg, engine.model.w, hidden)
    for b in range(2):
        engine.alloc(b)
        engine.prefill(b, tokens[b].tolist())
        theirs = engine.model.lm_head(engine.hidden_history[b, :37])
        assert (mine[b] - theirs).abs().max().item() < 2e-4
        assert torch.equal(mine[b].argmax(-1), theirs.argmax(-1))


def test_target_forward_has_gradients_for_every_tensor(checkpoint):
    cfg, w, _ = checkpoint
    params = {n: t.clone().requires_grad_(True) for n, t in w.items() if n != "lm_head"}
    params["lm_head"] = params["embed"]
    tokens = torch.randint(0, 91, (2, 20), generator=torch.Generator().manual_seed(2))
    hidden, _ = target_hidden(cfg, params, tokens[:, :-1])
    (mtp,) = mtp_chain_logits(cfg, params, tokens[:, 1:], hidden)
    loss = target_logits(cfg, params, hidden).logsumexp(-1).mean() + mtp.logsumexp(-1).mean()
    loss.backward()
    silent = [n for n, p in params.items() if n != "lm_head" and (p.grad is None or p.grad.abs().sum() == 0)]
    assert silent == []


def test_mtp_chain_equals_the_published_mtp(checkpoint):
    """mtp_chain_logits (full sequence) == PublishedMtp.propose_logits (K/V cache) for the whole chain."""
    cfg, _, path = checkpoint
    engine = HybridEngine.from_pretrained(path, max_seq_len=64, max_slots=3, block_size=4)
    assert isinstance(engine.mtp, PublishedMtp)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 91, (12,), generator=gen).tolist() for _ in range(3)]
    for slot, prompt in enumerate(prompts):
        engine.alloc(slot)
        engine.prefill(slot, prompt)
    w, depth = engine.model.w, 3
    for n in (1, 5, 9):
        slots = list(range(3))
        anchors = [p[n] for p in prompts]
        cached = engine.mtp.propose_logits(slots, [p[:n] for p in prompts], engine.hidden_history, anchors, depth)
        drafts = cached.argmax(-1)
        for b, prompt in enumerate(prompts):
            chain = []
            for k in range(1, depth):
                c = torch.zeros(1, n, dtype=torch.long)
                c[0, n - 1] = drafts[b, k - 1]
                chain.append(c)
            with torch.no_grad():
                full = mtp_chain_logits(cfg, w, torch.tensor([prompt[1:n] + [anchors[b]]]),
                                        engine.hidden_history[b:b + 1, :n], chain)
            got = torch.stack([f[0, n - 1] for f in full])
            assert (got - cached[b]).abs().max().item() < 1e-4


def test_dflash_block_forward_equals_the_published_drafter(checkpoint, tmp_path):
    cfg, _, path = checkpoint
    settings = DFlashSettings(num_layers=2, block_size=5, target_layer_ids=(0, 3), head_dim=16, intermediate_size=96)
    spec = drafter_spec(cfg, settings, mask_token_id=IDS.im_start)
    dw = initial_drafter(spec, cfg.num_layers, seed=4)
    gen = torch.Generator().manual_seed(6)
    for name in dw:
        if dw[name].dim() == 1:
            dw[name] = 1.0 + 0.2 * torch.randn(dw[name].shape, generator=gen)
    write_drafter_dir(tmp_path / "dflash", spec, dw, cfg.vocab_size, cfg.num_layers)
    engine = HybridEngine.from_pretrained(path, max_seq_len=64, max_slots=2, block_size=4,
                                          draft_model=tmp_path / "dflash")
    tokens = torch.randint(0, 91, (2, 30), generator=gen)
    anchors = torch.tensor([[7, 19, 24], [3, 11, 24]])
    w = engine.model.w
    with torch.no_grad():
        _, kept = target_hidden(cfg, w, tokens, spec.target_layer_ids)
        drafter_w = {**engine.dflash.w}
        feats = dflash_features(cfg, spec, w, drafter_w, kept)
        mine = dflash_block_logits(spec, drafter_w, feats, tokens, anchors)
    for b in range(2):
        for k, n in enumerate(anchors[b].tolist()):
            engine.alloc(b)
            engine.prefill(b, tokens[b, :n].tolist())
            engine.ctx_extend(b, n)
            theirs = engine.dflash.propose_logits([b], [int(tokens[b, n])], torch.device("cpu"))[0]
            assert (mine[b, k] - theirs).abs().max().item() < 2e-4, (b, n)
            engine.free(b)


def test_chain_data_labels_only_greedy_continuations():
    tokens = torch.tensor([[10, 11, 12, 20, 21, 22, 23]])
    greedy = torch.tensor([[5, 6, 20, 21, 22, 23, 24]])  # greedy[j]: the target's token after prefix 0..j
    hidden = torch.arange(7, dtype=torch.float32)[None, :, None].expand(1, 7, 2)
    data = chain_data(tokens, hidden, greedy, depth=3)
    assert data.next_tokens.tolist() == [[11, 12, 20, 21, 22, 23]]
    assert data.labels[0].tolist() == [[6, 20, 21, 22, 23, 24]]
    assert data.chain_tokens[0][0, :5].tolist() == [6, 20, 21, 22, 23]
    assert data.valid[1].tolist() == [[False, True, True, True, True, False]]
    assert data.valid[2].tolist() == [[False, True, True, True, False, False]]


def test_bigram_baseline_equals_brute_force_counting():
    train = torch.tensor([0, 1, 2, 1, 2, 3, 1, 0, 1, 2])
    held = torch.tensor([1, 2, 3, 0, 1])
    vocab = 5
    loss, lam = bigram_loss(train, held, vocab)
    pairs = list(zip(train[:-1].tolist(), train[1:].tolist(), strict=True))
    uni = [(train.tolist().count(v) + 1) / (len(train) + vocab) for v in range(vocab)]

    def p(a: int, b: int) -> float:
        row = [y for x, y in pairs if x == a]
        ml = row.count(b) / len(row) if row else uni[b]
        return lam * ml + (1 - lam) * uni[b]

    want = -sum(math.log(p(a, b)) for a, b in zip(held[:-1].tolist(), held[1:].tolist(), strict=True)) / (len(held) - 1)
    assert loss == pytest.approx(want, rel=1e-9)
    assert 0 < lam < 1


def test_wilson_interval_matches_the_formula_at_known_points():
    low, high = wilson_interval(50, 100)
    assert (round(low, 4), round(high, 4)) == (0.4038, 0.5962)  # the textbook value for 50 of 100
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_paragraphs_join_lines_and_drop_italic_marks():
    lines = ["CHAPTER I", "", "It is a _truth_ universally", "acknowledged, that", "", "", "\"_Yes_,\" said he."]
    assert paragraphs(lines) == ["CHAPTER I", "It is a truth universally acknowledged, that", "\"Yes,\" said he."]
    assert sentences('She smiled. "Why not?" he asked. Then she left!') == ["She smiled.", '"Why not?" he asked.',
                                                                            "Then she left!"]
    assert sentences("He saw Mr. Knightley. Mrs. Weston came.") == ["He saw Mr. Knightley.", "Mrs. Weston came."]


def test_split_holds_out_the_end_of_every_novel():
    novels = {n: [f"p{n}{i}" if j == 0 else "" for i in range(40) for j in range(2)]
              for n in ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")}
    corpus = split(novels, held_out=0.1)
    for train, held in zip(corpus.train, corpus.held_out, strict=True):
        assert len(train) == 36 and len(held) == 4 and train[-1].endswith("35") and held[0].endswith("36")


def _xdr(*ints: int) -> bytes:
    return b"".join(struct.pack(">i", i) for i in ints)


def _chars(text: str) -> bytes:
    raw = text.encode()
    return _xdr(0x00040009, len(raw)) + raw  # CHARSXP, UTF-8 flag


def test_rdata_reads_named_character_vectors_and_a_lazy_load_db():
    # list(a = c("x", NA), b = "y") in R's XDR serialization, version 3 (R Internals, "Serialization")
    names_attr = _xdr(0x00000402) + _xdr(0x00000001) + _chars("names") + _xdr(16, 2) + _chars("a") + _chars("b") + _xdr(254)
    value = (_xdr(0x00000213, 2) + _xdr(16, 2) + _chars("x") + _xdr(9, -1) + _xdr(16, 1) + _chars("y") + names_attr)
    header = b"X\n" + _xdr(3, 0x040300, 0x030500, 5) + b"UTF-8"
    assert unserialize(header + value) == {"a": ["x", None], "b": ["y"]}
    # a lazy-load database of that value: index list(variables = list(v = c(0, n)), compressed = TRUE)
    blob = struct.pack(">I", len(header + value)) + zlib.compress(header + value)
    index_names = _xdr(0x00000402) + _xdr(0x00000001) + _chars("names") + _xdr(16, 1) + _chars("v") + _xdr(254)
    variables = _xdr(0x00000213, 1) + _xdr(14, 2) + struct.pack(">dd", 0, len(blob)) + index_names
    outer_names = (_xdr(0x00000402) + _xdr(0x000000FF | (1 << 8)) + _xdr(16, 2) + _chars("variables")
                   + _chars("compressed") + _xdr(254))
    index = header + _xdr(0x00000213, 2) + variables + _xdr(10, 1, 1) + outer_names
    assert lazy_load_db(gzip.compress(index), blob) == {"v": {"a": ["x", None], "b": ["y"]}}
    with pytest.raises(RDataError, match="not an XDR"):
        unserialize(b"A\n" + value)
    with pytest.raises(RDataError, match="type 3 "):
        unserialize(header + _xdr(3))


def test_the_corpus_package_reads_when_this_machine_has_it():
    cached = sorted(Path.home().glob(".cache/fxsched/default-model/r-cran-janeaustenr_*.deb"))
    if not cached:
        pytest.skip("the Debian package r-cran-janeaustenr is not in ~/.cache/fxsched/default-model "
                    "(`python -m fxsched.runtime.torch_model.training train` fetches it)")
    from fxsched.runtime.torch_model.training.austen import read_novels

    corpus = split(read_novels(cached[-1]))
    text = corpus.train_text()
    assert text.startswith("SENSE AND SENSIBILITY") and "It is a truth universally acknowledged" in text
    assert 3_000_000 < len(text) < 4_500_000 and 150_000 < len(corpus.held_out_text()) < 400_000
    assert "_" not in text[:100_000]
