"""Planted bugs: known-wrong versions of core/, written as source mutations, that the model checker
must catch (tests/test_planted.py).

Each ``PlantedBug`` names one realistic bug, the text edits that make it (``Edit``: a file under
core/, the original text, which must occur exactly once in that file, and its replacement) and the
invariant of runtime/check/invariants.py that is meant to catch it. Nothing here touches the real
core/: ``mutant`` builds a copy of the package in a temporary directory,

    tmp/fxsched/__init__.py                         (empty)
    tmp/fxsched/core/                               a copy of core/ with the edits applied
    tmp/fxsched/{effects,runtime,kernels,specs}     symlinks to the real folders

and ``run_python`` runs code there with ``python -S`` and ``PYTHONPATH=tmp:<site-packages>``. The
``-S`` matters: without it the editable install's import hook (a ``.pth`` file of site-packages)
would find the real core/ before PYTHONPATH does, and a mutant would silently test the unmutated
code. Every subprocess therefore first checks that ``fxsched.core`` was imported from ``tmp``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
LINKED = ("effects", "runtime", "kernels", "specs")

# steps of the random walk a mutant is given to be caught in (and the clean code must survive)
BUDGET = 20_000


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` (which occurs exactly once in ``file``) by ``new``."""

    file: str
    old: str
    new: str


@dataclass(frozen=True)
class PlantedBug:
    name: str
    description: str
    invariant: str  # the ``Violation.invariant`` that is meant to catch it
    edits: tuple[Edit, ...]
    seed: int = 7  # the walk's seed that catches it within ``BUDGET``


