"""GPU checks of the torch runtime device (skipped without CUDA; run by tests/gpu/check.sh).

* Triton kernels on (default) and off (``FXSCHED_KERNELS=torch``) give identical tokens;
* speculation is lossless on CUDA too;
* create_stream / create_event are real CUDA streams and events.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from fxsched.runtime.generate import generate  # noqa: E402
from support.oracle import OracleDrafter  # noqa: E402
from fxsched.runtime.devices.streams import StreamSet  # noqa: E402
from fxsched.runtime.torch_model import HybridEngine, default_config  # noqa: E402
from fxsched.runtime.bench.prompts import random_prompts  # noqa: E402

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def cfg():
    return default_config()


@pytest.fixture(scope="module")
def prompts(cfg):
    return random_prompts(seed=99, count=12, vocab_size=cfg.vocab_size, max_len=40)


def run(cfg, prompts, spec, batch, drafter=None):
    return generate(HybridEngine(cfg, device="cuda"), prompts, MAX_TOKENS, spec, batch, drafter=drafter, strict=True)


@pytest.fixture(scope="module")
def reference(cfg, prompts):
    return run(cfg, prompts, "none", 4).outputs


def test_triton_path_is_taken_on_cuda():
    from fxsched.kernels import _triton
    from fxsched.kernels.row_argmax import _row_argmax_kernel

    if not _triton.HAVE_TRITON:
        pytest.skip("triton is not installed: the kernels fall back to the torch references")
    x = torch.randn(4, 64, device="cuda")
    assert _triton.use_triton(x, kernel=_row_argmax_kernel)


@pytest.mark.parametrize("spec, batch", [("none", 4), ("mtp", 3), ("dflash", 3), ("ngram", 1)])
def test_kernels_on_and_off_give_identical_tokens(cfg, prompts, reference, spec, batch, monkeypatch):
    drafter = OracleDrafter(prompts, reference, cfg.vocab_size, noise=0.2, seed=5) if spec in ("mtp", "dflash") else None
    monkeypatch.delenv("FXSCHED_KERNELS", raising=False)
    on = run(cfg, prompts, spec, batch, drafter)
    monkeypatch.setenv("FXSCHED_KERNELS", "torch")
    if drafter is not None:
        drafter = OracleDrafter(prompts, reference, cfg.vocab_size, noise=0.2, seed=5)
    off = run(cfg, prompts, spec, batch, drafter)
    assert on.outputs == off.outputs
    assert on.outputs == reference


@pytest.mark.parametrize("spec", ["mtp", "dflash"])
def test_model_drafters_lossless_on_cuda(cfg, prompts, reference, spec):
    assert run(cfg, prompts, spec, 3).outputs == reference


def test_real_cuda_streams_and_events():
    streams = StreamSet("cuda")
    s, e = streams.create_stream(), streams.create_event()
    assert isinstance(streams.stream(s), torch.cuda.Stream)
    assert isinstance(streams.event(e), torch.cuda.Event)
    with streams.use(s):
        x = torch.ones(1024, 1024, device="cuda") @ torch.ones(1024, 1024, device="cuda")
    streams.record_event(e, s)
    streams.stream_wait_event(0, e)
    streams.synchronize(s)
    assert streams.event(e).query()
    streams.sync_secondary()
    assert float(x[0, 0]) == 1024.0
