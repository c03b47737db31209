"""``fxsched generate --ep-ranks 2`` and ``fxsched run NAME --ep-ranks 2`` leave no process behind
when they return: the workers are joined and the forkserver that launched them is stopped
(runtime/ep/run.py ``stop_launcher``), not left to notice the leader's exit later.

Each command runs in a fresh interpreter that calls ``main`` and then lists, from /proc, every
process descended from it; the list must be empty.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

from test_serve_process import child_env  # noqa: E402

CHILDREN = r"""
import json, os, sys
from fxsched.runtime.cli.app import main
code = main(sys.argv[1:])
def children(pid):
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(entry))
    return out
left, todo = [], children(os.getpid())
while todo:
    pid = todo.pop()
    left.append(pid)
    todo.extend(children(pid))
print(json.dumps({"code": code, "left": [open(f"/proc/{p}/cmdline").read().replace(chr(0), " ")[:120] for p in left]}))
"""


@pytest.mark.parametrize("argv", [
    ["generate", "--ep-ranks", "2", "--prompt-ids", "1 2 3", "--max-tokens", "3"],
    ["run", "batched_mixed", "--ep-ranks", "2"],
])
def test_no_ep_process_outlives_the_command(argv):
    done = subprocess.run([sys.executable, "-c", CHILDREN, *argv], capture_output=True, text=True, timeout=300,
                          env=child_env())
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 0, done.stderr
    assert result["left"] == [], f"processes left when {argv[0]} returned: {result['left']}"
