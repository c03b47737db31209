"""Fixtures shared by the torch tests."""

from __future__ import annotations

import os

import pytest
import torch

# Without CUDA the Triton kernels can only run interpreted, and the interpreter must be chosen
# before anything imports triton (flash-linear-attention and transformers import it too): set it
# here, before any test module is collected, so the order of test files does not matter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch CPU thread for a whole module: the model is tiny, and two threads on this 2-core
    machine make every step far slower. The previous count is restored afterwards."""
    from support.torch_testing import single_thread

    with single_thread():
        yield


@pytest.fixture(scope="module")
def tiny_dflash_engine(tmp_path_factory):
    """A tiny Qwen3 target with a tiny DFlash drafter (block 4) on its layers 1 and 2."""
    pytest.importorskip("transformers", reason="the tiny Qwen3 target is built with transformers")
    from support.hf_tiny import build
    from support.hf_tiny_dflash import write_tiny_dflash_for

    from fxsched.runtime.torch_model import HybridEngine
    root = tmp_path_factory.mktemp("dflash")
    target = build("Qwen3ForCausalLM", root / "target", seed=3).path
    draft = write_tiny_dflash_for(root / "draft", target, seed=1, target_layer_ids=(1, 2), block_size=4,
                                  mask_token_id=150)
    return HybridEngine.from_pretrained(target, max_seq_len=64, max_slots=4, block_size=4, draft_model=draft)
