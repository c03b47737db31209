"""Prometheus metrics of one ``fxsched serve`` server, on a registry of its own (never the global
default registry, so a process can hold several servers: the tests start a few).

Names (specs/serve.md §12.8): what vLLM also measures is exported under vLLM's name, labels and
buckets (``vllm:*``, labelled ``model_name`` (the served model name) and ``engine`` ("0": one
engine), as vLLM 0.11's ``PrometheusStatLogger``), so dashboards and autoscalers written for vLLM
read fxsched unchanged; what is fxsched's own keeps ``fxsched_*``.

``scheduler_gauges(state)`` is the ONE place that reads the scheduler state for metrics; the engine
thread calls it (and reads the device's block and slot counts) after each tick and before every idle
wait, so the gauges are at most one tick old and exact while the server is idle.

vLLM's (every one labelled ``model_name``, ``engine``):

* ``vllm:num_requests_running`` (scheduler requests admitted: prefilling or decoding) and
  ``vllm:num_requests_waiting`` (pending, still in the inbox, preempted or spilled);
  ``vllm:kv_cache_usage_perc`` (paged-KV blocks held by sequences over all blocks, 0..1: cached
  prefix blocks nobody holds are free, as in vLLM's block pool);
* ``vllm:prompt_tokens_total`` (a choice's prompt, counted when its first token comes out of
  its prefill: a choice that never started counts nothing) and ``vllm:generation_tokens_total``
  (tokens as each frame brings them); ``vllm:prefix_cache_queries_total`` /
  ``vllm:prefix_cache_hits_total`` (in tokens: the prompt, and what of it came from the prefix cache,
  counted at the same moment); ``vllm:num_preemptions_total`` (a running sequence released for
  memory: requeued or spilled);
* ``vllm:request_success_total{finished_reason}`` (stop, length, abort) and the per-request
  histograms ``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds`` (accepted ->
  first scheduled), ``vllm:request_prefill_time_seconds`` (first scheduled -> first token),
  ``vllm:request_decode_time_seconds`` (first token -> last token),
  ``vllm:request_inference_time_seconds`` (first scheduled -> last token): for each choice that ended
  without an engine error after its first token;
* ``vllm:time_to_first_token_seconds`` (accepted -> first token) and
  ``vllm:inter_token_latency_seconds`` (one observation per frame after the first: the gap since
  the previous frame, as vLLM counts one per engine output whatever its token count);
* with a speculative ``--spec``: ``vllm:spec_decode_num_drafts_total`` (verifies),
  ``vllm:spec_decode_num_draft_tokens_total``, ``vllm:spec_decode_num_accepted_tokens_total`` and
  ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position}``.

fxsched's own:

* ``fxsched_requests_swapped``: scheduler requests spilled to the swap pool;
* ``fxsched_kv_blocks_used``: paged-KV blocks held by sequences (``fxsched_kv_blocks_cached``
  counts the prefix cache, whose blocks a forward evicts when it needs room),
  ``fxsched_kv_blocks_total``; ``fxsched_slots_used`` / ``_total``: engine slots holding a sequence;
* ``fxsched_spec_mean_accepted_length{mode}``: tokens gained per verify (accepted drafts + the
  target's own token; 0 until the first verify); ``fxsched_spec_drafts_per_position_total{mode,position}``
  (verified drafts by draft position, 0: the first draft) and
  ``fxsched_spec_acceptance_per_position{mode,position}`` (the kept share, vLLM's per-position acceptance);
* ``fxsched_step_seconds`` (one scheduler tick, idle waits left out);
* with ``--enable-lora`` (specs/lora.md §18.7): vLLM's ``vllm:lora_requests_info{max_lora,
  waiting_lora_adapters, running_lora_adapters}`` (no ``model_name``, as vLLM's), and
  ``fxsched_lora_adapters_resident``, ``fxsched_lora_loads_total``, ``fxsched_lora_unloads_total``,
  ``fxsched_lora_requests_total{lora_name}`` (choices submitted with each adapter);
* ``fxsched_requests_failed_total`` (choices failed by an engine error: vLLM has no such finish
  reason), ``fxsched_requests_rejected_total{status}`` (429, 503), ``fxsched_engine_faults_total``
  (exceptions out of the drive loop; the engine restarted), ``fxsched_unknown_fields_total{endpoint}``
  (request fields ignored as unknown, one per field: the field policy of
  runtime/serve/request_models.py; the names go to the debug log, never a label).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM 0.11's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5,
                1.0, 2.5)
FINISHED_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason
ENGINE = "0"  # vLLM's ``engine`` label: one engine core
DEFAULT_MODEL_NAME = "default"


def scheduler_gauges(state: Any) -> dict[str, int]:
    """Running, waiting and swapped requests of a scheduler state: the only read of the state.
    Running: admitted (this tick's new requests, prefilling, restoring, decoding); waiting: pending,
    in the inbox, preempted or spilled (vLLM puts a preempted request back in its waiting queue)."""
    swapped = len(state.swapped)
    return {"running": len(state.active) + len(state.prefilling) + len(state.restoring) + len(state.new_requests),
            "waiting": len(state.pending) + len(state.inbox) + len(state.preempted) + swapped,
            "swapped": swapped}


class ServeMetrics:
    """The metric objects of one server and its registry (``registry`` is what ``/metrics`` renders).

    The ``vllm:*`` families carry the served model's name: ``name_model`` sets it (the app does,
    before the engine starts); until then it is ``DEFAULT_MODEL_NAME``."""

    def __init__(self, spec: str, kv_blocks_total: int, slots_total: int, model_name: str = DEFAULT_MODEL_NAME):
        self.spec = spec
        self.speculative = spec != "none"
        self.registry = r = CollectorRegistry()
        # --- fxsched's own
        self.swapped = Gauge("fxsched_requests_swapped", "Scheduler requests spilled to the swap pool", registry=r)
        self.kv_used = Gauge("fxsched_kv_blocks_used", "Paged-KV blocks held by sequences", registry=r)
        self.kv_cached = Gauge("fxsched_kv_blocks_cached", "Paged-KV blocks held by the prefix cache", registry=r)
        self.kv_total = Gauge("fxsched_kv_blocks_total", "Paged-KV blocks of the engine", registry=r)
        self.slots_used = Gauge("fxsched_slots_used", "Engine slots holding a sequence", registry=r)
        self.slots_total = Gauge("fxsched_slots_total", "Engine slots", registry=r)
        self.kv_total.set(kv_blocks_total)
        self.slots_total.set(slots_total)
        self._blocks_total = kv_blocks_total
        self.mean_accepted = Gauge("fxsched_spec_mean_accepted_length",
                                   "Tokens gained per verify (accepted drafts + 1)", ["mode"], registry=r)
        self.step = Histogram("fxsched_step_seconds", "One scheduler tick (idle waits left out)",
                              buckets=STEP_BUCKETS, registry=r)
        self.failed = Counter("fxsched_requests_failed", "Choices failed by an engine error", registry=r)
        self.rejected = Counter("fxsched_requests_rejected", "Requests refused by backpressure", ["status"],
                                registry=r)
        self.faults = Counter("fxsched_engine_faults", "Exceptions out of the drive loop (engine restarted)",
                              registry=r)
        # labelled by route only: field names are the client's, an unbounded label set
        self.unknown_fields = Counter("fxsched_unknown_fields", "Request fields ignored as unknown", ["endpoint"],
                                      registry=r)
        self.drafts_at = Counter("fxsched_spec_drafts_per_position", "Verified drafts by draft position",
                                 ["mode", "position"], registry=r)
        self.acceptance_at = Gauge("fxsched_spec_acceptance_per_position",
                                   "Share of verified drafts kept, by draft position", ["mode", "position"], registry=r)
        # --- vLLM's names, labels and buckets
        labels = ["model_name", "engine"]
        self._families: list[Any] = []

        def family(kind: Any, name: str, doc: str, extra: Iterable[str] = (), **kw: Any) -> Any:
            metric = kind(name, doc, labels + list(extra), registry=r, **kw)
            self._families.append(metric)
            return metric

        self._running = family(Gauge, "vllm:num_requests_running", "Number of requests in model execution batches.")
        self._waiting = family(Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self._kv_usage = family(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self._queries = family(Counter, "vllm:prefix_cache_queries",
                               "Prefix cache queries, in terms of number of queried tokens.")
        self._hits = family(Counter, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self._preemptions = family(Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self._prompt = family(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self._generation = family(Counter, "vllm:generation_tokens", "Number of generation tokens processed.")
        self._success = family(Counter, "vllm:request_success", "Count of successfully processed requests.",
                               ["finished_reason"])
        self._ttft = family(Histogram, "vllm:time_to_first_token_seconds",
                            "Histogram of time to first token in seconds.", buckets=TTFT_BUCKETS)
        self._itl = family(Histogram, "vllm:inter_token_latency_seconds",
                           "Histogram of inter-token latency in seconds.", buckets=ITL_BUCKETS)
        self._e2e = family(Histogram, "vllm:e2e_request_latency_seconds",
                           "Histogram of e2e request latency in seconds.", buckets=REQUEST_LATENCY_BUCKETS)
        self._queue = family(Histogram, "vllm:request_queue_time_seconds",
                             "Histogram of time spent in WAITING phase for request.", buckets=REQUEST_LATENCY_BUCKETS)
        self._inference = family(Histogram, "vllm:request_inference_time_seconds",
                                 "Histogram of time spent in RUNNING phase for request.",
                                 buckets=REQUEST_LATENCY_BUCKETS)
        self._prefill = family(Histogram, "vllm:request_prefill_time_seconds",
                               "Histogram of time spent in PREFILL phase for request.", buckets=REQUEST_LATENCY_BUCKETS)
        self._decode = family(Histogram, "vllm:request_decode_time_seconds",
                              "Histogram of time spent in DECODE phase for request.", buckets=REQUEST_LATENCY_BUCKETS)
        self._spec: Optional[tuple[Any, Any, Any, Any]] = None
        if self.speculative:  # vLLM exports these only with a speculative config
            self._spec = (family(Counter, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                          family(Counter, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                          family(Counter, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
                          family(Counter, "vllm:spec_decode_num_accepted_tokens_per_pos",
                                 "Accepted tokens per draft position.", ["position"]))
        # LoRA adapters (specs/lora.md §18.7): vLLM's info gauge, fxsched's counts; exported with --enable-lora
        self._lora: Optional[tuple[Any, ...]] = None
        self._lora_labels: Optional[tuple[str, str, str]] = None
        self._lora_seen: dict[str, int] = {}
        self.model_name = ""
        self.name_model(model_name)
        self._positions_seen: tuple[list[int], list[int]] = ([], [])
        self._positions: tuple[list[int], list[int]] = ([], [])
        self._verifies_seen = 0
        self._kept_seen = 0
        self._verifies = 0
        self._kept = 0

    def name_model(self, model_name: str) -> None:
        """Label the ``vllm:*`` families with ``model_name`` (the series of an earlier name are dropped)."""
        if model_name == self.model_name:
            return
        self.model_name = model_name
        for metric in self._families:
            metric.clear()
        key = (model_name, ENGINE)
        self.running, self.waiting, self.kv_usage = (self._running.labels(*key), self._waiting.labels(*key),
                                                     self._kv_usage.labels(*key))
        self.prefix_queries, self.prefix_hits = self._queries.labels(*key), self._hits.labels(*key)
        self.preemptions = self._preemptions.labels(*key)
        self.prompt_tokens, self.generation_tokens = self._prompt.labels(*key), self._generation.labels(*key)
        self.success = {reason: self._success.labels(*key, reason) for reason in FINISHED_REASONS}
        self.ttft, self.itl, self.e2e = self._ttft.labels(*key), self._itl.labels(*key), self._e2e.labels(*key)
        self.queue_time, self.inference_time = self._queue.labels(*key), self._inference.labels(*key)
        self.prefill_time, self.decode_time = self._prefill.labels(*key), self._decode.labels(*key)
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted = None
        if self._spec is not None:
            drafts, draft_tokens, accepted, _ = self._spec
            self.spec_drafts, self.spec_draft_tokens, self.spec_accepted = (
                drafts.labels(*key), draft_tokens.labels(*key), accepted.labels(*key))

    # --- the engine thread ------------------------------------------------------------------------

    def scheduler(self, state: Any) -> None:
        gauges = scheduler_gauges(state)
        self.running.set(gauges["running"])
        self.waiting.set(gauges["waiting"])
        self.swapped.set(gauges["swapped"])

    def device(self, blocks_used: int, blocks_cached: int, slots_used: int) -> None:
        self.kv_used.set(blocks_used)
        self.kv_cached.set(blocks_cached)
        self.slots_used.set(slots_used)
        self.kv_usage.set(blocks_used / self._blocks_total if self._blocks_total else 0.0)

    def first_token(self, ttft: float, prompt_tokens: int, cached_tokens: int) -> None:
        """A choice's first token came out of its prefill (``ttft`` seconds after it was accepted)."""
        self.ttft.observe(ttft)
        self.prompt_tokens.inc(prompt_tokens)
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(cached_tokens)

    def finished(self, reason: str, e2e: float, queue: float, prefill: float, decode: float, inference: float
                 ) -> None:
        """A choice that had started ended with ``reason`` (stop, length, abort); its phase times."""
        counter = self.success.get(reason)
        if counter is not None:
            counter.inc()
        self.e2e.observe(e2e)
        self.queue_time.observe(queue)
        self.prefill_time.observe(prefill)
        self.decode_time.observe(decode)
        self.inference_time.observe(inference)

    def speculation(self, verifies: int, kept_rows: int) -> None:
        """The device's running totals (verifies, rows they kept = accepted drafts + one each);
        ``reset_speculation`` when a fresh device starts counting from zero."""
        dv, dk = verifies - self._verifies_seen, kept_rows - self._kept_seen
        if dv <= 0 and dk <= 0:
            return
        self._verifies_seen, self._kept_seen = verifies, kept_rows
        self._verifies += dv
        self._kept += dk
        if self.spec_drafts is not None and self.spec_accepted is not None:
            self.spec_drafts.inc(max(dv, 0))
            self.spec_accepted.inc(max(dk - dv, 0))
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
            if self._spec is not None and self.spec_draft_tokens is not None:
                self.spec_draft_tokens.inc(max(dd, 0))
                self._spec[3].labels(self.model_name, ENGINE, label).inc(max(da, 0))
            self.acceptance_at.labels(self.spec, label).set(total_a[i] / total_d[i] if total_d[i] else 0.0)

    def lora(self, book: Any) -> None:
        """The LoRA figures of ``book`` (runtime/serve/lora.py's ``AdapterBook``): vLLM's
        ``vllm:lora_requests_info`` (one series, labels ``running_lora_adapters``,
        ``waiting_lora_adapters`` (comma-separated names) and ``max_lora``, value the time it was set,
        as vLLM's), ``fxsched_lora_adapters_served``, ``fxsched_lora_adapters_resident``,
        ``fxsched_lora_loads_total``, ``fxsched_lora_evictions_total``, ``fxsched_lora_unloads_total`` and
        ``fxsched_lora_requests_total{lora_name}``."""
        if self._lora is None:
            r = self.registry
            self._lora = (
                Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                      ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r),
                Gauge("fxsched_lora_adapters_served", "LoRA adapters served by name (resident or on disk)",
                      registry=r),
                Gauge("fxsched_lora_adapters_resident", "LoRA adapters loaded in the engine's slots", registry=r),
                Counter("fxsched_lora_loads", "LoRA adapters loaded into a slot (when listed, and on demand)",
                        registry=r),
                Counter("fxsched_lora_evictions", "Idle resident LoRA adapters whose slot went to another",
                        registry=r),
                Counter("fxsched_lora_unloads", "LoRA adapters unloaded (/v1/unload_lora_adapter)", registry=r),
                Counter("fxsched_lora_requests", "Choices submitted with a LoRA adapter", ["lora_name"], registry=r))
        info, served, resident, loads, evictions, unloads, requests = self._lora
        running, waiting = book.in_use()
        labels = (str(book.max_loras), ",".join(waiting), ",".join(running))
        if labels != self._lora_labels:
            info.clear()
            self._lora_labels = labels
        info.labels(*labels).set_to_current_time()
        served.set(len(book.adapters()))
        resident.set(len(book.resident()))
        seen = self._lora_seen
        total_loads, total_evictions, total_unloads, per_adapter = book.counts()
        for key, counter, value in (("loads", loads, total_loads), ("evictions", evictions, total_evictions),
                                    ("unloads", unloads, total_unloads)):
            if value > seen.get(key, 0):
                counter.inc(value - seen.get(key, 0))
                seen[key] = value
        for name, count in per_adapter.items():
            key = "requests:" + name
            if count > seen.get(key, 0):
                requests.labels(name).inc(count - seen.get(key, 0))
                seen[key] = count

    def reset_speculation(self) -> None:
        self._verifies_seen = self._kept_seen = 0
        self._positions_seen = ([], [])
