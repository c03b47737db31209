"""The decode and verify forwards trace whole with torch.compile(fullgraph=True) on the CPU.

A forward prepared `static` (HybridEngine.prepare) has no host logic that depends on data: no
reads back, no data-dependent shapes, no Python branching on tensor values -- the property a CUDA
graph needs. `fullgraph=True` turns any graph break into an error, so tracing is the proof; the
traced forward's logits are then compared with the eager forward on the engine's usual path (the
host attention plan, the in-place GDN decode) over the same committed state.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fxsched.runtime.torch_model import HybridEngine  # noqa: E402
from fxsched.runtime.torch_model.default_model import default_model_dir  # noqa: E402

PROMPTS = ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [3, 4, 5])


def _engine() -> HybridEngine:
    engine = HybridEngine.from_pretrained(default_model_dir(), max_slots=4)
    for slot, prompt in enumerate(PROMPTS):
        engine.alloc(slot)
        engine.prefill(slot, prompt)
    return engine


@pytest.mark.parametrize("rows", [[[1], [2]], [[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3], [4]]],
                         ids=["decode", "verify", "ragged-verify"])
def test_forward_traces_whole_and_matches_the_eager_path(rows):
    torch._dynamo.reset()
    decode = all(len(r) == 1 for r in rows)
    traced_engine, eager_engine = _engine(), _engine()
    batch = traced_engine.prepare([0, 1], rows, in_place=decode, static=True)
    assert batch.attn is None

    def forward(b):
        out = traced_engine.model.forward(b, traced_engine.kv, traced_engine.gdn)
        return out.logits

    compiled = torch.compile(forward, fullgraph=True, backend="eager")
    with torch.no_grad():
        traced = compiled(batch)
        eager = eager_engine.model.forward(eager_engine.prepare([0, 1], rows, in_place=decode),
                                           eager_engine.kv, eager_engine.gdn).logits
    for b, toks in enumerate(rows):
        torch.testing.assert_close(traced[b, :len(toks)], eager[b, :len(toks)], atol=1e-4, rtol=1e-4)
    if decode:  # both updated the GDN states in place, the same way
        for a, e in zip(traced_engine.gdn.recurrent, eager_engine.gdn.recurrent, strict=True):
            seated = slice(0, len(PROMPTS))  # the others were never seated: their state is undefined
            torch.testing.assert_close(a[seated], e[seated], atol=1e-5, rtol=1e-5)
