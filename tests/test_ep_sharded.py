"""Expert parallelism with sharded experts (specs/expert-parallel.md §10.2-3): tiny random Qwen3.5-MoE
and Qwen3-Next checkpoints (support.hf_tiny, written with transformers), 2 and 4 ranks over gloo.

The reference is always the same checkpoint on one rank, whole: logits of direct forwards within
1e-5, greedy tokens equal in every speculation mode, each rank's expert bytes a 1/N share of the
whole model's, and a rank killed or stopped mid-generation ending the run with one error line.
Every test leaves no process behind (the fixture checks, then kills and fails)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch.distributed")
pytest.importorskip("transformers")

import torch  # noqa: E402

from fxsched.runtime.ep import generate as ep_generate  # noqa: E402
from fxsched.runtime.ep.experts import ExpertGroup, ExpertShardSpec, weights_report  # noqa: E402
from fxsched.runtime.ep.generate import generate_ep  # noqa: E402
from fxsched.runtime.ep.run import EpCluster, EpRunError  # noqa: E402
from fxsched.runtime.ep.worker import WorkerOptions, snapshot_from_json  # noqa: E402
from fxsched.runtime.generate import GenerateResult, generate  # noqa: E402
from fxsched.runtime.torch_model import ConfigError, HybridEngine, load_pretrained  # noqa: E402
from fxsched.runtime.torch_model import hf_shards  # noqa: E402
from fxsched.runtime.torch_model.hf_checkpoint import load_expert_shards  # noqa: E402
from fxsched.runtime.torch_model.moe import (  # noqa: E402
    EXPERT_PARTS,
    ExpertShardError,
    expert_bounds,
    expert_shards,
    moe_prefixes,
    weight_bytes,
)
from support.ep_faults import no_process_left  # noqa: E402, F401 (autouse)
from support.hf_tiny import build  # noqa: E402
from support.hf_tiny_dflash import write_tiny_dflash_for  # noqa: E402
from support.toy_model import run_fxsched  # noqa: E402

ARCHS = ("Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
SPECS = ("none", "mtp", "ngram", "dflash")
PROMPT = [3, 5, 7, 11, 13, 17]
MAX_TOKENS = 10
TOLERANCE = 1e-5  # fp32 logits against one rank (the order of the ranks' additions differs)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Architecture -> (checkpoint directory, a DFlash drafter directory for it)."""
    root = tmp_path_factory.mktemp("ep_sharded")
    out = {}
    for arch in ARCHS:
        path = build(arch, root / arch).path
        out[arch] = (path, write_tiny_dflash_for(root / f"{arch}-dflash", path))
    return out


def _engine(models, arch: str, spec: str = "none", ranks: int = 1) -> HybridEngine:
    path, drafter = models[arch]
    return HybridEngine.from_pretrained(path, draft_model=drafter if spec == "dflash" else None,
                                        expert_shard=(0, ranks) if ranks > 1 else None)


_REFERENCE: dict[tuple[str, str], GenerateResult] = {}


def _prompts(models, arch: str, spec: str) -> list[list[int]]:
    """PROMPT, and the model's own 8-token continuation of it followed by PROMPT again (so that the
    n-gram drafter finds the continuation in the context and proposes: it does for one sequence,
    so ngram runs that prompt alone)."""
    if (arch, "prompts") not in _REFERENCE:
        _REFERENCE[(arch, "prompts")] = generate(_engine(models, arch), [PROMPT], 8, "none", eos_ids=())
    echo = [*_REFERENCE[(arch, "prompts")].outputs[0], *PROMPT]
    return [echo] if spec == "ngram" else [PROMPT, echo]


def _reference(models, arch: str, spec: str, prompts_of: str | None = None) -> GenerateResult:
    """One rank, whole model: `spec` on the prompts of `prompts_of` (default: its own)."""
    key = (arch, f"{spec} on {prompts_of or spec}")
    if key not in _REFERENCE:
        _REFERENCE[key] = generate(_engine(models, arch, spec), _prompts(models, arch, prompts_of or spec), MAX_TOKENS,
                                   spec, eos_ids=())
    return _REFERENCE[key]


# --- loading: each rank reads its experts, and only them ------------------------------------------


