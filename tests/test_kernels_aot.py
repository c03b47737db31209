"""Every Triton kernel compiled ahead of time for sm_90 with no GPU (Triton ships ptxas), in a fresh
process without TRITON_INTERPRET (specs/gpu-kernels.md §17.3, §17.4): nothing spills at any listed
model shape, dtype and K; the registers and stack read from the cubins agree with Triton's bundled
cuobjdump, and a kernel made to spill is seen spilling. ``pytest -s`` prints the table.

About 20 s of CPU on a cold Triton cache (the test uses a fresh one): ``compile_all`` compiles each
distinct (kernel, signature, constexprs, warps, stages) once, and the 183 rows share 61 of them.
"""

import json
import os
import re
import subprocess
import sys

import pytest

_SCRIPT = r"""
import json, sys
from fxsched.kernels import aot  # first: triton before the kernel modules
import triton
import triton.language as tl
from triton.compiler import ASTSource


@triton.jit
def _spilling_kernel(x_ptr, BLOCK: tl.constexpr):
    # One warp holding 8192 fp32 values (256 per thread) live across a reduction: more than the
    # 255 registers a thread can have.
    offsets = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets)
    tl.store(x_ptr + offsets, x * tl.sum(x * x, axis=0))


def cubin(kernel, signature, constexprs, warps):
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=aot.TARGET, options={"num_warps": warps})
    return compiled.asm["cubin"]


out_dir = sys.argv[1]
probes = {"spilling": cubin(_spilling_kernel, {"x_ptr": "*fp32", "BLOCK": "constexpr"}, {"BLOCK": 8192}, 1),
          "argmax": cubin(aot.row_argmax._row_argmax_kernel,
                          {"logits_ptr": "*bf16", "out_ptr": "*i64", "vocab_size": "i32", "stride_row": "i32",
                           "stride_col": "i32", "VOCAB_BLOCK": "constexpr"}, {"VOCAB_BLOCK": 1024}, 4)}
parsed = {}
for name, binary in probes.items():
    with open(f"{out_dir}/{name}.cubin", "wb") as f:
        f.write(binary)
    parsed[name] = aot.cubin_resources(binary)
print(json.dumps({"triton": triton.__version__, "probes": parsed, "rows": aot.compile_all()}))
"""


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _skip_reason() -> str:
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"triton cannot be imported: {exc}"
    if not os.path.exists(_tool("ptxas")):
        return "triton's bundled ptxas is missing; cannot compile for sm_90 here"
    return ""


pytestmark = pytest.mark.skipif(bool(_skip_reason()), reason=_skip_reason() or "n/a")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(out / "triton-cache")  # cold: every compile really runs ptxas
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default; silences Triton 3.9's warning
    script = out / "compile_for_sm90.py"  # a file: @triton.jit reads its kernel's source
    script.write_text(_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return out, json.loads(result.stdout.strip().splitlines()[-1])


def _print_table(data) -> None:
    print(f"\nsm_90 compiles, Triton {data['triton']}: kernel, shape, dtype, K, constexprs, warps, stages, "
          "registers, spills, shared bytes")
    for r in data["rows"]:
        print(f"  {r['kernel']:<24} {r['shape']:<15} {r['dtype']:<5} {r['k'] or '-':<2} {r['constexprs']:<54} "
              f"{r['num_warps']:>2} {r['num_stages']:>2} {r['n_regs']:>4} {r['n_spills']:>3} {r['shared']:>7}")


# The model shapes the brief lists: Qwen3-0.6B (D 128, 16 q / 8 kv heads), a Qwen3.5 hybrid (D 256,
# 8 / 2; GDN 128 x 128) and Qwen3-Next (D 256, 16 / 2; GDN 128 x 128).
SHAPES = ("qwen3-0.6b", "qwen3.5-hybrid", "qwen3-next")


def test_every_kernel_compiles_for_sm90_at_every_model_shape_without_spilling(compiled):
    _, data = compiled
    rows = data["rows"]
    _print_table(data)
    spilling = [r for r in rows if r["n_spills"] or r["stack_bytes"]]
    assert not spilling, spilling
    assert all(0 < r["n_regs"] <= 255 for r in rows)
    assert all(r["shared"] <= 227 * 1024 for r in rows)  # an H100 block's shared memory
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"paged_attention", "paged_attention_split", "paged_attention_reduce", "paged_kv_append",
                       "paged_attention_ragged", "paged_attention_split_ragged",
                       "gated_delta[init=True]", "gated_delta[init=False]", "gdn_fold[state]", "gdn_fold[conv]",
                       "row_argmax", "greedy_accept", "lora_shrink[r=16]", "lora_expand[r=16]", "lora_shrink[r=64]",
                       "lora_expand[r=64]"}
    for name in ("paged_attention", "paged_attention_split"):
        covered = {(r["shape"], r["dtype"], r["k"]) for r in rows if r["kernel"] == name}
        assert covered == {(s, dt, k) for s in SHAPES for dt in ("bf16", "fp32") for k in range(1, 9)}
        ragged = {(r["shape"], r["dtype"]) for r in rows if r["kernel"] == f"{name}_ragged"}  # prefill rows
        assert ragged == {(s, dt) for s in SHAPES for dt in ("bf16", "fp32")}
    gdn_shapes = {r["shape"] for r in rows if r["kernel"].startswith("gated_delta")}
    assert gdn_shapes == {"qwen3.5-hybrid", "qwen3-next"}


def test_cubin_registers_and_stack_agree_with_cuobjdump(compiled):
    out, data = compiled
    cuobjdump = _tool("cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip("triton ships no cuobjdump here")
    for name, (regs, stack) in data["probes"].items():
        usage = subprocess.run([cuobjdump, "-res-usage", str(out / f"{name}.cubin")], capture_output=True,
                               text=True, timeout=60).stdout
        found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
        assert found, usage
        assert (regs, stack) == (int(found.group(1)), int(found.group(2))), (name, usage)
    assert data["probes"]["spilling"][1] > 0  # the zero-spill check above can fail
    assert data["probes"]["argmax"][1] == 0
