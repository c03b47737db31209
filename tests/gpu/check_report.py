"""The bookkeeping of tests/gpu/check.sh, standard library only (it must work when torch does not).

* ``junit FILE --json OUT --rc N [--cuda yes|no]``: the GPU-marked tests' results from pytest's
  JUnit XML: counts, each test's outcome, each failure's or error's first line, collection errors
  (a module that could not be imported), and the step's verdict.
* ``report --steps DIR --out FILE --order a,b,c ...``: one JSON object of every step, merged from
  what check.sh wrote for each (NAME.meta.json: exit status, seconds, limit, or why it never ran)
  and what the step wrote itself (NAME.json: its figures, and its own ``status`` / ``reason``);
  prints a one-line-per-step table; exit status 1 when a step failed.

A step's status: ``skipped`` with a reason (never started: the time budget, or a step it needs
failed; or the step says so itself, e.g. "no CUDA"), ``failed`` with a reason (a non-zero exit: its
own reason, else "timed out after N s" or the last line of its output), else ``ok``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import socket
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Optional


def _first_line(text: Optional[str]) -> str:
    return next((line.strip() for line in (text or "").splitlines() if line.strip()), "")[:300]


def parse_junit(path: Path) -> dict[str, Any]:
    root = ET.parse(path).getroot()
    tests: list[dict[str, Any]] = []
    collection_errors: list[dict[str, str]] = []
    collection_skips: list[dict[str, str]] = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        entry: dict[str, Any] = {"test": name, "outcome": "passed", "seconds": float(case.get("time") or 0)}
        skipped = case.find("skipped")
        if skipped is not None and skipped.get("message") == "collection skipped":
            # a whole module skipped while collecting (pytest.importorskip at its top): not a test
            why = re.search(r"Skipped: (.*?)['\"]?\)?$", (skipped.text or "").strip())
            collection_skips.append({"module": name, "reason": why.group(1) if why else _first_line(skipped.text)})
            continue
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                entry["outcome"] = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = node.get("message") or node.text
                entry["message"] = _first_line(message)
                if tag == "error" and "collection" in (node.get("message") or "").lower():
                    raised = [line[1:].strip() for line in (node.text or "").splitlines() if line.startswith("E ")]
                    entry["message"] = raised[-1][:300] if raised else _first_line(node.text or message)
                    collection_errors.append({"module": name, "message": entry["message"]})
                break
        tests.append(entry)
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    return {"counts": counts, "collected": len(tests), "collection_errors": collection_errors,
            "modules_skipped_at_collection": collection_skips, "tests": tests}


def cmd_junit(args: argparse.Namespace) -> int:
    path = Path(args.file)
    result: dict[str, Any] = {"pytest_rc": args.rc}
    if not path.exists():
        result.update(status="failed", reason=f"pytest wrote no JUnit XML (exit {args.rc})")
    else:
        result.update(parse_junit(path))
        counts = result["counts"]
        bad = [t for t in result["tests"] if t["outcome"] in ("failed", "error")]
        if bad:
            first = bad[0]
            result.update(status="failed", reason=f"{counts['failed']} failed, {counts['error']} errors; first: "
                                                  f"{first['test']}: {first.get('message', '')}")
        elif args.rc not in (0, 5):
            result.update(status="failed", reason=f"pytest exit status {args.rc}")
        elif result["collected"] == 0:
            result.update(status="failed", reason="no gpu-marked test collected")
        elif counts["skipped"] == result["collected"]:
            why = "no CUDA" if args.cuda == "no" else "every test skipped"
            result.update(status="skipped", reason=f"{why}: {result['collected']} gpu tests collected, "
                                                   f"{len(result['collection_errors'])} collection errors, all skipped "
                                                   f"({len(result['modules_skipped_at_collection'])} modules "
                                                   "skipped at collection: see modules_skipped_at_collection)")
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    for t in result.get("tests", []):
        print(f"{t['outcome']:8s} {t['test']}  {t.get('message', '')}")
    return 0


def _tail(path: Path, lines: int = 1) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip()[:300] for line in text[-lines:])


def load_step(steps: Path, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    figures: dict[str, Any] = {}
    meta_path, figures_path = steps / f"{name}.meta.json", steps / f"{name}.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
    if figures_path.exists():
        try:
            figures = json.loads(figures_path.read_text())
        except ValueError as err:
            figures = {"unreadable": str(err)}
    own_status, own_reason = figures.pop("status", None), figures.pop("reason", None)
    step: dict[str, Any] = {"status": "ok", "reason": None, "seconds": meta.get("seconds"),
                            "limit_s": meta.get("limit_s"), "rc": meta.get("rc")}
    rc = meta.get("rc")
    if not meta:
        step.update(status="skipped", reason="never reached")
    elif meta.get("skipped"):
        step.update(status="skipped", reason=meta["skipped"])
    elif rc in (124, 137):
        step.update(status="failed", reason=f"timed out after {meta.get('limit_s')} s"
                                           + (f" ({own_reason})" if own_reason else ""))
    elif rc != 0:
        step.update(status="failed", reason=own_reason or _tail(steps / f"{name}.log", 2) or f"exit status {rc}")
    elif own_status in ("failed", "skipped"):
        step.update(status=own_status, reason=own_reason)
    step["figures"] = figures
    return step


def cmd_report(args: argparse.Namespace) -> int:
    steps_dir = Path(args.steps)
    order = [n for n in args.order.split(",") if n]
    steps = {name: load_step(steps_dir, name) for name in order}
    summary = {k: [n for n, s in steps.items() if s["status"] == k] for k in ("ok", "failed", "skipped")}
    report = {
        "check": "tests/gpu/check.sh",
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "budget_s": args.budget,
        "total_s": args.total,
        "summary": summary,
        "steps": steps,
    }
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(out)
    print(f"== gpu_check summary ({args.total} s of {args.budget} s): {len(summary['ok'])} ok, "
          f"{len(summary['failed'])} failed, {len(summary['skipped'])} skipped -> {out}")
    for name, step in steps.items():
        seconds = "" if step["seconds"] is None else f"{step['seconds']:7.1f}s"
        reason = f"  {step['reason']}" if step["reason"] else ""
        print(f"  {name:12s} {step['status']:8s}{seconds:>9s}{reason}")
    return 1 if summary["failed"] else 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    junit = sub.add_parser("junit")
    junit.add_argument("file")
    junit.add_argument("--json", required=True)
    junit.add_argument("--rc", type=int, required=True)
    junit.add_argument("--cuda", choices=["yes", "no"], default="yes")
    report = sub.add_parser("report")
    report.add_argument("--steps", required=True)
    report.add_argument("--out", required=True)
    report.add_argument("--order", required=True)
    report.add_argument("--budget", type=int, default=0)
    report.add_argument("--total", type=int, default=0)
    args = parser.parse_args(argv)
    return cmd_junit(args) if args.command == "junit" else cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