PLANTED_BUGS: tuple[PlantedBug, ...] = (
    PlantedBug(
        "leak_on_cancel",
        "a cancelled sequence is finished but its blocks and slot are never released: only its final "
        "frame is sent",
        "no_orphan_sequence",
        (
            Edit("core/tick.py",
                 "from fxsched.core.retire import compact, finish_and_release\n",
                 "from fxsched.core.retire import compact, finish_and_release, finish_frame\n"),
            Edit("core/tick.py",
                 "        if not s.finished:\n"
                 "            survivors.append(s)\n"
                 "        else:\n"
                 "            finish_and_release(s, config, out)\n",
                 "        if not s.finished:\n"
                 "            survivors.append(s)\n"
                 "        elif s.cancel_requested:\n"
                 "            out.append(finish_frame(s, config))\n"
                 "        else:\n"
                 "            finish_and_release(s, config, out)\n"),
        ),
        # seed 7 first shows the leak as a compaction into the leaked slot (compaction_target_free)
        seed=5,
    ),
    PlantedBug(
        "accepted_prefix_off_by_one",
        "a partial accept keeps one rejected draft (the serial K-verify and the batched DFlash verify)",
        "lossless",
        (
            Edit("core/kverify.py",
                 "    na = min(accepted_prefix(waiting.drafts[:nd], rows), nd)\n",
                 "    na = min(accepted_prefix(waiting.drafts[:nd], rows), nd)\n"
                 "    if na < nd:\n"
                 "        na += 1\n"),
            Edit("core/dflash.py",
                 "        na = accepted_prefix(drafts, rows)\n",
                 "        na = accepted_prefix(drafts, rows)\n"
                 "        if na < len(drafts):\n"
                 "            na += 1\n"),
        ),
    ),
    PlantedBug(
        "commit_before_fold",
        "a batched DFlash verify emits CommitAcceptedPrefixBatch before GdnFoldAccepted",
        "fold_before_commit",
        (
            Edit("core/dflash.py",
                 "    out.append(dc.GdnFoldAccepted(tuple(s.slot for s in settled_seqs), tuple(accepted), k))\n"
                 "    out.append(dc.CommitAcceptedPrefixBatch(tuple((s.seq_id, n, k)\n"
                 "                                                  for s, n in zip(settled_seqs, accepted, "
                 "strict=True))))\n",
                 "    out.append(dc.CommitAcceptedPrefixBatch(tuple((s.seq_id, n, k)\n"
                 "                                                  for s, n in zip(settled_seqs, accepted, "
                 "strict=True))))\n"
                 "    out.append(dc.GdnFoldAccepted(tuple(s.slot for s in settled_seqs), tuple(accepted), k))\n"),
        ),
    ),
    PlantedBug(
        "wrong_compaction_target",
        "compaction moves survivors to the last slot of the packed range",
        "compaction_target_free",
        (
            Edit("core/retire.py",
                 "    moves = compaction_moves([s.slot for s in active], pinned_slots)\n",
                 "    moves = compaction_moves([s.slot for s in active], pinned_slots)\n"
                 "    moves = [(index, len(active) - 1) for index, _ in moves]\n"),
        ),
    ),
    PlantedBug(
        "double_release",
        "a finished sequence's ReleaseSeq is emitted twice",
        "no_effect_on_released",
        (
            Edit("core/tick.py",
                 "        else:\n"
                 "            finish_and_release(s, config, out)\n",
                 "        else:\n"
                 "            finish_and_release(s, config, out)\n"
                 "            out.append(lc.ReleaseSeq(s.seq_id, s.slot, cache=True, "
                 "reason=lc.ReleaseReason.FINISH_SEQUENCE))\n"),
        ),
    ),
    PlantedBug(
        "acc_counts_bonus",
        "acc counts the bonus token of every verify as an accepted draft",
        "acc_accounting",
        (
            Edit("core/verifying.py",
                 '    return {"seq_len": seq_len, "acc": seq.acc + acc_gain(pre_len, seq_len)}\n',
                 '    return {"seq_len": seq_len, "acc": seq.acc + acc_gain(pre_len, seq_len) + 1}\n'),
            Edit("core/dflash.py",
                 '"acc": seq.acc + na})\n',
                 '"acc": seq.acc + na + 1})\n'),
        ),
    ),
    PlantedBug(
        "token_after_eos",
        "the plain path streams the EOS token to the client",
        "lossless",
        (
            Edit("core/emit.py",
                 "    if token in config.eos_set:\n"
                 "        return replace(seq, output=seq.output.append(token), remaining=remaining,\n",
                 "    if token in config.eos_set:\n"
                 "        stream_token(seq, token, out)\n"
                 "        return replace(seq, output=seq.output.append(token), remaining=remaining,\n"),
        ),
    ),
    PlantedBug(
        "slot_leak_on_preemption",
        "a preempted sequence is dropped without releasing its slot and blocks",
        "no_orphan_sequence",
        (
            Edit("core/memory.py",
                 "    out.append(ReleaseSeq(victim.seq_id, victim.slot, cache=True, "
                 "reason=ReleaseReason.PREEMPT_REQUEUE))\n",
                 ""),
        ),
    ),
    PlantedBug(
        "no_rewind_on_reject",
        "a rejected draft is never cut from the device's KV: no TruncateSequence (serial verifies, "
        "the batched DFlash verify, n-gram)",
        "kv_mirror",
        (
            Edit("core/verifying.py",
                 "    if seq_len < seq.seq_len:\n"
                 "        out.append(dc.TruncateSequence(seq.seq_id, seq_len))\n",
                 ""),
            Edit("core/dflash.py",
                 "        if seq_len < pre + k:\n"
                 "            truncations.append((seq_id, seq_len))\n",
                 ""),
            Edit("core/ngram.py",
                 "        out.append(dc.TruncateSequence(seq.seq_id, waiting.pre_len + 1))\n",
                 ""),
        ),
    ),
)

BY_NAME = {bug.name: bug for bug in PLANTED_BUGS}


# --- building a mutant -------------------------------------------------------------------------------


def apply_edits(sources: dict[str, str], edits: tuple[Edit, ...]) -> dict[str, str]:
    """``sources`` (path -> text) with ``edits`` applied in order; each original must occur once."""
    out = dict(sources)
    for edit in edits:
        text = out[edit.file]
        count = text.count(edit.old)
        if count != 1:
            raise ValueError(f"{edit.file}: the original text occurs {count} times, not once: {edit.old!r}")
        out[edit.file] = text.replace(edit.old, edit.new)
    return out


