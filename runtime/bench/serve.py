"""``fxsched bench serve``: N concurrent streaming clients against ``fxsched serve`` over loopback,
like vLLM's serving benchmark.

For each speculation mode (``--specs``; default none, mtp, dflash, ngram) the benchmark starts one
server (``python -m fxsched.runtime.cli serve --port 0 --spec MODE``, the embedded default model
unless ``--model DIR``; ``--url URL`` benches a running server instead, in its own mode) and, for
each client count (``--clients``, default 1,8,32), sends ``--requests`` completions (default 4 per
client, at least 8) of ``--max-tokens`` tokens each, streamed, greedy, the prompts of ``--prompts``
(default_model's held-out or repetitive texts) in turn. One warm-up request runs first and is not
counted. Arrivals: closed loop by default (each client sends its next request when the last one
ended); ``--rate R`` draws Poisson arrivals at R requests/s (seeded by ``--seed``), at most
``clients`` in flight.

A mode the server cannot run is one row with ``skipped``: a server that exits at start-up gives its
one-line reason (``dflash`` on a ``--model`` without ``--draft-model DIR``, for instance; the default
model drafts with its own drafter, specs/default-model.md §19.5).

Figures per row (``COLUMNS``): ``req/s`` and ``out tok/s`` (completion tokens, from each response's
usage) over the wall time of the run; ``ttft`` (request sent -> first chunk with text) and ``itl``
(gap between a stream's successive text chunks: a chunk of k tokens is one gap, as vLLM measures),
p50/p90/p99 in milliseconds; ``tpot`` the median over requests of (e2e - ttft) / (tokens - 1);
``mean_acc_len`` the server's tokens gained per verify over the run (``vllm:spec_decode_*`` counters of
``/metrics``, before and after; ``-`` without verifies). ``--json``: one JSON object per row.

``--vllm-python PY --model DIR`` runs vLLM's own client (``vllm bench serve``) against this server and
``vllm serve`` side by side instead (runtime/bench/serve_vllm.py).

The clients are threads using ``http.client`` (no dependency beyond the standard library on the
client side); the server runs in its own process, so the clients' Python does not share its GIL.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence
from urllib.parse import urlsplit

SPECS = ("none", "mtp", "dflash", "ngram")
COLUMNS = ("spec", "clients", "rate", "requests", "req/s", "out tok/s", "ttft p50", "ttft p90", "ttft p99",
           "itl p50", "itl p90", "itl p99", "tpot", "mean_acc_len")
START_TIMEOUT = 180.0


class BenchError(Exception):
    """Bad input or a server that cannot be used; the message is one line."""


# --- statistics ---------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class RequestStats:
    ok: bool
    ttft: Optional[float] = None
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    tokens: int = 0
    error: Optional[str] = None


# --- one client request -------------------------------------------------------------------------


class Client:
    """One keep-alive connection that streams completions."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.conn: Optional[http.client.HTTPConnection] = None

    def completion(self, payload: dict[str, Any]) -> RequestStats:
        body = json.dumps(payload).encode()
        start = time.perf_counter()
        try:
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
            self.conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            response = self.conn.getresponse()
            if response.status != 200:
                text = response.read().decode(errors="replace")
                return RequestStats(False, error=f"HTTP {response.status}: {text[:200]}")
            stats = RequestStats(True)
            last: Optional[float] = None
            for raw in response:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    stats.ok, stats.error = False, str(chunk["error"].get("message"))
                    continue
                if chunk.get("usage"):
                    stats.tokens = int(chunk["usage"]["completion_tokens"])
                if any(c.get("text") for c in chunk.get("choices", ())):
                    now = time.perf_counter()
                    if last is None:
                        stats.ttft = now - start
                    else:
                        stats.itl.append(now - last)
                    last = now
            response.read()
            stats.e2e = time.perf_counter() - start
            return stats
        except (OSError, http.client.HTTPException, ValueError) as err:
            self.close()
            return RequestStats(False, error=f"{type(err).__name__}: {err}")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


# --- the server -----------------------------------------------------------------------------------


class ServerProcess:
    """``fxsched serve`` in a subprocess on a free port; ``url`` once it listens."""

    def __init__(self, spec: str, model: Optional[str], draft_model: Optional[str], device: str,
                 extra: Sequence[str] = (), cores: Optional[list[int]] = None):
        cmd = [sys.executable, "-m", "fxsched.runtime.cli", "serve", "--port", "0", "--spec", spec,
               "--max-waiting", "1000000", "--device", device, *extra]
        if model:
            cmd += ["--model", model]
        if draft_model:
            cmd += ["--draft-model", draft_model]
        pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, preexec_fn=pin)
        self.lines: list[str] = []
        self.url: Optional[str] = None
        self._listening = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if self.url is None and "listening on " in line:
                self.url = line.split("listening on ", 1)[1].split()[0]
                self._listening.set()
        self._listening.set()

    def wait(self) -> str:
        """The server's URL; ``BenchError`` with its last line when it exits instead."""
        if not self._listening.wait(START_TIMEOUT) or self.url is None:
            self.stop()
            last = next((line for line in reversed(self.lines) if line.strip()), "no output")
            raise BenchError(last.removeprefix("fxsched serve: "))
        return self.url

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)


