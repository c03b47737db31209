"""Late drafts (specs/async.md §16.3): a proposal answered with LATE_DRAFT placeholders, the values
arriving with the answer of the verify that consumes them.

Three levels: the core's ``late.resolved`` against hand-built waiting records; the scheduler driven
by the simulated device with late answers on and off (the same episode gives the same client
outputs, and the checker's invariants hold); and the torch device, whose greedy and seeded sampled
tokens are the same with late drafts on and off, in each proposer mode.
"""

from __future__ import annotations

import attrs
import pytest

from fxsched.core.agenda import PhaseError
from fxsched.core.events import LATE_DRAFT as L
from fxsched.core.late import resolved
from fxsched.core.phases import AwaitBatchedDflash, AwaitDflashVerify, AwaitKVerify, AwaitMtpBatch, AwaitNgramVerify


# --- the core -----------------------------------------------------------------------------------


def test_a_serial_verify_takes_the_drafts_it_ran_and_keeps_the_unused_tail():
    waiting = AwaitKVerify(seq_id=3, drafts=(L, L, L), k=3, propose_n=3, pre_len=10, dflash=False)
    got = resolved(waiting, (9, 41, 42))  # K = 3: the anchor and two drafts ran; the third was never used
    assert got == attrs.evolve(waiting, drafts=(41, 42, L))


def test_a_dflash_block_verify_takes_every_draft():
    waiting = AwaitDflashVerify(seq_id=1, drafts=(L, L, L, L), pre_len=4, draft_count=4)
    assert resolved(waiting, (7, 1, 2, 3, 4)).drafts == (1, 2, 3, 4)


def test_batched_verifies_take_each_sequences_run():
    mtp = AwaitMtpBatch(seq_ids=(1, 2), ks=(3, 2), drafts=((L, L), (L,)), pre_lens=(5, 6), draft_count=3)
    assert resolved(mtp, (9, 11, 12, 8, 21)).drafts == ((11, 12), (21,))
    dflash = AwaitBatchedDflash(seq_ids=(1, 2), drafts=((L, L), (L, L)), pre_lens=(5, 6), k=3, draft_count=2)
    assert resolved(dflash, (9, 11, 12, 8, 21, 22)).drafts == ((11, 12), (21, 22))


@pytest.mark.parametrize(("waiting", "inputs", "why"), [
    (AwaitKVerify(3, (L, L), 3, 3, 10, False), (9, 41), "verify inputs"),  # one input short
    (AwaitKVerify(3, (5, L), 3, 3, 10, False), (9, 6, 42), "draft 5 held"),  # a known draft changed
    (AwaitMtpBatch((1, 2), (2, 2), ((L,), (L,)), (5, 6), 1), (9, 11, 8), "verify inputs"),
    (AwaitNgramVerify(1, 5, 10), (9, 5), "takes no late"),  # n-gram drafts are the scheduler's own
])
def test_inputs_that_do_not_fit_the_query_are_a_phase_error(waiting, inputs, why):
    with pytest.raises(PhaseError, match=why):
        resolved(waiting, inputs)


# --- the scheduler on the simulated device -------------------------------------------------------


def test_late_answers_change_no_client_output_of_any_proposer_episode(monkeypatch):
    """Proposer episodes drawn by the walk, each run with the device answering late now and then
    (late proposals that never fail) and with it never late: every client sees the same outputs,
    and no invariant breaks."""
    import random

    from support.walk_episode import episode_outputs

    from fxsched.runtime.check.walk import random_episode
    from fxsched.runtime.devices import sim_proposals
    monkeypatch.setattr(sim_proposals, "LATE_FAILURE_CHANCE", 0.0)
    rng = random.Random(7)
    compared = 0
    while compared < 60:
        episode = random_episode(rng)
        if not episode.mode.startswith(("mtp", "dflash")):
            continue
        late, late_violation, _ = episode_outputs(attrs.evolve(episode, late_drafts=True), monkeypatch)
        plain, plain_violation, _ = episode_outputs(attrs.evolve(episode, late_drafts=False), monkeypatch)
        assert late_violation is None and plain_violation is None, (late_violation, plain_violation)
        assert late == plain, episode
        compared += 1


# --- the torch device ----------------------------------------------------------------------------


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("spec", ["mtp", "dflash"])
def test_the_torch_device_gives_the_same_tokens_with_late_drafts_on_and_off(spec, temperature, tiny_dflash_engine):
    """Greedy, and sampled with a seed (the verify then redoes its rows by rejection sampling from
    the inputs that ran): the tokens do not depend on when the drafts came back."""
    from fxsched.runtime.generate import SamplingOptions, generate
    from fxsched.runtime.torch_model import HybridEngine
    from fxsched.runtime.torch_model.default_model import default_model_dir

    engine = tiny_dflash_engine if spec == "dflash" else HybridEngine.from_pretrained(default_model_dir(), max_slots=4)
    prompts = [[5 + i, 17, 42, 7 + i, 5 + i, 17] for i in range(3)]
    sampling = SamplingOptions(temperature=temperature, seed=11)
    runs = {late: generate(engine, prompts, 20, spec=spec, eos_ids=(), sampling=sampling, late_drafts=late)
            for late in (True, False)}
    assert runs[True].outputs == runs[False].outputs
    assert runs[True].summary.verifies == runs[False].summary.verifies > 0
    assert runs[True].device.late_drafts and not runs[False].device.late_drafts


@pytest.mark.usefixtures("one_torch_thread")
def test_a_verify_whose_forward_fails_keeps_the_late_drafts_for_its_retry(monkeypatch):
    """A verify refused for lack of KV blocks is a recoverable fault: the scheduler may ask again
    with the same placeholders, so the device still holds the drafts until a forward has run them."""
    from fxsched.core.events import LATE_DRAFT
    from fxsched.runtime.devices.device import DeviceError
    from fxsched.runtime.devices.torch import TorchDevice
    from fxsched.runtime.torch_model import HybridEngine
    from fxsched.runtime.torch_model.default_model import default_model_dir
    from fxsched.runtime.torch_model.errors import OutOfBlocksError

    rows = {}
    for late in (True, False):
        dev = TorchDevice(HybridEngine.from_pretrained(default_model_dir(), max_slots=2), proposer="mtp",
                          late_drafts=late)
        dev.alloc_sequence(1, 1)
        dev.prefill(1, [3, 1, 4, 1, 5, 9], 0)
        first = dev.argmax_on_device(0, 0)
        dev.save_hidden_for_mtp(0, 0)
        drafts = dev.run_mtp_propose_multi(first, 6, 3, 1, 0, False)
        assert (drafts == [LATE_DRAFT] * 3) is late
        if late:
            def short_of_blocks(*a, _engine=dev.engine, _verify=dev.engine.verify_batched, **k):
                monkeypatch.setattr(_engine, "verify_batched", _verify)  # once: the retry runs
                raise OutOfBlocksError("forward needs 1 new KV blocks, only 0 free")
            monkeypatch.setattr(dev.engine, "verify_batched", short_of_blocks)
            with pytest.raises(DeviceError) as refused:
                dev.serial_verify("decode_verify_graphed_k4", 1, [first] + drafts)
            assert refused.value.kv_exhausted
        rows[late] = (dev.serial_verify("decode_verify_graphed_k4", 1, [first] + drafts), dev.verify_inputs())
    assert rows[True] == rows[False]