def occurrences(edit: Edit) -> int:
    """How often the edit's original text occurs in today's ``edit.file``."""
    return (ROOT / edit.file).read_text().count(edit.old)


def site_packages() -> list[str]:
    """Where the venv's third-party packages are (attrs, structlog, tqdm, hypothesis)."""
    paths = [sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    return list(dict.fromkeys(p for p in paths if p))


@contextlib.contextmanager
def mutant(edits: tuple[Edit, ...] = ()) -> Iterator[Path]:
    """A temporary package root holding ``fxsched`` with core/ mutated by ``edits``; removed after."""
    tmp = Path(tempfile.mkdtemp(prefix="fxsched-mutant-"))
    try:
        pkg = tmp / "fxsched"
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        shutil.copytree(ROOT / "core", pkg / "core", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        files = {edit.file for edit in edits}
        sources = {f: (ROOT / f).read_text() for f in files}
        for f, text in apply_edits(sources, edits).items():
            if not f.startswith("core/"):
                raise ValueError(f"{f}: planted bugs mutate core/ only")
            (pkg / f).write_text(text)
        for name in LINKED:
            (pkg / name).symlink_to(ROOT / name, target_is_directory=True)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# the first lines of every subprocess: prove the mutated core is the one imported
GUARD = """\
import json, os, sys
import fxsched.core, fxsched.core.machine
_root = os.path.realpath(os.environ["FXSCHED_MUTANT_ROOT"])
for _m in (fxsched.core, fxsched.core.machine):
    if not os.path.realpath(_m.__file__).startswith(_root + os.sep):
        sys.exit(f"MUTANT NOT IMPORTED: {_m.__name__} came from {_m.__file__}, not {_root}")
"""


def run_python(root: Path, args: list[str], cwd: Path | None = None, timeout: float = 120,
               guard_root: Path | None = None) -> subprocess.CompletedProcess:
    """``python -S <args>`` on the package root ``root`` (made by ``mutant``); ``GUARD`` checks
    that core/ came from ``guard_root`` (``root`` unless told otherwise: a test of the guard)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join([str(root), *site_packages()])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["FXSCHED_MUTANT_ROOT"] = str(guard_root or root)
    return subprocess.run([sys.executable, "-S", *args], cwd=cwd or root, env=env, capture_output=True,
                          text=True, timeout=timeout)


WALK = GUARD + """\
from fxsched.runtime.check.walk import walk
report = walk(int(sys.argv[1]), steps=int(sys.argv[2]))
v = report.violation
print(json.dumps({
    "core_file": fxsched.core.__file__,
    "steps": report.steps,
    "episodes": report.episodes,
    "violation": None if v is None else {k: v[k] for k in ("invariant", "message", "step", "episode_index")},
}))
"""

CLI = GUARD + """\
from fxsched.runtime.cli import main
sys.argv[0] = "fxsched"
sys.exit(main(sys.argv[1:]))
"""


def walk_in(root: Path, seed: int, steps: int = BUDGET) -> dict:
    """The walk's report (as a dict) on the package at ``root``."""
    proc = run_python(root, ["-c", WALK, str(seed), str(steps)])
    if proc.returncode != 0:
        raise RuntimeError(f"the walk subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def walk_mutant(edits: tuple[Edit, ...], seed: int, steps: int = BUDGET) -> dict:
    with mutant(edits) as root:
        return walk_in(root, seed, steps)


def cli_in(root: Path, args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The ``fxsched`` command line, run on the package at ``root``."""
    return run_python(root, ["-c", CLI, *args], cwd=cwd)


if __name__ == "__main__":  # python tests/planted_bugs.py [seed ...]: which seed catches what, how fast
    seeds = [int(a) for a in sys.argv[1:]] or [7]
    for bug in PLANTED_BUGS:
        for seed in seeds:
            r = walk_mutant(bug.edits, seed)
            v = r["violation"]
            got = "-" if v is None else f"{v['invariant']} after {r['steps']} steps ({v['message'][:80]})"
            print(f"{bug.name:28} seed {seed:3}: want {bug.invariant:26} got {got}")