def _get(url: str, path: str) -> str:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=30)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def speculation_counters(url: str) -> tuple[float, float]:
    """(verifies, accepted draft tokens), from the server's /metrics (vLLM's names: specs/serve.md §12.8)."""
    verifies = accepted = 0.0
    for line in _get(url, "/metrics").splitlines():
        if line.startswith("vllm:spec_decode_num_drafts_total{"):
            verifies += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:spec_decode_num_accepted_tokens_total{"):
            accepted += float(line.rsplit(" ", 1)[1])
    return verifies, accepted


def served_model(url: str) -> str:
    return str(json.loads(_get(url, "/v1/models"))["data"][0]["id"])


# --- a run ----------------------------------------------------------------------------------------


def run_load(url: str, model: str, prompts: list[str], clients: int, requests: int, max_tokens: int,
             rate: float = math.inf, seed: int = 0) -> dict[str, Any]:
    """Send ``requests`` streamed completions with at most ``clients`` in flight; the row's figures."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80

    def payload(i: int) -> dict[str, Any]:
        return {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}

    warm = Client(host, port)
    warm.completion(payload(0))
    warm.close()
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(requests):
        arrivals.append(t)
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    verifies0, accepted0 = speculation_counters(url)
    results: list[Optional[RequestStats]] = [None] * requests
    lock = threading.Lock()
    next_index = [0]
    start = time.perf_counter()

    def worker() -> None:
        client = Client(host, port)
        while True:
            with lock:
                i = next_index[0]
                if i >= requests:
                    break
                next_index[0] += 1
            delay = start + arrivals[i] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            results[i] = client.completion(payload(i))
        client.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - start
    verifies1, accepted1 = speculation_counters(url)
    done = [r for r in results if r is not None and r.ok]
    errors = [r.error for r in results if r is not None and not r.ok]
    ttft = [r.ttft * 1000 for r in done if r.ttft is not None]
    itl = [g * 1000 for r in done for g in r.itl]
    tpot = [(r.e2e - r.ttft) * 1000 / (r.tokens - 1) for r in done if r.ttft is not None and r.tokens > 1]
    tokens = sum(r.tokens for r in done)
    dv = verifies1 - verifies0
    row: dict[str, Any] = {
        "clients": clients, "rate": rate if math.isfinite(rate) else None, "requests": requests,
        "completed": len(done), "failed": len(errors), "seconds": wall, "output_tokens": tokens,
        "req/s": len(done) / wall if wall > 0 else 0.0, "out tok/s": tokens / wall if wall > 0 else 0.0,
        "tpot": percentile(tpot, 50), "mean_acc_len": 1 + (accepted1 - accepted0) / dv if dv > 0 else None,
    }
    for name, values in (("ttft", ttft), ("itl", itl)):
        for q in (50, 90, 99):
            row[f"{name} p{q}"] = percentile(values, q)
    if errors:
        row["first_error"] = errors[0]
    return row


def bench_serve(specs: list[str], clients: list[int], requests: Optional[int], max_tokens: int, prompts: list[str],
                rate: float = math.inf, seed: int = 0, model: Optional[str] = None, draft_model: Optional[str] = None,
                device: str = "cpu", url: Optional[str] = None, progress=None) -> list[dict[str, Any]]:
    """One row per (mode, client count); see the module docstring."""
    rows: list[dict[str, Any]] = []

    def runs(spec: str, server_url: str) -> None:
        name = served_model(server_url)
        for n in clients:
            if progress:
                progress(f"{spec} clients={n}")
            count = requests if requests is not None else max(4 * n, 8)
            rows.append({"spec": spec, **run_load(server_url, name, prompts, n, count, max_tokens, rate, seed)})

    if url is not None:
        spec = str(json.loads(_get(url, "/v1/models"))["data"][0].get("spec", "?"))
        runs(spec, url)
        return rows
    for spec in specs:
        server = ServerProcess(spec, model, draft_model, device)
        try:
            server_url = server.wait()
        except BenchError as err:
            rows.append({"spec": spec, "skipped": str(err)})
            continue
        try:
            runs(spec, server_url)
        finally:
            server.stop()
    return rows


# --- output ---------------------------------------------------------------------------------------


def _cell(value: Any, key: str) -> str:
    if value is None:
        return "-" if key != "rate" else "inf"
    if isinstance(value, float):
        return f"{value:.2f}" if key in ("mean_acc_len", "req/s") else f"{value:.1f}"
    return str(value)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a right-aligned table (times in ms); skipped modes and failures below it."""
    ran = [r for r in rows if "skipped" not in r]
    lines: list[str] = []
    if ran:
        cells = [[_cell(r.get(k), k) for k in COLUMNS] for r in ran]
        widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(COLUMNS)]
        lines.append("  ".join(f"{k:>{w}}" for k, w in zip(COLUMNS, widths, strict=True)))
        lines += ["  ".join(f"{c:>{w}}" for c, w in zip(row, widths, strict=True)) for row in cells]
    for r in ran:
        if r.get("failed"):
            lines.append(f"{r['spec']} clients={r['clients']}: {r['failed']} requests failed ({r.get('first_error')})")
    lines += [f"{r['spec']}: skipped ({r['skipped']})" for r in rows if "skipped" in r]
    return "\n".join(lines)


