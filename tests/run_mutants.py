"""Run the mutation suite (tests/mutants.py) and report what catches each mutant.

    python tests/run_mutants.py [ID ...] [--checker-only] [--all-tests] [--jobs 2] [--steps N]
                                [--seeds 1,2,3] [--json PATH] [--mutants-file PATH]

``--mutants-file`` takes the mutants from another Python file that defines ``MUTANTS`` the same way
(a held-out set kept outside the repository, so that the checker is not tuned on it).

For every mutant, on a mutated copy of the package (tests/support/mutation.py):

1. the checker: the random walk of ``fxsched check`` over each seed (1, 2, 3 unless told) for
   ``--steps`` steps, stopping at the first violation. A mutant is killed by the checker when the
   walk reports a violation (named with its seed, invariant and step), when the walk's process
   dies (``crash``) or when it does not finish within its time limit (``hang``).
2. the tests (not with ``--checker-only``): ``TESTS``, the golden traces, the step unit tests and
   the other fast core tests, under pytest ``-x``; the first failing test kills the mutant. They
   run only on the checker's survivors unless ``--all-tests`` is given (then the report also gives
   the tests' kill rate alone).

First the unmutated copy runs the same walks and tests: a failure there is a false alarm of the
checker or a broken test, and the run stops (exit 2), since no kill would mean anything. A mutant
whose original snippet no longer occurs exactly once in core/ is refused the same way (exit 2).

The report prints, per mutant, what killed it, then the kill rates (checker alone, tests alone
when measured, checker + tests), the kills per module and the survivors with their descriptions.
Exit status: 0 when the run completed (whatever the rates), 2 when it could not be trusted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ itself, also under ``python -m tests.run_mutants``

import importlib.util  # noqa: E402

from mutants import MUTANTS, Mutant  # noqa: E402
from support.mutation import WALKS, Edit, mutant, occurrences, pytest_in, run_python  # noqa: E402

SEEDS = (1, 2, 3)
STEPS = 50_000

# the tests a mutant meets after the checker: fast, CPU only, about 20 s together on 2 cores
TESTS = (
    "tests/test_goldens.py",
    "tests/test_step_unit.py",
    "tests/test_phase_table.py",
    "tests/test_prefill.py",
    "tests/test_lifecycle.py",
    "tests/test_speculation.py",
    "tests/test_faults.py",
    "tests/test_interpreter.py",
    "tests/test_records.py",
    "tests/test_checker.py",
    "tests/test_liveness_rules.py",
)

NOT_IMPORTED = "MUTANT NOT IMPORTED"


class Untrusted(Exception):
    """The run cannot be trusted: the mutated copy was not what ran, or the clean copy fails."""


def _tail(text: str, n: int = 300) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "")[-n:]


def run_checker(root: Path, seeds: tuple[int, ...], steps: int, timeout: float) -> Optional[dict[str, Any]]:
    """What the walks report on the package at ``root``: ``None`` when nothing was found."""
    try:
        proc = run_python(root, ["-c", WALKS, str(steps), *map(str, seeds)], timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"kind": "hang", "message": f"the walks did not finish within {timeout:.0f} s"}
    if NOT_IMPORTED in proc.stderr:
        raise Untrusted(proc.stderr.strip())
    if proc.returncode != 0:
        return {"kind": "crash", "message": _tail(proc.stderr)}
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    v = data["violation"]
    if v is None:
        return None
    return {"kind": "violation", "seed": v["seed"], "invariant": v["invariant"], "step": v["step"],
            "message": v["message"][:300]}


def run_tests(root: Path, timeout: float) -> Optional[dict[str, Any]]:
    """The first test of ``TESTS`` that fails on the package at ``root``: ``None`` when all pass."""
    try:
        proc = pytest_in(root, TESTS, ["-x", "-q", "-rfE", "--no-header", "-W", "ignore"], timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"kind": "hang", "test": f"the tests did not finish within {timeout:.0f} s"}
    if NOT_IMPORTED in proc.stderr or NOT_IMPORTED in proc.stdout:
        raise Untrusted(proc.stderr.strip() or proc.stdout.strip())
    if proc.returncode == 0:
        return None
    for line in proc.stdout.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            test = line.split(" ", 1)[1].split(" - ", 1)[0]
            return {"kind": "test", "test": test[test.find("tests/"):] if "tests/" in test else test}
    return {"kind": "error", "test": f"pytest exit {proc.returncode}: {_tail(proc.stdout + proc.stderr)}"}


def check_snippets(mutants: tuple[Mutant, ...]) -> list[str]:
    """Every mutant edit whose original no longer occurs exactly once in core/."""
    problems = []
    for m in mutants:
        for edit in m.edits:
            count = occurrences(edit)
            if count != 1:
                problems.append(f"{m.id}: {edit.file} holds the original {count} times: {edit.old[:70]!r}")
    return problems


def measure(edits: tuple[Edit, ...], args: argparse.Namespace) -> dict[str, Any]:
    """Checker then tests on one mutated copy."""
    start = time.monotonic()
    with mutant(edits) as root:
        checker = run_checker(root, args.seeds, args.steps, args.checker_timeout)
        tests = None
        tested = False
        if not args.checker_only and (checker is None or args.all_tests):
            tests = run_tests(root, args.tests_timeout)
            tested = True
    return {"checker": checker, "tests": tests, "tested": tested, "seconds": round(time.monotonic() - start, 1)}


def describe(found: Optional[dict[str, Any]]) -> str:
    if found is None:
        return "-"
    if found["kind"] == "violation":
        return f"{found['invariant']} (seed {found['seed']}, step {found['step']})"
    if found["kind"] == "test":
        return found["test"]
    return f"{found['kind']}: {found.get('message') or found.get('test')}"


def rate(n: int, total: int) -> str:
    return f"{n}/{total} = {100.0 * n / total:.1f} %" if total else "0/0"


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    total = len(results)
    by_checker = [r for r in results if r["checker"] is not None]
    by_tests = [r for r in results if r["tests"] is not None]
    combined = [r for r in results if r["checker"] is not None or r["tests"] is not None]
    print()
    print(f"mutants: {total}   checker: seeds {','.join(map(str, args.seeds))} x {args.steps} steps")
    print(f"checker alone:     {rate(len(by_checker), total)}")
    if args.all_tests and not args.checker_only:
        print(f"tests alone:       {rate(len(by_tests), total)}")
    if not args.checker_only:
        print(f"checker + tests:   {rate(len(combined), total)}")
    kinds = Counter(r["checker"]["invariant"] if r["checker"]["kind"] == "violation" else r["checker"]["kind"]
                    for r in by_checker)
    print("checker kills by invariant: " + ", ".join(f"{k}={n}" for k, n in kinds.most_common()))
    per_module: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for r in results:
        row = per_module[r["module"]]
        row[0] += 1
        row[1] += r["checker"] is not None
        row[2] += r["checker"] is not None or r["tests"] is not None
    print("per module (mutants, checker, checker + tests): "
          + ", ".join(f"{m} {a}/{b}/{c}" for m, (a, b, c) in sorted(per_module.items())))
    survivors = [r for r in results if r["checker"] is None]
    if survivors:
        print("survivors of the checker:")
        for r in survivors:
            caught = "" if args.checker_only else f"   [tests: {describe(r['tests'])}]"
            print(f"  {r['id']}: {r['description']}{caught}")
    return {
        "seeds": list(args.seeds), "steps": args.steps, "tests": list(TESTS), "total": total,
        "checker_kills": len(by_checker), "test_kills": len(by_tests) if args.all_tests else None,
        "combined_kills": None if args.checker_only else len(combined), "mutants": results,
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="run_mutants", description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", nargs="*", help="run only these mutants (default: all)")
    parser.add_argument("--checker-only", action="store_true", help="do not run the tests")
    parser.add_argument("--all-tests", action="store_true", help="run the tests on every mutant, not only survivors")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=STEPS, help="steps of the walk per seed")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated walk seeds")
    parser.add_argument("--json", type=Path, help="write every result to this file")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run on the unmutated copy")
    parser.add_argument("--mutants-file", type=Path, help="take MUTANTS from this file instead of tests/mutants.py")
    args = parser.parse_args(argv)
    args.mutants = MUTANTS
    if args.mutants_file is not None:
        if not args.mutants_file.is_file():
            parser.error(f"--mutants-file {args.mutants_file}: no such file")
        spec = importlib.util.spec_from_file_location("heldout_mutants", args.mutants_file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # (a dataclass there looks its module up while it is made)
        spec.loader.exec_module(module)
        args.mutants = tuple(module.MUTANTS)
    try:
        args.seeds = tuple(int(s) for s in args.seeds.split(","))
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: not a comma-separated list of integers")
    if args.steps < 1 or args.jobs < 1:
        parser.error("--steps and --jobs must be at least 1")
    by_id = {m.id: m for m in args.mutants}
    unknown = [i for i in args.ids if i not in by_id]
    if unknown:
        parser.error(f"no mutant named {', '.join(unknown)}")
    # generous limits: a walk runs at 10k+ steps/s even on a loaded machine
    args.checker_timeout = 60 + len(args.seeds) * args.steps / 1000
    args.tests_timeout = 300
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    by_id = {m.id: m for m in args.mutants}
    chosen = tuple(by_id[i] for i in args.ids) if args.ids else args.mutants
    problems = check_snippets(chosen)
    if problems:
        print("refused: the mutants no longer match core/ (update tests/mutants.py):\n  " + "\n  ".join(problems))
        return 2
    try:
        if not args.no_baseline:
            clean = measure((), argparse.Namespace(**{**vars(args), "all_tests": True}))
            if clean["checker"] is not None or clean["tests"] is not None:
                print(f"refused: the unmutated code fails: checker {describe(clean['checker'])}, "
                      f"tests {describe(clean['tests'])}")
                return 2
            print(f"baseline: the unmutated copy passes the checker and the tests ({clean['seconds']} s)")
        results: list[dict[str, Any]] = []

        def one(m: Mutant) -> dict[str, Any]:
            return {"id": m.id, "module": m.module, "description": m.description, **measure(m.edits, args)}

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for r in pool.map(one, chosen):
                tests = f"   tests: {describe(r['tests'])}" if r["tested"] else ""
                print(f"{r['id']:42} checker: {describe(r['checker'])}{tests}   ({r['seconds']} s)", flush=True)
                results.append(r)
    except Untrusted as e:
        print(f"refused: the mutated package was not the one that ran: {e}")
        return 2
    summary = report(results, args)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
