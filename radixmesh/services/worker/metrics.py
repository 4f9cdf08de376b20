"""A worker's Prometheus metrics (colocated, prefill or decode role), with SGLang's names where SGLang has the metric.

Per request, when it finishes (not per token): sglang:num_requests_total, num_aborted_requests_total,
prompt_tokens_total, generation_tokens_total, cached_tokens_total, time_to_first_token_seconds,
time_per_output_token_seconds, e2e_request_latency_seconds, queue_time_seconds. Per streamed chunk:
sglang:inter_token_latency_seconds (the chunk's gap to the previous one over its token count; a non-streamed request
has no chunks and shows only in time_per_output_token_seconds). Latencies count from the moment this worker received
the Generate call. A prefill worker's requests end when their KV has been handed over: it reports no generated
tokens and no time to first token (the decode worker, which streams them, does).

At scrape time, from the engine's load report and this service's counters: the gauges num_running_reqs,
num_queue_reqs, num_used_tokens, max_total_num_tokens, token_usage, cache_hit_rate, gen_throughput, the PD queue
gauges and transfer speed; and monotonic engine totals as radixmesh:* counters (prefix-cache hits per tier,
evictions, retractions, forward steps, L3 traffic). KV transfers (PD) are observed as they complete or fail."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from radixmesh.engine.outputs import RequestOutput
from radixmesh.engine.request import FinishKind
from radixmesh.engine.results import RequestTiming
from radixmesh.services.common.metrics import (E2E_BUCKETS, ITL_BUCKETS, QUEUE_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS,
                                               Families, ServiceMetrics)

LOAD_TIMEOUT_S = 5.0  # a scrape waits this long for the scheduler thread's load report
# KV transfer times: a page run over loopback takes milliseconds, a large prompt over a slow link seconds.
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Engine totals (keys of Engine.get_load) exported as counters: (name, help, key, extra labels).
_ENGINE_COUNTERS = (
    ("radixmesh:cache_lookup_tokens_total", "Prompt tokens looked up in the prefix cache at admission",
     "lookup_tokens", {}),
    ("radixmesh:cache_hit_tokens_total", "Prompt tokens found in the prefix cache, by the tier that held them "
     "(device: already on device; host: loaded back from host memory; storage: fetched from L3 into host memory, "
     "counted again under host when a request loads them)", "device_hit_tokens", {"tier": "device"}),
    ("radixmesh:cache_hit_tokens_total", "", "host_loaded_hit_tokens", {"tier": "host"}),
    ("radixmesh:cache_hit_tokens_total", "", "storage_hit_tokens", {"tier": "storage"}),
    ("radixmesh:evicted_tokens_total", "Tokens evicted from the device KV pool", "evicted_tokens", {}),
    ("radixmesh:retracted_requests_total", "Requests retracted to the queue because KV pages ran out",
     "retractions", {}),
    ("radixmesh:forward_steps_total", "Model forwards, by mode", "forward_extend", {"mode": "extend"}),
    ("radixmesh:forward_steps_total", "", "forward_decode", {"mode": "decode"}),
    ("radixmesh:prefill_computed_tokens_total", "Prompt tokens computed by prefill forwards (cache hits excluded)",
     "prefill_tokens", {}),
    ("radixmesh:spec_verify_rows_total", "Speculative decoding: a request's rows in decode forwards (each verifies "
     "its drafted tokens, if any)", "spec_verify_rows", {}),
    ("radixmesh:spec_draft_tokens_total", "Speculative decoding: tokens drafted", "spec_draft_tokens", {}),
    ("radixmesh:spec_accepted_tokens_total", "Speculative decoding: drafted tokens the target model kept",
     "spec_accepted_tokens", {}),
    ("radixmesh:hicache_storage_pages_total", "KV pages moved to and from the L3 store, by operation",
     "storage_written_pages", {"op": "written"}),
    ("radixmesh:hicache_storage_pages_total", "", "storage_fetched_pages", {"op": "fetched"}),
    ("radixmesh:hicache_storage_pages_total", "", "storage_corrupt_pages", {"op": "corrupt"}),
    ("radixmesh:hicache_storage_pages_total", "", "storage_skipped_write_pages", {"op": "skipped_write"}),
    ("radixmesh:hicache_storage_failed_calls_total", "Failed calls to the L3 store", "storage_failed_calls", {}),
    ("radixmesh:hicache_storage_skipped_fetches_total", "L3 prefetches skipped as slower than recomputing",
     "storage_skipped_fetches", {}),
)


class WorkerMetrics:
    """Owned by the WorkerServicer when metrics are on. `rooms`: the PrefillRooms or DecodeRooms of a PD worker."""

    def __init__(self, metrics: ServiceMetrics, engine, stats, rooms=None, active: Callable[[], int] = lambda: 0):
        self.engine, self.stats, self.rooms, self.active = engine, stats, rooms, active
        self.role = metrics.role
        m = metrics
        self.requests = m.counter("sglang:num_requests_total", "Requests finished (any finish reason)")
        self.aborted = m.counter("sglang:num_aborted_requests_total", "Requests that finished aborted")
        self.prompt_tokens = m.counter("sglang:prompt_tokens_total", "Prompt tokens of finished requests")
        self.generation_tokens = m.counter("sglang:generation_tokens_total", "Tokens generated by finished requests")
        self.cached_tokens = m.counter("sglang:cached_tokens_total", "Prompt tokens served from the prefix cache")
        self.ttft = m.histogram("sglang:time_to_first_token_seconds", "Time to first token (s)", TTFT_BUCKETS)
        self.itl = m.histogram("sglang:inter_token_latency_seconds", "Per-token gap between streamed chunks (s)",
                               ITL_BUCKETS)
        self.tpot = m.histogram("sglang:time_per_output_token_seconds",
                                "Decode time per output token after the first (s)", TPOT_BUCKETS)
        self.e2e = m.histogram("sglang:e2e_request_latency_seconds", "End-to-end request latency (s)", E2E_BUCKETS)
        self.queue = m.histogram("sglang:queue_time_seconds", "Arrival to first scheduling (s)", QUEUE_BUCKETS)
        self._load: dict = {}
        self._experts: dict = {}  # engine.expert_distribution() at the last scrape (--enable-expert-distribution-metrics)
        if rooms is not None:
            self.transfer_bytes = m.counter("radixmesh:kv_transfer_bytes_total",
                                            "KV bytes transferred (prefill: sent; decode: received)")
            self.transfer_seconds = m.histogram("radixmesh:kv_transfer_seconds", "Duration of one room's KV transfer "
                                                "(s)", TRANSFER_BUCKETS)
            self.transfer_failures = m.counter("radixmesh:kv_transfer_failures_total",
                                               "KV handoffs (rooms) that failed, by reason", ("reason",))
            rooms.transfer.observer = self
        m.before_scrape(self._refresh)
        m.collect(self._collect)

    # ---- per request ------------------------------------------------------------------------------------------
    def finished(self, out: RequestOutput, started: float, timing: RequestTiming | None) -> None:
        """A colocated or decode request finished (`out`: its last output); `started`: time.monotonic() when its
        Generate arrived."""
        completion = out.completion_tokens
        aborted = out.finish_reason is not None and out.finish_reason.kind is FinishKind.ABORT
        self._count(out.prompt_tokens, out.cached_tokens, aborted)
        self.generation_tokens.inc(completion)
        if timing is None:
            self.e2e.observe(time.monotonic() - started)
            return
        self.e2e.observe(timing.finished - started)
        if timing.queue_time_s is not None:
            self.queue.observe(timing.queue_time_s)
        if timing.first_token is not None:
            self.ttft.observe(timing.first_token - started)
            if completion > 1:
                self.tpot.observe((timing.finished - timing.first_token) / (completion - 1))

    def prefilled(self, prompt_tokens: int, cached_tokens: int, started: float, ok: bool,
                  timing: RequestTiming | None = None) -> None:
        """A prefill-role request ended: its KV was handed over (`ok`) or the handoff failed; `timing`, when the
        engine finished it, gives its wait in the queue."""
        self._count(prompt_tokens, cached_tokens, aborted=not ok)
        self.e2e.observe(time.monotonic() - started)
        if timing is not None and timing.queue_time_s is not None:
            self.queue.observe(timing.queue_time_s)

    def left(self, prompt_tokens: int, started: float) -> None:
        """A request whose caller went away before it finished (the engine aborts it): counted as aborted; the
        tokens it generated are not known here and not counted."""
        self._count(prompt_tokens, 0, aborted=True)
        self.e2e.observe(time.monotonic() - started)

    def _count(self, prompt: int, cached: int, aborted: bool) -> None:
        self.requests.inc()
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        if aborted:
            self.aborted.inc()

    def chunk_gap(self, seconds: float, tokens: int) -> None:
        """A streamed chunk of `tokens` tokens arrived `seconds` after the previous one of its request."""
        self.itl.observe(seconds / tokens)

    # ---- TransferObserver (services.common.kv_transfer) -----------------------------------------------------------
    def transferred(self, nbytes: int, seconds: float) -> None:
        self.transfer_bytes.inc(nbytes)
        self.transfer_seconds.observe(seconds)

    def failed(self, reason: str) -> None:
        self.transfer_failures.labels(reason).inc()

    # ---- scrape -------------------------------------------------------------------------------------------------
    async def _refresh(self) -> None:
        if self.engine.alive:
            loop = asyncio.get_running_loop()
            self._load = await loop.run_in_executor(None, self.engine.get_load, LOAD_TIMEOUT_S)
            if self.engine.args.enable_expert_distribution_metrics:
                self._experts = await loop.run_in_executor(None, self.engine.expert_distribution, LOAD_TIMEOUT_S)

    def _collect(self, out: Families) -> None:
        load = self._load
        out.gauge("radixmesh:worker_active_requests", "Requests this worker's servicer holds: being prepared, "
                  "queued or running in the engine (the difference from running + queued is what waits before the "
                  "scheduler)", self.active())
        out.gauge("sglang:cache_hit_rate", "Share of prompt tokens served from the prefix cache since start",
                  self.stats.cache_hit_rate)
        out.gauge("sglang:gen_throughput", "Generated tokens per second (last 10 s)", self.stats.gen_throughput)
        if load:
            total = load["max_total_num_tokens"]
            used = total - load["available_kv_tokens"]
            out.gauge("sglang:num_running_reqs", "Requests running (decoding or prefilling)", load["running"])
            out.gauge("sglang:num_queue_reqs", "Requests waiting to be scheduled", load["waiting"])
            out.gauge("sglang:num_used_tokens", "KV tokens held by requests (not evictable cache)", used)
            out.gauge("sglang:max_total_num_tokens", "KV tokens the device pool holds", total)
            out.gauge("sglang:token_usage", "Share of the device KV pool held by requests", used / total)
            if "host_total_tokens" in load:
                out.gauge("radixmesh:hicache_host_total_tokens", "KV tokens the host (L2) pool holds",
                          load["host_total_tokens"])
                out.gauge("radixmesh:hicache_host_cached_tokens", "KV tokens cached in the host (L2) pool",
                          load["host_cached_tokens"])
            for name, doc, key, labels in _ENGINE_COUNTERS:
                if key in load:
                    out.counter(name, doc, load[key], **labels)
            if load.get("spec_verify_rows"):
                rows = load["spec_verify_rows"]
                out.gauge("sglang:spec_accept_length", "Speculative decoding: mean tokens a request gets per decode "
                          "forward (kept drafts and the target's own token) since start",
                          (load["spec_accepted_tokens"] + rows) / rows)
        if self._experts:
            self._collect_experts(out)
        if self.rooms is not None:
            self._collect_pd(out)

    def _collect_experts(self, out: Families) -> None:
        """Tokens routed to each expert (summed over the layers) and SGLang's balancedness: per layer the mean
        expert's tokens over the busiest one's (1.0: perfectly even), averaged over the layers."""
        layers = self._experts["tokens"]
        for expert, tokens in enumerate(map(sum, zip(*layers))):
            out.counter("radixmesh:moe_expert_tokens_total", "Tokens routed to an expert, over every MoE layer "
                        "(each token counts once per expert of its top-k)", tokens, expert=str(expert))
        ratios = [sum(row) / len(row) / max(row) for row in layers if max(row) > 0]
        if ratios:
            out.gauge("radixmesh:moe_expert_balancedness", "Mean over MoE layers of (mean expert tokens / busiest "
                      "expert tokens); 1 is an even load", sum(ratios) / len(ratios))

    def _collect_pd(self, out: Families) -> None:
        counts = self.rooms.counts()
        if self.role == "decode":
            out.gauge("sglang:num_decode_prealloc_queue_reqs", "Requests waiting for KV pre-allocation",
                      counts["waiting"])
            out.gauge("sglang:num_decode_transfer_queue_reqs", "Requests with KV pre-allocated, waiting for it",
                      counts["preallocated"] + counts["transferring"])
        else:
            out.gauge("sglang:num_prefill_prealloc_queue_reqs", "Rooms bootstrapping or prefilling",
                      counts["rooms"] - counts["transferring"])
            out.gauge("sglang:num_prefill_inflight_queue_reqs", "Rooms sending their KV", counts["transferring"])
        transfer = self.rooms.transfer
        out.gauge("sglang:kv_transfer_speed_gb_s", "KV transfer speed over recent transfers (GB/s)", transfer.gbps)
        out.gauge("sglang:kv_transfer_latency_ms", "Mean KV transfer time over recent transfers (ms)",
                  transfer.latency_ms)
