"""The router's Prometheus metrics, with the names of SGLang's router (sgl-router) where it has the metric; every
series also carries `model_name` and `role="router"`.

As requests happen:
    sgl_router_requests_total{route}                  HTTP requests (route: the path pattern) and gRPC calls
    sgl_router_request_duration_seconds{route}        until the response (a stream: until its end) was written
    sgl_router_request_errors_total{route,error_type} answers with an error status (error_type: bad_request, ...)
    sgl_router_processed_requests_total{worker}       calls sent to each worker (a retry counts again; PD: both)
    sgl_router_policy_decisions_total{policy,worker}  each pick (PD: the prefill pick by --policy, the decode pick
                                                      by least_loaded)
    sgl_router_worker_errors_total{worker,error_type} failed worker calls (error_type: the gRPC status name)
    sgl_router_retries_total{worker}                  requests moved to another worker after this one failed
    sgl_router_worker_request_duration_seconds{worker}  successful worker calls, send to last message
    sgl_router_worker_time_to_first_token_seconds{worker}  send to the first message of a streamed call
At scrape time: sgl_router_active_workers, sgl_router_worker_health{worker}, sgl_router_running_requests{worker}
(calls the router has open: until their consumer has read the last message), radixmesh_router_open_streams{worker}
(calls on the worker's GenerateStream with part of their answer in and the rest to come: what a failure of the
worker breaks mid-answer),
sgl_router_worker_cb_state{worker} (0 closed, 1 open, 2 half-open), sgl_router_worker_cb_transitions_total{worker};
with --tokenizer-cache-enable-l0: sgl_router_tokenizer_cache_{hits,misses}_total, sgl_router_tokenizer_cache_entries;
with admission limits: sgl_router_queued_requests, sgl_router_admitted_requests (running),
sgl_router_rejected_requests_total{reason} (queue_full, queue_timeout, rate_limited);
cache_aware: sgl_router_cache_hits_total, sgl_router_cache_misses_total, sgl_router_load_balancing_events_total,
sgl_router_tree_size{worker}; manual: sgl_router_manual_policy_picks_total{reason} (routing_key, no_key);
kv_index: sgl_router_kv_index_decisions_total{worker,reason}."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from radixmesh.services.common.metrics import REQUEST_BUCKETS, TTFT_BUCKETS, Families, ServiceMetrics
from radixmesh.services.router.resilience import STATE_VALUES

ERROR_TYPES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
               408: "timeout", 413: "too_large", 429: "rate_limited", 499: "client_closed", 500: "internal",
               502: "bad_gateway", 503: "unavailable", 504: "timeout"}
UNMATCHED = "unmatched"  # the route label of paths no route serves (keeps arbitrary paths out of the labels)


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, f"http_{status}")


class RouterMetrics:
    def __init__(self, metrics: ServiceMetrics, registry, policy, policy_name: str, admission=None,
                 tokenizer_cache=None):
        self.registry, self.policy, self.policy_name = registry, policy, policy_name
        self.admission, self.tokenizer_cache = admission, tokenizer_cache
        m = metrics
        self.requests = m.counter("sgl_router_requests_total", "Requests received, by route", ("route",))
        self.duration = m.histogram("sgl_router_request_duration_seconds", "Request duration by route (s)",
                                    REQUEST_BUCKETS, ("route",))
        self.errors = m.counter("sgl_router_request_errors_total", "Requests answered with an error",
                                ("route", "error_type"))
        self.processed = m.counter("sgl_router_processed_requests_total", "Calls sent to each worker", ("worker",))
        self.decisions = m.counter("sgl_router_policy_decisions_total", "Routing decisions by policy and worker",
                                   ("policy", "worker"))
        self.worker_errors = m.counter("sgl_router_worker_errors_total", "Failed worker calls by gRPC status",
                                       ("worker", "error_type"))
        self.retries = m.counter("sgl_router_retries_total", "Requests retried elsewhere after this worker failed",
                                 ("worker",))
        self.migrations = m.counter("radixmesh_router_migrations_total",
                                    "Streams moved mid-stream to another worker after this worker failed", ("worker",))
        self.worker_duration = m.histogram("sgl_router_worker_request_duration_seconds",
                                           "Successful worker calls, send to last message (s)", REQUEST_BUCKETS,
                                           ("worker",))
        self.worker_ttft = m.histogram("sgl_router_worker_time_to_first_token_seconds",
                                       "Streamed worker calls, send to first message (s)", TTFT_BUCKETS, ("worker",))
        self._seen: set[str] = set()  # workers whose retry counter exists
        m.collect(self._collect)

    # ---- front ends -------------------------------------------------------------------------------------------
    def handled(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route).inc()
        self.duration.labels(route).observe(seconds)
        if status >= 400:
            self.errors.labels(route, error_type(status)).inc()

    def handled_grpc(self, route: str, error: str | None, seconds: float) -> None:
        """A gRPC call ended; `error`: None, or the lower-cased status name it failed with."""
        self.requests.labels(route).inc()
        self.duration.labels(route).observe(seconds)
        if error is not None:
            self.errors.labels(route, error).inc()

    def middleware(self):
        """aiohttp middleware (outermost: it sees the status the error handling chose) counting every request."""

        @web.middleware
        async def observe(request: web.Request, handler):
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else UNMATCHED
            started, status = time.monotonic(), 500
            try:
                response = await handler(request)
                status = response.status
                return response
            except asyncio.CancelledError:
                status = 499  # the client went away
                raise
            except web.HTTPException as e:
                status = e.status
                raise
            finally:
                self.handled(route, status, time.monotonic() - started)
        return observe

    # ---- the request path (core.Router, pd) ---------------------------------------------------------------------
    def picked(self, worker: str, policy: str | None = None) -> None:
        self.decisions.labels(policy or self.policy_name, worker).inc()
        self.processed.labels(worker).inc()
        if worker not in self._seen:
            # a worker's retry counter starts at 0 with its first call: a counter born at 1 would hide its first
            # increment from rate()/increase(), and alerts on retries would miss a worker's first failure
            self._seen.add(worker)
            self.retries.labels(worker)
            self.migrations.labels(worker)

    def first_message(self, worker: str, seconds: float) -> None:
        self.worker_ttft.labels(worker).observe(seconds)

    def worker_done(self, worker: str, seconds: float) -> None:
        self.worker_duration.labels(worker).observe(seconds)

    def worker_failed(self, worker: str, code_name: str) -> None:
        self.worker_errors.labels(worker, code_name).inc()

    def retried(self, worker: str) -> None:
        self.retries.labels(worker).inc()

    def migrated(self, worker: str) -> None:
        self.migrations.labels(worker).inc()

    # ---- scrape -------------------------------------------------------------------------------------------------
    def _collect(self, out: Families) -> None:
        workers = list(self.registry.workers.values())
        out.gauge("sgl_router_active_workers", "Healthy workers", sum(w.healthy for w in workers))
        for w in workers:
            out.gauge("sgl_router_worker_health", "1 when the worker is healthy", float(w.healthy), worker=w.url)
            out.gauge("sgl_router_running_requests", "Calls in flight per worker", w.in_flight, worker=w.url)
            if w.mux is not None:
                out.gauge("radixmesh_router_open_streams", "Calls on the worker's GenerateStream whose answer has "
                          "begun and not ended", w.mux.open_streams(), worker=w.url)
            out.gauge("sgl_router_worker_cb_state", "Circuit breaker per worker: 0 closed, 1 open, 2 half-open",
                      STATE_VALUES[w.breaker.state], worker=w.url)
            out.counter("sgl_router_worker_cb_transitions_total", "Circuit breaker state changes per worker",
                        w.breaker.transitions, worker=w.url)
        self._collect_admission(out)
        cache = self.tokenizer_cache
        if cache is not None:
            out.counter("sgl_router_tokenizer_cache_hits_total", "Tokenize requests answered from the L0 cache",
                        cache.hits)
            out.counter("sgl_router_tokenizer_cache_misses_total", "Tokenize requests sent to the tokenizer",
                        cache.misses)
            out.gauge("sgl_router_tokenizer_cache_entries", "Requests in the L0 tokenizer cache", len(cache))
        counts = getattr(self.policy, "counts", None)
        if counts is not None and "routing_key" in counts:  # manual
            for reason, n in counts.items():
                out.counter("sgl_router_manual_policy_picks_total", "manual picks: by routing key or without one",
                            n, reason=reason)
        elif counts is not None:  # cache_aware
            out.counter("sgl_router_cache_hits_total", "Requests routed by a prefix match", counts["cache_hits"])
            out.counter("sgl_router_cache_misses_total", "Requests without a good enough prefix match",
                        counts["cache_misses"])
            out.counter("sgl_router_load_balancing_events_total", "Requests routed by load (imbalance)",
                        counts["balance"])
            for url, tree in list(self.policy.trees.items()):
                out.gauge("sgl_router_tree_size", "Prefix blocks remembered per worker", tree.size, worker=url)
        decisions = getattr(self.policy, "decisions", None)
        if decisions is not None:  # kv_index
            for url, reasons in decisions.snapshot()["by_worker"].items():
                for reason, n in reasons.items():
                    out.counter("sgl_router_kv_index_decisions_total", "kv_index picks by reason (index: lowest "
                                "expected TTFT; tie: rendezvous among equals; fallback: index unavailable)", n,
                                worker=url, reason=reason)

    def _collect_admission(self, out: Families) -> None:
        limiter = self.admission.limiter if self.admission is not None else None
        rate = self.admission.rate if self.admission is not None else None
        if limiter is None and rate is None:
            return
        rejected = {"queue_full": 0, "queue_timeout": 0, "rate_limited": 0}
        if limiter is not None:
            out.gauge("sgl_router_queued_requests", "Requests waiting for a slot", limiter.queued)
            out.gauge("sgl_router_admitted_requests", "Requests holding a slot", limiter.running)
            rejected.update(queue_full=limiter.rejected, queue_timeout=limiter.timed_out)
        if rate is not None:
            rejected["rate_limited"] = rate.limited
        for reason, n in rejected.items():
            out.counter("sgl_router_rejected_requests_total", "Requests refused by admission control", n,
                        reason=reason)
