"""Prometheus metrics of one ``fxsched serve`` server, on a registry of its own (never the global
default registry, so a process can hold several servers: the tests start a few).

``scheduler_gauges(state)`` is the ONE place that reads the scheduler state for metrics; the engine
thread calls it (and reads the device's block and slot counts) after each tick and before every idle
wait, so the gauges are at most one tick old and exact while the server is idle.

What ``GET /metrics`` shows (names as exported):

* ``fxsched_requests_running`` / ``_waiting`` / ``_swapped``: scheduler requests (one per choice)
  decoding, waiting to be admitted (pending or still in the inbox), spilled to the swap pool;
* ``fxsched_kv_blocks_used``: paged-KV blocks held by sequences (cached prefix blocks no sequence
  uses are not counted: ``fxsched_kv_blocks_cached`` counts the prefix cache, and a forward evicts
  them when it needs room), ``fxsched_kv_blocks_total``; ``fxsched_slots_used`` / ``_total``:
  engine slots holding a sequence;
* ``fxsched_prompt_tokens_total`` / ``fxsched_generation_tokens_total``: tokens of finished choices
  (prompt once per choice; generated: the tokens the client got);
* ``fxsched_spec_verifies_total{mode}``, ``fxsched_spec_accepted_tokens_total{mode}`` (accepted
  drafts), ``fxsched_spec_mean_accepted_length{mode}``: tokens gained per verify (accepted drafts +
  the target's own token; 0 until the first verify), for the server's ``--spec`` mode;
  ``fxsched_spec_drafts_per_position_total{mode,position}`` and
  ``fxsched_spec_accepted_per_position_total{mode,position}``: verified drafts and the kept ones by
  draft position (0: the first draft), and ``fxsched_spec_acceptance_per_position{mode,position}``
  their ratio (vLLM's per-position acceptance);
* ``fxsched_time_to_first_token_seconds`` (request accepted -> first token handed to the HTTP
  layer), ``fxsched_inter_token_latency_seconds`` (gap between a choice's token frames, divided
  among the frame's tokens: a verify that yields k tokens counts k gaps of a k-th of the time),
  ``fxsched_e2e_request_latency_seconds``, ``fxsched_step_seconds`` (one scheduler tick, idle
  waits left out): histograms;
* ``fxsched_requests_finished_total{finish_reason}`` (stop, length, abort: cancelled by a client
  disconnect or the drain timeout, error), ``fxsched_requests_rejected_total{status}`` (429, 503),
  ``fxsched_engine_faults_total`` (exceptions out of the drive loop; the engine restarted),
  ``fxsched_unknown_fields_total{endpoint}`` (request fields ignored as unknown, one per field:
  the field policy of runtime/serve/request_models.py; the names go to the debug log, never a label).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                   5.0, 10.0, 20.0, 40.0, 80.0)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5,
                1.0, 2.5)


def scheduler_gauges(state: Any) -> dict[str, int]:
    """Running, waiting and swapped requests of a scheduler state: the only read of the state."""
    return {"running": len(state.active), "waiting": len(state.pending) + len(state.inbox),
            "swapped": len(state.swapped)}


class ServeMetrics:
    """The metric objects of one server and its registry (``registry`` is what ``/metrics`` renders)."""

    def __init__(self, spec: str, kv_blocks_total: int, slots_total: int):
        self.spec = spec
        self.registry = r = CollectorRegistry()
        self.running = Gauge("fxsched_requests_running", "Scheduler requests decoding", registry=r)
        self.waiting = Gauge("fxsched_requests_waiting", "Scheduler requests waiting to be admitted", registry=r)
        self.swapped = Gauge("fxsched_requests_swapped", "Scheduler requests spilled to the swap pool", registry=r)
        self.kv_used = Gauge("fxsched_kv_blocks_used", "Paged-KV blocks held by sequences", registry=r)
        self.kv_cached = Gauge("fxsched_kv_blocks_cached", "Paged-KV blocks held by the prefix cache", registry=r)
        self.kv_total = Gauge("fxsched_kv_blocks_total", "Paged-KV blocks of the engine", registry=r)
        self.slots_used = Gauge("fxsched_slots_used", "Engine slots holding a sequence", registry=r)
        self.slots_total = Gauge("fxsched_slots_total", "Engine slots", registry=r)
        self.kv_total.set(kv_blocks_total)
        self.slots_total.set(slots_total)
        self.prompt_tokens = Counter("fxsched_prompt_tokens", "Prompt tokens of finished choices", registry=r)
        self.generation_tokens = Counter("fxsched_generation_tokens", "Generated tokens of finished choices",
                                         registry=r)
        self.verifies = Counter("fxsched_spec_verifies", "Speculative verifies", ["mode"], registry=r)
        self.accepted = Counter("fxsched_spec_accepted_tokens", "Accepted draft tokens", ["mode"], registry=r)
        self.mean_accepted = Gauge("fxsched_spec_mean_accepted_length",
                                   "Tokens gained per verify (accepted drafts + 1)", ["mode"], registry=r)
        self.ttft = Histogram("fxsched_time_to_first_token_seconds", "Request accepted to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("fxsched_inter_token_latency_seconds", "Gap between a choice's tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("fxsched_e2e_request_latency_seconds", "Request accepted to its final frame",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.step = Histogram("fxsched_step_seconds", "One scheduler tick (idle waits left out)",
                              buckets=STEP_BUCKETS, registry=r)
        self.finished = Counter("fxsched_requests_finished", "Finished choices by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("fxsched_requests_rejected", "Requests refused by backpressure", ["status"],
                                registry=r)
        self.faults = Counter("fxsched_engine_faults", "Exceptions out of the drive loop (engine restarted)",
                              registry=r)
        # labelled by route only: field names are the client's, an unbounded label set
        self.unknown_fields = Counter("fxsched_unknown_fields", "Request fields ignored as unknown", ["endpoint"],
                                      registry=r)
        self.drafts_at = Counter("fxsched_spec_drafts_per_position", "Verified drafts by draft position",
                                 ["mode", "position"], registry=r)
        self.accepted_at = Counter("fxsched_spec_accepted_per_position", "Kept drafts by draft position",
                                   ["mode", "position"], registry=r)
        self.acceptance_at = Gauge("fxsched_spec_acceptance_per_position",
                                   "Share of verified drafts kept, by draft position", ["mode", "position"], registry=r)
        self._positions_seen: tuple[list[int], list[int]] = ([], [])
        self._positions: tuple[list[int], list[int]] = ([], [])
        self._verifies_seen = 0
        self._kept_seen = 0
        self._verifies = 0
        self._kept = 0

    def scheduler(self, state: Any) -> None:
        gauges = scheduler_gauges(state)
        self.running.set(gauges["running"])
        self.waiting.set(gauges["waiting"])
        self.swapped.set(gauges["swapped"])

    def device(self, blocks_used: int, blocks_cached: int, slots_used: int) -> None:
        self.kv_used.set(blocks_used)
        self.kv_cached.set(blocks_cached)
        self.slots_used.set(slots_used)

    def speculation(self, verifies: int, kept_rows: int) -> None:
        """The device's running totals (verifies, rows they kept = accepted drafts + one each);
        ``reset_speculation`` when a fresh device starts counting from zero."""
        dv, dk = verifies - self._verifies_seen, kept_rows - self._kept_seen
        if dv <= 0 and dk <= 0:
            return
        self._verifies_seen, self._kept_seen = verifies, kept_rows
        self._verifies += dv
        self._kept += dk
        self.verifies.labels(self.spec).inc(max(dv, 0))
        self.accepted.labels(self.spec).inc(max(dk - dv, 0))
        self.mean_accepted.labels(self.spec).set(self._kept / self._verifies if self._verifies else 0.0)

    def positions(self, drafts_at: list[int], accepted_at: list[int]) -> None:
        """The device's running totals by draft position (drafts verified, drafts kept)."""
        seen_d, seen_a = self._positions_seen
        total_d, total_a = self._positions
        for i, (d, a) in enumerate(zip(drafts_at, accepted_at, strict=True)):
            if i >= len(seen_d):
                seen_d.append(0)
                seen_a.append(0)
                total_d.append(0)
                total_a.append(0)
            dd, da = d - seen_d[i], a - seen_a[i]
            if dd <= 0 and da <= 0:
                continue
            seen_d[i], seen_a[i] = d, a
            total_d[i] += max(dd, 0)
            total_a[i] += max(da, 0)
            label = str(i)
            self.drafts_at.labels(self.spec, label).inc(max(dd, 0))
            self.accepted_at.labels(self.spec, label).inc(max(da, 0))
            self.acceptance_at.labels(self.spec, label).set(total_a[i] / total_d[i] if total_d[i] else 0.0)

    def reset_speculation(self) -> None:
        self._verifies_seen = self._kept_seen = 0
        self._positions_seen = ([], [])
