"""Source mutants of core/: apply text edits to a copy of the package and run code against it.

Shared by the planted bugs (tests/planted_bugs.py, tests/test_planted.py) and the mutation suite
(tests/mutants.py, tests/run_mutants.py, tests/test_mutants.py). Nothing here touches the real
core/: ``mutant`` builds a copy of the package in a temporary directory,

    tmp/fxsched/__init__.py                         (empty)
    tmp/fxsched/core/                               a copy of core/ with the edits applied
    tmp/fxsched/{effects,runtime,kernels,specs}     symlinks to the real folders

and ``run_python`` runs code there with ``python -S`` and ``PYTHONPATH=tmp:<site-packages>``. The
``-S`` matters: without it the editable install's import hook (a ``.pth`` file of site-packages)
would find the real core/ before PYTHONPATH does, and a mutant would silently test the unmutated
code. Every subprocess therefore first checks that ``fxsched.core`` was imported from ``tmp``
(``GUARD``).

An ``Edit`` names a file under core/, an original text that must occur exactly once in it, and its
replacement; ``apply_edits`` refuses an edit whose original no longer matches, so a refactor of
core/ shows up as a failure instead of a mutant that silently tests nothing.
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
from typing import Iterator, Sequence

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
LINKED = ("effects", "runtime", "kernels", "specs")


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` (which occurs exactly once in ``file``) by ``new``."""

    file: str
    old: str
    new: str


def apply_edits(sources: dict[str, str], edits: Sequence[Edit]) -> dict[str, str]:
    """``sources`` (file -> text) with ``edits`` applied in order; each original must occur once."""
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


def mutated_sources(edits: Sequence[Edit]) -> dict[str, str]:
    """The mutated text of every file ``edits`` touch (raises when an original does not match)."""
    files = {edit.file for edit in edits}
    for f in files:
        if not f.startswith("core/"):
            raise ValueError(f"{f}: mutants mutate core/ only")
    return apply_edits({f: (ROOT / f).read_text() for f in files}, edits)


def site_packages() -> list[str]:
    """Where the venv's third-party packages are (attrs, structlog, tqdm, hypothesis, pytest)."""
    paths = [sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    return list(dict.fromkeys(p for p in paths if p))


@contextlib.contextmanager
def mutant(edits: Sequence[Edit] = ()) -> Iterator[Path]:
    """A temporary package root holding ``fxsched`` with core/ mutated by ``edits``; removed after."""
    tmp = Path(tempfile.mkdtemp(prefix="fxsched-mutant-"))
    try:
        pkg = tmp / "fxsched"
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        shutil.copytree(ROOT / "core", pkg / "core", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for f, text in mutated_sources(edits).items():
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

# the walks of several seeds in one process, stopping at the first violation
WALKS = GUARD + """\
from fxsched.runtime.check.walk import walk
steps = int(sys.argv[1])
result = {"core_file": fxsched.core.__file__, "steps": 0, "violation": None}
for seed in (int(s) for s in sys.argv[2:]):
    report = walk(seed, steps=steps)
    result["steps"] += report.steps
    v = report.violation
    if v is not None:
        result["violation"] = dict({k: v[k] for k in ("invariant", "message", "step", "episode_index")}, seed=seed)
        break
print(json.dumps(result))
"""

CLI = GUARD + """\
from fxsched.runtime.cli import main
sys.argv[0] = "fxsched"
sys.exit(main(sys.argv[1:]))
"""

# pytest on the mutated package; the test files are the real ones in tests/
PYTEST = GUARD + """\
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def walk_in(root: Path, seed: int, steps: int) -> dict:
    """The walk's report (as a dict) on the package at ``root``."""
    proc = run_python(root, ["-c", WALK, str(seed), str(steps)])
    if proc.returncode != 0:
        raise RuntimeError(f"the walk subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def walk_mutant(edits: Sequence[Edit], seed: int, steps: int) -> dict:
    with mutant(edits) as root:
        return walk_in(root, seed, steps)


def cli_in(root: Path, args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The ``fxsched`` command line, run on the package at ``root``."""
    return run_python(root, ["-c", CLI, *args], cwd=cwd)


def pytest_in(root: Path, tests: Sequence[str], extra: Sequence[str] = (),
              timeout: float = 300) -> subprocess.CompletedProcess:
    """pytest over ``tests`` (paths relative to the repository) on the package at ``root``.

    The repository's pyproject.toml is the configuration (so ``tests/`` is on the path and the
    markers are known); the working directory is ``root``, so hypothesis keeps the examples a
    mutant makes fail in the temporary directory, not in the repository's database.
    """
    args = ["-c", PYTEST, "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), "-p", "no:cacheprovider",
            *extra, *(str(ROOT / t) for t in tests)]
    return run_python(root, args, timeout=timeout)
