"""The LoRA Triton kernels inside the model (specs/lora.md §18.2, gpu-kernels.md §17.7): with the
kernels on (the interpreter, CPU, fp32), a batch mixing adapters and the base model gives PEFT's
logits on Qwen3, the Qwen3.5 hybrid (GDN projections) and Qwen3.5-MoE (the fused shared expert,
whose gate and up are views of one product: the expand adds into them in place).

This is what CUDA runs (`lora_kernels_apply`: CUDA tensors always, the CPU only with
FXSCHED_KERNELS=triton), proven without a GPU. The check runs in a subprocess with TRITON_INTERPRET=1
set before anything imports triton (the interpreter is chosen when a kernel is decorated), reusing
tests/test_lora.py's PEFT cases, and counts the kernel launches so that a run that quietly took the
torch path fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("triton")

MARKER = "LORA-TRITON-JSON:"
TESTS = Path(__file__).resolve().parent

_SCRIPT = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
import test_lora as T
from support.hf_tiny import build, transformers_torch_gdn
from fxsched.kernels import lora_sgmv
from fxsched.kernels._triton import kernel_is_interpreted

calls = {"shrink": 0, "expand": 0}

def counted(name, fn):
    def run(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return run

lora_sgmv.lora_shrink_triton = counted("shrink", lora_sgmv.lora_shrink_triton)
lora_sgmv.lora_expand_triton = counted("expand", lora_sgmv.lora_expand_triton)
root = Path(sys.argv[2])  # the test's own temporary folder: nothing left behind
cases = {"Qwen3": ("Qwen3ForCausalLM", T.QWEN3_ADAPTERS, 0, 10),
         "Qwen3.5": ("Qwen3_5ForCausalLM", T.QWEN35_ADAPTERS, 1, 20),
         "Qwen3.5-MoE": ("Qwen3_5MoeForCausalLM", T.QWEN35_MOE_ADAPTERS, 2, 30)}
errors = {}
with transformers_torch_gdn():
    for family, (arch, specs, seed, adapter_seed) in cases.items():
        ad = T._adapters(build(arch, root / family / "base", seed=seed), root / family, specs, seed=adapter_seed)
        try:
            T._mixed(ad, family)
        except AssertionError as err:
            errors[family] = str(err)[:500]
print("MARKER" + json.dumps({"interpreted": kernel_is_interpreted(lora_sgmv._lora_shrink_kernel),
                             "figures": T.FIGURES, "errors": errors, "calls": calls}))
""".replace("MARKER", MARKER)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("lora_triton")
    script = folder / "check.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, TRITON_INTERPRET="1", FXSCHED_KERNELS="triton", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), str(TESTS), str(folder)], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    assert proc.returncode == 0 and lines, f"the check failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len(MARKER):])


def test_the_model_took_the_interpreted_lora_kernels(report):
    assert report["interpreted"]
    # every adapted projection of every forward: far more than one launch per family
    assert report["calls"]["shrink"] >= 100 and report["calls"]["shrink"] == report["calls"]["expand"], report


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tests/gpu/check.sh)")
def test_on_cuda_a_mixed_batch_takes_the_compiled_kernels_and_matches_peft(tmp_path, monkeypatch):
    """The same mixed batch on CUDA (fp32: IEEE dots), the kernels compiled; PEFT on the CPU."""
    sys.path.insert(0, str(TESTS))
    import test_lora as T
    from support.hf_tiny import build

    from fxsched.kernels import lora_sgmv

    calls = []
    monkeypatch.setattr(lora_sgmv, "lora_expand_triton",
                        lambda *a, _f=lora_sgmv.lora_expand_triton: calls.append(1) or _f(*a))
    ad = T._adapters(build("Qwen3ForCausalLM", tmp_path / "base", seed=0), tmp_path, T.QWEN3_ADAPTERS, seed=10)
    T._mixed(ad, "Qwen3 on CUDA", device="cuda", atol=1e-3)
    assert len(calls) >= 100


@pytest.mark.parametrize("family", ["Qwen3", "Qwen3.5", "Qwen3.5-MoE"])
def test_mixed_batches_through_the_kernels_match_peft(report, family):
    assert family not in report["errors"], report["errors"][family]
    [figure] = [v for k, v in report["figures"].items() if k.startswith(f"{family} mixed")]
    assert figure <= 1e-4, report["figures"]
