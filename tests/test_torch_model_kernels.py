"""The torch model with its Triton kernels on (interpreter, CPU, fp32) gives the tokens of the torch path.

Wired kernels (runtime/torch_model/kernel_paths.py): gated_delta in the GDN layer, paged_kv_append +
paged_attention in attention layers of uniform batches, gdn_fold in every commit. The checks run
in a subprocess with TRITON_INTERPRET=1 set before anything imports triton (the interpreter is
chosen when a kernel is decorated), so this pytest process never gets interpreted kernels; inside
it FXSCHED_KERNELS is flipped at run time between "triton" (a CPU engine takes the interpreted
kernels only when asked so) and "torch" (the torch path everywhere). One subprocess runs every
check (tiny config: hidden 32, 2 layers, 2 query heads over 1 KV head, head_dim 8, block 16,
8 slots) and prints a JSON report; the tests below read their part of it.

Run the checks by hand: TRITON_INTERPRET=1 python tests/test_torch_model_kernels.py (prints the report)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import pytest

MARKER = "KERNEL-CHECKS-JSON:"
KERNELS = ("gated_delta_triton", "paged_kv_append_triton", "paged_attention_triton", "gdn_fold_triton")
ATOL, RTOL = 1e-5, 1e-5


# --------------------------------------------------------------------------- pytest side

@pytest.fixture(scope="module")
def report() -> dict:
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k != "FXSCHED_KERNELS"}
    env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    assert proc.returncode == 0 and lines, f"kernel check subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    data = json.loads(lines[-1][len(MARKER):])
    if data.get("skip"):
        pytest.skip(data["skip"])
    return data


def _check(report: dict, name: str) -> dict:
    result = report["checks"][name]
    assert "error" not in result, result["error"]
    return result


def test_kernel_paths_taken_under_interpreter_only_when_asked(report):
    result = _check(report, "dispatch")
    assert result["interpreted"], "kernels were not built for the interpreter"
    assert result["predicates_on"] == [True, True, True]  # FXSCHED_KERNELS=triton
    assert result["predicates_forced_off"] == [False, False, False]  # FXSCHED_KERNELS=torch
    # Unset: a CPU engine keeps the torch path even though the interpreted kernels could run.
    assert result["predicates_cpu_default"] == [False, False, False]
    assert result["cpu_default_calls"] == {}
    # Every kernel ran in the kernels-on runs, none with FXSCHED_KERNELS=torch.
    for check in ("decode", "dflash"):
        counts = _check(report, check)
        assert all(counts["calls_on"].get(k, 0) > 0 for k in KERNELS), counts["calls_on"]
        assert counts["calls_off"] == {}, counts["calls_off"]


def test_kernel_greedy_decode_tokens_match_torch_path(report):
    result = _check(report, "decode")
    assert result["greedy_on"] == result["greedy_off"]
    assert result["batched_on"] == result["batched_off"]
    eos = result["eos_id"]  # greedy stops after eos, the batched loop does not
    cut = [row[:row.index(eos) + 1] if eos in row else row for row in result["batched_on"]]
    assert cut == result["greedy_off"]  # batched decode == one-at-a-time greedy
    assert sum(map(len, result["greedy_off"])) >= 20


def test_kernel_dflash_verify_fold_tokens_match_torch_path(report):
    result = _check(report, "dflash")
    for proposer in ("dflash", "oracle"):
        assert result[f"{proposer}_on"] == result[f"{proposer}_off"], proposer
        assert result[f"{proposer}_on"] == result["reference"], proposer
    assert result["oracle_accepted_on"] == result["oracle_accepted_off"] > 0
    assert result["ragged_steps"] > 0 and result["uniform_steps"] > 0


def test_kernel_layer_outputs_and_states_match_torch_path(report):
    result = _check(report, "layers")
    assert result["max_err"], "no comparison ran"
    bad = {name: err_tol for name, err_tol in result["max_err"].items() if not err_tol[0] <= err_tol[1]}
    assert not bad, bad
    assert result["exact_mismatches"] == [], result["exact_mismatches"]
    calls = result["ragged_kernel_calls"]
    # ragged rows: the K/V by the torch cache write, attention by the kernel's ragged launch (gpu-kernels.md §17.5)
    assert calls.get("paged_attention_triton") and "paged_kv_append_triton" not in calls, calls
    assert calls.get("gated_delta_triton") and calls.get("gdn_fold_triton"), calls


# --------------------------------------------------------------------------- subprocess side

def _tiny_config():
    from fxsched.runtime.torch_model import ModelConfig

    return ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_attention_heads=2, num_kv_heads=1, head_dim=8, gdn_num_heads=2, gdn_key_dim=8,
                       gdn_value_dim=8, conv_width=4, block_size=16, num_blocks=32, max_slots=8,
                       max_seq_len=64, dflash_gamma=3, mtp=False, eos_id=5)


class _Counter:
    """Counts calls of the `*_triton` launchers the kernel dispatchers call (module globals)."""

    def __init__(self) -> None:
        from fxsched.kernels import gated_delta, gdn_fold, paged_attention, paged_kv_append

        self.calls: dict[str, int] = {}
        for module in (gated_delta, gdn_fold, paged_attention, paged_kv_append):
            for name in KERNELS:
                if hasattr(module, name):
                    setattr(module, name, self._wrap(name, getattr(module, name)))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return counted

    def take(self) -> dict[str, int]:
        calls, self.calls = self.calls, {}
        return calls


def _kernels(on: bool) -> None:
    os.environ["FXSCHED_KERNELS"] = "triton" if on else "torch"


def _both(counter: _Counter, fn):
    """fn() with kernels on, then off: (on result, off result, on calls, off calls)."""
    _kernels(True)
    counter.take()
    on = fn()
    calls_on = counter.take()
    _kernels(False)
    off = fn()
    calls_off = counter.take()
    _kernels(True)
    return on, off, calls_on, calls_off


def _prompts():
    from fxsched.runtime.bench.prompts import random_prompts

    # Lengths 3..20 with block 16: prefills and decodes cross block boundaries.
    return random_prompts(seed=7, count=4, vocab_size=64, min_len=3, max_len=20)


def check_dispatch(counter: _Counter) -> dict:
    import torch

    from fxsched.kernels import gated_delta, gdn_fold, paged_attention, paged_kv_append
    from fxsched.kernels._triton import kernel_is_interpreted
    from fxsched.runtime.torch_model.kernel_paths import (attention_kernels_apply, gdn_fold_kernel_applies,
                                                          gdn_recurrence_kernel_applies)

    kernels = [gated_delta._gated_delta_kernel, gdn_fold._gather_rows_to_slots_kernel,
               paged_attention._paged_attention_kernel, paged_kv_append._paged_kv_append_kernel]
    x = torch.zeros(2, 2)

    def predicates():
        return [attention_kernels_apply(x, x), gdn_recurrence_kernel_applies(x, x), gdn_fold_kernel_applies(x, x)]

    _kernels(True)
    on = predicates()
    _kernels(False)
    off = predicates()
    os.environ.pop("FXSCHED_KERNELS")
    default = predicates()
    from fxsched.runtime.torch_model import HybridEngine

    counter.take()
    HybridEngine(_tiny_config()).greedy_generate(_prompts()[0], 3)
    default_calls = counter.take()
    _kernels(True)
    return {"interpreted": all(kernel_is_interpreted(k) for k in kernels), "predicates_on": on,
            "predicates_forced_off": off, "predicates_cpu_default": default, "cpu_default_calls": default_calls}


def check_decode(counter: _Counter) -> dict:
    from fxsched.runtime.torch_model import HybridEngine

    cfg, prompts, max_tokens = _tiny_config(), _prompts(), 8

    def greedy():
        engine = HybridEngine(cfg)
        return [engine.greedy_generate(p, max_tokens) for p in prompts]

    def batched():  # B = 4 uniform decode batches, all max_tokens steps (no eos stop)
        engine = HybridEngine(cfg)
        slots = list(range(len(prompts)))
        out = []
        for slot, prompt in zip(slots, prompts, strict=True):
            engine.alloc(slot)
            out.append([int(engine.prefill(slot, prompt).argmax())])
        for _ in range(max_tokens - 1):
            logits = engine.decode_batch(slots, [o[-1] for o in out])
            for o, row in zip(out, logits, strict=True):
                o.append(int(row.argmax()))
        return out

    greedy_on, greedy_off, calls_on, calls_off = _both(counter, greedy)
    batched_on, batched_off, more_on, more_off = _both(counter, batched)
    for name, n in more_on.items():
        calls_on[name] = calls_on.get(name, 0) + n
    for name, n in more_off.items():
        calls_off[name] = calls_off.get(name, 0) + n
    return {"greedy_on": greedy_on, "greedy_off": greedy_off, "batched_on": batched_on,
            "batched_off": batched_off, "eos_id": cfg.eos_id, "calls_on": calls_on, "calls_off": calls_off}


class _Oracle:
    """Drafts the true greedy continuation, with a seeded draft length in 0..gamma and 25 % corruptions,
    so verify batches are both uniform and ragged and every accept length occurs."""

    def __init__(self, prompts, reference, gamma: int, stats: dict) -> None:
        import random

        self.by_prompt = {tuple(p): r for p, r in zip(prompts, reference, strict=True)}
        self.gamma, self.rng, self.stats = gamma, random.Random(11), stats
        self.prompt_len: dict[int, int] = {}

    def after_prefill(self, engine, slot, prompt_len):
        self.prompt_len[slot] = prompt_len

    def propose(self, engine, slots, pending):
        drafts = []
        for slot in slots:
            tokens = engine.tokens(slot)
            ref = self.by_prompt[tuple(tokens[:self.prompt_len[slot]])]
            done = len(tokens) - self.prompt_len[slot] + 1
            draft = list(ref[done:done + self.rng.randint(0, self.gamma)])
            drafts.append([(t + 1) % 64 if self.rng.random() < 0.25 else t for t in draft])
        key = "uniform_steps" if len({len(d) for d in drafts}) == 1 else "ragged_steps"
        self.stats[key] = self.stats.get(key, 0) + 1
        return drafts

    def after_commit(self, engine, slot, n_keep):
        pass


def check_dflash(counter: _Counter) -> dict:
    from fxsched.runtime.torch_model import HybridEngine
    from support.speculative import DFlashProposer, speculative_generate  # tests/ is the script's folder

    cfg, prompts, max_tokens = _tiny_config(), _prompts(), 10
    _kernels(False)
    reference = [HybridEngine(cfg).greedy_generate(p, max_tokens) for p in prompts]
    _kernels(True)
    stats: dict = {}

    def dflash():
        return speculative_generate(HybridEngine(cfg), prompts, max_tokens, DFlashProposer())[0]

    def oracle():
        out, spec = speculative_generate(HybridEngine(cfg), prompts, max_tokens,
                                         _Oracle(prompts, reference, cfg.dflash_gamma, stats))
        return out, spec.accepted_drafts

    dflash_on, dflash_off, calls_on, calls_off = _both(counter, dflash)
    (oracle_on, acc_on), (oracle_off, acc_off), more_on, more_off = _both(counter, oracle)
    for name, n in more_on.items():
        calls_on[name] = calls_on.get(name, 0) + n
    for name, n in more_off.items():
        calls_off[name] = calls_off.get(name, 0) + n
    return {"reference": reference, "dflash_on": dflash_on, "dflash_off": dflash_off, "oracle_on": oracle_on,
            "oracle_off": oracle_off, "oracle_accepted_on": acc_on, "oracle_accepted_off": acc_off,
            "ragged_steps": stats.get("ragged_steps", 0), "uniform_steps": stats.get("uniform_steps", 0),
            "calls_on": calls_on, "calls_off": calls_off}


def check_layers(counter: _Counter) -> dict:
    import copy

    import torch

    from fxsched.runtime.torch_model import HybridEngine
    from fxsched.runtime.torch_model.attention import attention_layer
    from fxsched.runtime.torch_model.gdn import gdn_layer
    from fxsched.runtime.torch_model.paged_kv import PagedKVCache, flat_indices
    from fxsched.runtime.torch_model.weights import init_weights

    cfg = _tiny_config()
    w = init_weights(cfg, "cpu")
    gen = torch.Generator().manual_seed(3)
    max_err: dict[str, list[float]] = {}  # name -> [max abs error, tolerance]
    exact: list[str] = []

    def compare(name, a, b, bitwise=False):
        err = float((a - b).abs().max()) if a.numel() else 0.0
        max_err[name] = [err, ATOL + RTOL * float(b.abs().max()) if b.numel() else ATOL]
        if bitwise and not torch.equal(a, b):
            exact.append(name)

    # Attention layer: decode (T=1) and verify (T=4) batches, one crossing a block boundary, GQA 2:1,
    # permuted block tables, a cache full of stale values.
    bs, layer = cfg.block_size, cfg.attn_layers[0]
    prefix = f"layers.{layer}.attn"
    for rows, seq_lens in ((1, [5, 16, 31]), (4, [0, 14, 29])):
        cache = PagedKVCache(1, cfg.num_blocks, bs, cfg.num_kv_heads, cfg.head_dim, "cpu")
        cache.k[0].normal_(generator=gen)
        cache.v[0].normal_(generator=gen)
        perm = torch.randperm(cfg.num_blocks, generator=gen).tolist()
        tables = [perm[3 * i:3 * i + -(-(n + rows) // bs)] for i, n in enumerate(seq_lens)]
        width = max(map(len, tables))
        table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        positions = torch.tensor([[n + j for j in range(rows)] for n in seq_lens])
        write = torch.tensor(sum((flat_indices(t, n, rows, bs) for t, n in zip(tables, seq_lens, strict=True)), []))
        x = torch.randn(len(seq_lens), rows, cfg.hidden_size, generator=gen)
        valid = torch.ones(len(seq_lens), rows, dtype=torch.bool)

        def attend(uniform, valid=valid, cache=cache, x=x, positions=positions, write=write, table_t=table_t):
            c = copy.deepcopy(cache)
            out = attention_layer(x, w, prefix, num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_kv_heads,
                                  head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, cache=c, cache_layer=0,
                                  positions=positions, valid=valid, write_index=write, block_tables=table_t,
                                  uniform=uniform)
            return out, c

        (out_on, c_on), (out_off, c_off), calls, _ = _both(counter, lambda: attend(True))
        assert calls.get("paged_attention_triton") == 1 and calls.get("paged_kv_append_triton") == 1, calls
        compare(f"attn[T={rows}].out", out_on, out_off)
        compare(f"attn[T={rows}].k_cache", c_on.k[0], c_off.k[0], bitwise=True)
        compare(f"attn[T={rows}].v_cache", c_on.v[0], c_off.v[0], bitwise=True)

    # GDN layer: outputs, every per-row state and the conv windows, from a non-zero initial state.
    prefix = f"layers.{cfg.gdn_layers[0]}.gdn"
    for batch, rows in ((3, 1), (3, 5)):
        x = torch.randn(batch, rows, cfg.hidden_size, generator=gen)
        state0 = 0.3 * torch.randn(batch, cfg.gdn_num_heads, cfg.gdn_key_dim, cfg.gdn_value_dim, generator=gen)
        conv0 = torch.randn(batch, cfg.gdn_conv_channels, cfg.conv_width - 1, generator=gen)
        (o_on, r_on), (o_off, r_off), calls, _ = _both(counter, lambda x=x, s=state0, c=conv0: gdn_layer(x, w, prefix, cfg, s, c))  # called at once
        assert calls.get("gated_delta_triton") == 1, calls
        compare(f"gdn[T={rows}].out", o_on, o_off)
        compare(f"gdn[T={rows}].states", r_on.states, r_off.states)
        compare(f"gdn[T={rows}].windows", r_on.windows, r_off.windows, bitwise=True)

    # Engine: identical committed states (prefilled on the torch path), then one uniform verify
    # (K = 4) with kernels on in one engine and off in the other, and a fold keeping rows 1, 3, 4
    # of the three slots; plus a fold of two slots whose rows come from two different forwards.
    prompts = _prompts()[:3]
    engines = []
    _kernels(False)
    for _ in range(2):
        engine = HybridEngine(cfg)
        for slot, prompt in enumerate(prompts):
            engine.alloc(slot)
            engine.prefill(slot, prompt)
        engines.append(engine)
    slots, verify_rows, keeps = [0, 1, 2], [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]], [1, 3, 4]
    outs = []
    for engine, on in zip(engines, (True, False), strict=True):
        _kernels(on)
        engine.verify_batched(slots, verify_rows)
        pending = engine._pending[0]
        assert pending is not None
        outs.append(pending.out)
        engine.gdn_fold_accepted(slots, keeps)
    _kernels(True)
    compare("engine.verify.logits", outs[0].logits, outs[1].logits)
    for i, (a, b) in enumerate(zip(outs[0].gdn_rows, outs[1].gdn_rows, strict=True)):
        compare(f"engine.verify.gdn{i}.states", a.states, b.states)
    on_gdn, off_gdn = engines[0].gdn, engines[1].gdn
    for i in range(on_gdn.num_layers):
        for slot, keep in zip(slots, keeps, strict=True):  # slot s is batch entry s of the verify
            compare(f"engine.fold.gdn{i}.slot{slot}", on_gdn.recurrent[i][slot], off_gdn.recurrent[i][slot])
            compare(f"engine.fold.conv{i}.slot{slot}", on_gdn.conv[i][slot], off_gdn.conv[i][slot])
            # The fold itself is a copy: the cache holds the forward's row exactly.
            rec, conv = outs[0].gdn_rows[i].row(slot, keep - 1)
            compare(f"engine.fold.exact{i}.slot{slot}", on_gdn.recurrent[i][slot], rec, bitwise=True)
            compare(f"engine.fold.exact_conv{i}.slot{slot}", on_gdn.conv[i][slot], conv, bitwise=True)
    for i in range(len(engines[0].kv.k)):
        compare(f"engine.kv{i}.k", engines[0].kv.k[i], engines[1].kv.k[i])
        compare(f"engine.kv{i}.v", engines[0].kv.v[i], engines[1].kv.v[i])
    # A ragged verify: the torch K/V write, the ragged attention launch, the GDN recurrence and fold kernels.
    ragged_logits, ragged_calls = [], {}
    for engine, on in zip(engines, (True, False), strict=True):
        _kernels(on)
        counter.take()
        ragged_logits.append(torch.cat(engine.verify_batched(slots, [[1], [2, 3], [4, 5, 6]])))
        engine.gdn_fold_accepted(slots, [1, 2, 1])
        if on:
            ragged_calls = counter.take()
    _kernels(True)
    compare("engine.ragged_verify.logits", ragged_logits[0], ragged_logits[1])
    for i in range(engines[0].gdn.num_layers):
        seated = torch.tensor(slots)  # the state of a slot never seated is undefined (GdnStateCache)
        compare(f"engine.ragged_fold.gdn{i}", engines[0].gdn.recurrent[i][seated], engines[1].gdn.recurrent[i][seated])
    # Two slots folded together whose rows come from two different forwards; slot 2 untouched.
    engine = engines[0]
    engine.verify(0, [3, 4])
    engine.verify(1, [5, 6, 7])
    before = engine.gdn.snapshot(2)
    p0, p1 = engine._pending[0], engine._pending[1]
    assert p0 is not None and p1 is not None
    first, second = p0.out, p1.out
    engine.gdn_fold_accepted([0, 1], [2, 1])
    for i in range(engine.gdn.num_layers):
        compare(f"engine.fold2.slot0.{i}", engine.gdn.recurrent[i][0], first.gdn_rows[i].row(0, 1)[0], bitwise=True)
        compare(f"engine.fold2.slot1.{i}", engine.gdn.recurrent[i][1], second.gdn_rows[i].row(0, 0)[0], bitwise=True)
        compare(f"engine.fold2.slot1.conv{i}", engine.gdn.conv[i][1], second.gdn_rows[i].row(0, 0)[1], bitwise=True)
        compare(f"engine.fold2.untouched{i}", engine.gdn.recurrent[i][2], before[i][0], bitwise=True)
    return {"max_err": max_err, "exact_mismatches": exact, "ragged_kernel_calls": ragged_calls}


def main() -> None:
    from fxsched.kernels._triton import HAVE_TRITON, interpret_requested

    if not interpret_requested():
        sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
    import torch

    torch.set_num_threads(1)
    if not HAVE_TRITON:
        print(MARKER + json.dumps({"skip": "triton (or numpy for its interpreter) is not installed"}))
        return
    counter = _Counter()
    _kernels(True)
    checks = {}
    for name, fn in (("dispatch", check_dispatch), ("decode", check_decode), ("dflash", check_dflash),
                     ("layers", check_layers)):
        try:
            checks[name] = fn(counter)
        except Exception:  # report, keep going: each test reads its own check
            checks[name] = {"error": traceback.format_exc()}
        finally:
            _kernels(True)
    print(MARKER + json.dumps({"checks": checks}))


if __name__ == "__main__":
    main()