def row_json(row: dict[str, Any]) -> dict[str, Any]:
    """A row with machine-friendly keys (``ttft_p50_ms``, ``output_tokens_per_s``, ...)."""
    names = {"req/s": "requests_per_s", "out tok/s": "output_tokens_per_s", "tpot": "tpot_ms",
             "mean_acc_len": "mean_accepted_length"}
    out = {}
    for key, value in row.items():
        if " p" in key:
            metric, q = key.split(" ")
            key = f"{metric}_{q}_ms"
        out[names.get(key, key)] = value
    return out


def _list(text: str, name: str, parse, allowed=None, what: str = "not a valid value") -> list:
    words = [w.strip() for w in text.split(",")]
    if not text.strip() or any(not w for w in words):
        raise BenchError(f"{name} {text!r}: give values separated by commas")
    out = []
    for w in words:
        try:
            value = parse(w)
        except ValueError:
            raise BenchError(f"{name} {w}: {what}") from None
        if allowed is not None and value not in allowed:
            raise BenchError(f"{name} {w}: unknown (choose from {', '.join(allowed)})")
        out.append(value)
    return out


def _positive_int(text: str) -> int:
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise ValueError(text)
    return int(text)


def _rate(text: str) -> float:
    if text.strip().lower() == "inf":
        return math.inf
    try:
        rate = float(text)
    except ValueError:
        raise BenchError(f"--rate {text}: not a number") from None
    if not (math.isfinite(rate) and rate > 0):
        raise BenchError(f"--rate {text}: must be above 0 (or inf)")
    return rate


def main(argv: Optional[list[str]] = None) -> int:
    """Print the table (or JSON lines). Bad input: one line on stderr, exit 2."""
    from fxsched.runtime.cli.arguments import ArgumentParser  # one-line refusals, as the fxsched command's

    ap = ArgumentParser(prog="fxsched bench serve", description=__doc__.splitlines()[0])
    ap.add_argument("--specs", default=",".join(SPECS), help="speculation modes, comma-separated (default all)")
    ap.add_argument("--clients", default="1,8,32", help="concurrent clients, comma-separated (default 1,8,32)")
    ap.add_argument("--requests", default=None, help="requests per run (default 4 per client, at least 8)")
    ap.add_argument("--rate", default="inf", help="Poisson arrivals per second (default inf: closed loop)")
    ap.add_argument("--max-tokens", default="32", help="tokens per request (default 32)")
    ap.add_argument("--prompts", default="held-out", choices=("held-out", "repetitive"), help="prompt texts")
    ap.add_argument("--model", default=None, metavar="DIR", help="model directory (default: the embedded one)")
    ap.add_argument("--draft-model", default=None, metavar="DIR", help="DFlash drafter directory (for dflash)")
    ap.add_argument("--device", default="cpu", help="the server's device (default cpu)")
    ap.add_argument("--url", default=None, help="bench this running server instead of starting one per mode")
    ap.add_argument("--seed", default="0", help="seed of the Poisson arrivals")
    ap.add_argument("--json", action="store_true", help="one JSON object per row, nothing else")
    try:
        args = ap.parse_args(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 2
    try:
        specs = _list(args.specs, "--specs", str, SPECS)
        clients = _list(args.clients, "--clients", _positive_int, what="not a positive integer")
        requests = (_list(args.requests, "--requests", _positive_int, what="not a positive integer")[0]
                    if args.requests is not None else None)
        max_tokens = _list(args.max_tokens, "--max-tokens", _positive_int, what="not a positive integer")[0]
        seed = _list(args.seed, "--seed", int, what="not an integer")[0]
        rate = _rate(args.rate)
        for option, path in (("--model", args.model), ("--draft-model", args.draft_model)):
            if path is not None and not os.path.isdir(path):
                raise BenchError(f"{option} {path}: no such directory")
        from fxsched.runtime.torch_model.default_model import EVAL_PROMPTS, REPETITIVE_PROMPTS

        prompts = list(EVAL_PROMPTS if args.prompts == "held-out" else REPETITIVE_PROMPTS)
        rows = bench_serve(specs, clients, requests, max_tokens, prompts, rate, seed, args.model, args.draft_model,
                           args.device, args.url,
                           progress=lambda what: print(f"... {what}", file=sys.stderr, flush=True)
                           if sys.stderr.isatty() and not args.json else None)
    except BenchError as err:
        print(f"fxsched bench serve: {err}", file=sys.stderr)
        return 2
    if args.json:
        for row in rows:
            print(json.dumps(row_json({**row, "max_tokens": max_tokens, "prompts": args.prompts})))
        return 0
    where = args.url or ("model " + args.model if args.model else "default model")
    print(f"bench serve: {where} max_tokens={max_tokens} prompts={args.prompts} (times in ms)")
    print(format_table(rows))
    return 0