def _expert_index(name: str) -> int | None:
    """The expert of a per-expert checkpoint tensor name ("...experts.3.gate_proj.weight")."""
    parts = name.split(".")
    i = parts.index("experts")
    return int(parts[i + 1]) if parts[i + 1].isdigit() else None


@pytest.mark.parametrize("arch", ARCHS)
def test_each_rank_reads_only_its_experts_and_the_shards_make_the_whole_model(arch, models, monkeypatch):
    path = models[arch][0]
    cfg, whole = load_pretrained(path)
    reads: list[tuple[str, Any]] = []
    real_read = hf_shards._Shards.read

    def recording_read(self, name, rows=None):
        reads.append((name, rows))
        return real_read(self, name, rows)

    monkeypatch.setattr(hf_shards._Shards, "read", recording_read)
    whole_experts, whole_other = weight_bytes(whole)
    for world in (2, 4):
        per_rank = []
        for rank in range(world):
            reads.clear()
            if rank == 0:
                _, weights = load_pretrained(path, expert_shard=(0, world))
                shards = expert_shards(weights)
                assert weight_bytes(weights) == (whole_experts // world, whole_other)
            else:
                _, shards = load_expert_shards(path, rank, world)
                assert all(".experts." in name for name, _ in reads), "a worker reads experts only"
                assert sum(s.nbytes for s in shards) == whole_experts // world
            first, count = expert_bounds(cfg.num_experts, world)[rank]
            for name, rows in reads:
                if ".experts." in name:
                    index = _expert_index(name)
                    assert (first <= index < first + count) if index is not None else rows == (first, count), name
            assert [s.prefix for s in shards] == moe_prefixes(cfg)
            assert all((s.first, s.count) == (first, count) for s in shards)
            per_rank.append(shards)
        for layer, prefix in enumerate(moe_prefixes(cfg)):
            for part in EXPERT_PARTS:
                joined = torch.cat([getattr(shards[layer], part) for shards in per_rank])
                assert torch.equal(joined, whole[f"{prefix}.{part}"]), f"{prefix}.{part} at {world} ranks"


def test_a_shard_without_its_group_refuses_to_compute_and_too_many_ranks_are_refused(models, capsys):
    path = models["Qwen3_5MoeForCausalLM"][0]
    engine = _engine(models, "Qwen3_5MoeForCausalLM", ranks=2)
    engine.alloc(0)
    with pytest.raises(ExpertShardError, match=r"^layers\.0\.moe: this rank holds experts 0\.\.1 of 4 only"):
        engine.prefill(0, PROMPT)
    with pytest.raises(ExpertShardError, match="on the whole stacked tensor"):
        engine.model.w["layers.0.moe.down_proj"].sum()
    with pytest.raises(ConfigError, match="expert_shard"):
        load_pretrained(path, expert_shard=(0, 5))
    code = run_fxsched("generate", "--model", str(path), "--prompt-ids", "1 2 3", "--ep-ranks", "5", toy=False)
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and err == [f"fxsched generate: --ep-ranks 5: --model {path} takes at most 4 ranks "
                                 f"(4 experts per MoE layer, at least one per rank)"]


# --- numerics: direct forwards --------------------------------------------------------------------


class _NoDevice:
    """Stands in for the leader's device when the test drives the engine itself."""


def _forwards(engine: HybridEngine) -> list[tuple[str, torch.Tensor]]:
    """Logits of a prefill per slot, a batched verify, a batched decode and a published-MTP
    proposal (whose layer is MoE too), all on fixed tokens."""
    out = []
    engine.alloc(0)
    engine.alloc(1)
    out.append(("prefill 0", engine.prefill(0, PROMPT)))
    out.append(("prefill 1", engine.prefill(1, [23, 29, 31])))
    verify = engine.verify_batched([0, 1], [[40, 41, 42], [43, 44]])
    out += [("verify 0", verify[0]), ("verify 1", verify[1])]
    engine.gdn_fold_accepted([0, 1], [3, 2])
    out.append(("decode", engine.decode_batch([0, 1], [50, 51])))
    mtp = engine.mtp
    assert mtp is not None and hasattr(mtp, "propose_logits")
    out.append(("mtp", mtp.propose_logits([0, 1], [engine.tokens(0), engine.tokens(1)], engine.hidden_history,
                                          [60, 61], 3)))
    return out


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_of_every_forward_kind_are_within_1e5_of_one_rank(arch, ranks, models):
    path = models[arch][0]
    with torch.no_grad():
        want = _forwards(_engine(models, arch))
        engine = _engine(models, arch, ranks=ranks)
        shards = expert_shards(engine.model.w)
        with EpCluster(ranks, options=WorkerOptions(experts=ExpertShardSpec(str(path)))) as cluster:
            assert cluster.link is not None
            report = weights_report(shards, weight_bytes(engine.model.w), cluster.link.collect("weights", 60))
            group = ExpertGroup(cluster.link)
            group.bind(shards)
            leader = cluster.wrap(_NoDevice())
            got = _forwards(engine)
            group.unbind()
            leader.stop_workers()
    for (what, a), (_, b) in zip(want, got, strict=True):
        diff = float((a - b).abs().max())
        assert diff <= TOLERANCE, f"{what}: logits differ by {diff:.3g}"
    assert group.calls > 0 and "mtp.layers.0.moe" in group.by_layer
    assert len(report.ranks) == ranks
    for rank in range(1, ranks):
        worker = leader.worker_reports[rank]
        assert worker["error"] is None
        assert worker["experts"]["calls"] == group.calls and worker["experts"]["rows"] == group.rows


# --- generation: the single-rank tokens in every mode, the memory split -----------------------------


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_one_rank_in_every_speculation_mode(arch, ranks, spec, models):
    want = _reference(models, arch, spec)
    assert want.outputs == _reference(models, arch, "none", spec).outputs  # (one rank is lossless)
    result = generate_ep(_engine(models, arch, spec, ranks), _prompts(models, arch, spec), MAX_TOKENS, spec,
                         ep_ranks=ranks, model_dir=str(models[arch][0]), eos_ids=())
    assert result.outputs == want.outputs
    assert result.summary.target_forwards == want.summary.target_forwards
    assert spec == "none" or result.summary.verifies > 0
    experts = result.experts
    assert experts["calls"] > 0
    assert ("mtp.layers.0.moe" in experts["by_layer"]) == (spec == "mtp")  # the MTP module's experts too
    for rank in range(1, ranks):
        report = result.worker_reports[rank]
        assert report["error"] is None and report["final"] == []
        assert report["experts"]["calls"] == experts["calls"]
        assert [(t, snapshot_from_json(snap)) for t, snap in report["ticks"]] == result.leader_ticks
    whole_experts, whole_other = weight_bytes(_engine(models, arch).model.w)
    assert result.weights is not None
    assert result.weights.ranks == ((whole_experts // ranks, whole_other),) + ((whole_experts // ranks, 0),) * (ranks - 1)


# --- failures ------------------------------------------------------------------------------------


class _Signal:
    """A progress callback that sends `sig` to a worker once `after` tokens have been generated."""

    def __init__(self, sig: int, after: int):
        self.sig, self.after, self.count, self.at = sig, after, 0, 0.0

    def __call__(self, n: int) -> None:
        self.count += n
        if self.count >= self.after and not self.at:
            pid = multiprocessing.active_children()[0].pid
            assert pid is not None
            os.kill(pid, self.sig)
            self.at = time.monotonic()


def test_killing_a_rank_mid_generation_prints_the_tokens_so_far_and_one_error_line(models, capsys, monkeypatch):
    kill = _Signal(signal.SIGKILL, 4)
    real = ep_generate.generate

    def generate_with_kill(*args, **kwargs):
        kwargs["progress"] = kill
        args = args[:7]  # engine .. strict: the progress argument is the kill
        return real(*args, **kwargs)

    monkeypatch.setattr(ep_generate, "generate", generate_with_kill)
    path = models["Qwen3_5MoeForCausalLM"][0]
    code = run_fxsched("generate", "--model", str(path), "--prompt-ids", " ".join(map(str, PROMPT)),
                       "--max-tokens", "200", "--ignore-eos", "--max-seq-len", "256", "--ep-ranks", "2",
                       "--ep-timeout", "5", toy=False)
    ended = time.monotonic()
    out, err = capsys.readouterr()
    died = "EP worker 1 died (its process exited with code -9)"
    assert code == 1
    assert err.splitlines()[-1] == f"fxsched generate: {died}"
    assert err.splitlines()[0].startswith("fxsched generate: EP weights per rank: rank 0 ")
    assert len(err.splitlines()) == 2, err
    request, summary = out.splitlines()
    tokens = request.removeprefix("request 1: ").split(" (error: ")[0].split()
    assert request.endswith(f"(error: {died})") and len(tokens) >= kill.after
    assert tokens == [str(t) for t in generate(_engine(models, "Qwen3_5MoeForCausalLM"), [PROMPT], len(tokens),
                                               "none", eos_ids=()).outputs[0]]  # what one rank generates
    assert summary.startswith("summary: ")
    assert ended - kill.at < 5.0  # within the EP timeout: the death is seen at the next layer call


def test_a_stopped_rank_is_given_up_after_the_timeout(models):
    stop = _Signal(signal.SIGSTOP, 4)
    timeout = 2.0
    with pytest.raises(EpRunError) as info:
        generate_ep(_engine(models, "Qwen3NextForCausalLM", ranks=2), [PROMPT], 100, "none", progress=stop,
                    ep_ranks=2, model_dir=str(models["Qwen3NextForCausalLM"][0]), timeout_s=timeout, eos_ids=())
    ended = time.monotonic()
    assert str(info.value) == f"EP worker 1 did not answer within {timeout:g}s"
    result = info.value.result
    assert result is not None and [r.error for r in result.results] == [str(info.value)]
    assert len(result.results[0].tokens) >= stop.after
    assert timeout <= ended - stop.at < timeout + 3.5  # the collective's timeout, then the stopped worker is killed


# --- a dense checkpoint, and the benchmark -----------------------------------------------------------


def test_a_dense_checkpoint_has_nothing_to_shard_and_its_workers_replay_the_forwards(tmp_path):
    path = build("Qwen3_5ForCausalLM", tmp_path / "dense").path
    want = generate(HybridEngine.from_pretrained(path), [PROMPT], MAX_TOKENS, "none", eos_ids=())
    engine = HybridEngine.from_pretrained(path, expert_shard=(0, 2))  # no MoE layer: loaded whole
    assert expert_shards(engine.model.w) == []
    result = generate_ep(engine, [PROMPT], MAX_TOKENS, "none", ep_ranks=2, model_dir=str(path), eos_ids=())
    assert result.outputs == want.outputs and result.weights is None and result.experts == {}
    replica = result.worker_reports[1]["replica"]  # the worker loaded the directory itself
    assert replica["forwards"] == result.summary.target_forwards
    assert replica["disagreed"] == 0 and replica["agreed"] > 0


def test_bench_generate_over_rank_counts_reports_memory_and_collective_time(models, capsys):
    path = models["Qwen3NextForCausalLM"][0]
    assert run_fxsched("bench", "generate", "--model", str(path), "--ep-ranks", "1,2", "--batches", "2",
                       "--specs", "none", "--prompts", "held-out", "--max-tokens", "4", toy=False) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[1].split()
    assert header == ["prompts", "spec", "batch", "tokens", "tokens/s", "fwd/token", "mean_acc_len", "acc/pos",
                      "lossless", "ranks", "MiB/rank", "experts_MiB", "coll_ms/fwd", "=1rank"]
    one, two = (dict(zip(header, line.split(), strict=True)) for line in lines[2:])
    assert (one["ranks"], two["ranks"]) == ("1", "2") and two["=1rank"] == "yes"
    assert float(one["coll_ms/fwd"]) == 0 < float(two["coll_ms/fwd"])
    experts_one = float(one["experts_MiB"])
    assert [float(v) for v in two["experts_MiB"].split("/")] == pytest.approx([experts_one / 2] * 2, abs=0.01)
    whole = float(one["MiB/rank"])
    rank0, rank1 = (float(v) for v in two["MiB/rank"].split("/"))
    assert rank0 == pytest.approx(whole - experts_one / 2, abs=0.01) and rank1 == pytest.approx(experts_one / 2, abs=0.01)
    assert run_fxsched("bench", "generate", "--model", str(path), "--ep-ranks", "1,9", toy=False) == 2
    assert capsys.readouterr().err.strip() == (f"fxsched bench generate: --ep-ranks 9: --model {path} takes at "
                                               f"most 4 ranks (4 experts per MoE layer, at least one per rank)")
