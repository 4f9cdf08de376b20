"""The kvstore's Prometheus metrics (labels model_name "" and role="kvstore"):

    radixmesh:kvstore_requests_total{method,code}         gRPC calls by method and status code (OK, UNAVAILABLE, ...)
    radixmesh:kvstore_request_duration_seconds{method}    call time
    radixmesh:kvstore_pages, _bytes, _capacity_bytes       what the backend holds (gauges, read at scrape time)
    radixmesh:kvstore_page_gets_total{result=hit|miss}    pages asked for by BatchGet, found or not
    radixmesh:kvstore_page_sets_total                     pages stored
    radixmesh:kvstore_evictions_total, _corrupt_pages_total
    radixmesh:kvstore_indexed_workers, _indexed_pages     the global prefix index
    radixmesh:kvstore_transfer_bytes_total{direction=in|out}  page bytes moved by the Mooncake transfer engine

The backend's counters are read once per scrape (in the storage executor: a backend call may block), never per page.
"""

from __future__ import annotations

import asyncio
import functools
import time

from radixmesh.services.common.errors import status_for
from radixmesh.services.common.metrics import FAST_BUCKETS, Families, ServiceMetrics

METHODS = ("BatchExists", "BatchGet", "BatchSet", "MatchPrefix", "RegisterWorker", "GetStats", "Clear",
           "ReleaseStaged")


class KvStoreMetrics:
    def __init__(self, metrics: ServiceMetrics, servicer):
        self.servicer = servicer
        self.requests = metrics.counter("radixmesh:kvstore_requests_total", "kvstore gRPC calls by method and status",
                                        ("method", "code"))
        self.duration = metrics.histogram("radixmesh:kvstore_request_duration_seconds", "kvstore gRPC call time (s)",
                                          FAST_BUCKETS, ("method",))
        self._stats: dict = {}
        metrics.before_scrape(self._refresh)
        metrics.collect(self._collect)
        for name in METHODS:
            setattr(servicer, name, self._timed(name, getattr(servicer, name)))

    def _timed(self, method: str, fn):
        @functools.wraps(fn)
        async def wrapper(request, context):
            started, code = time.monotonic(), "OK"
            try:
                return await fn(request, context)
            except BaseException as e:
                code = "CANCELLED" if isinstance(e, asyncio.CancelledError) else status_for(e).name
                raise
            finally:
                self.requests.labels(method, code).inc()
                self.duration.labels(method).observe(time.monotonic() - started)

        return wrapper

    async def _refresh(self) -> None:
        loop = asyncio.get_running_loop()
        self._stats = await loop.run_in_executor(self.servicer.executor, self.servicer.storage.stats)

    def _collect(self, out: Families) -> None:
        s, index = self._stats, self.servicer.index
        for name in ("pages", "bytes", "capacity_bytes"):
            if name in s:
                out.gauge(f"radixmesh:kvstore_{name}", f"{name.replace('_', ' ')} the store holds", s[name])
        if "get_hits" in s:
            out.counter("radixmesh:kvstore_page_gets_total", "pages asked for by BatchGet", s["get_hits"],
                        result="hit")
            out.counter("radixmesh:kvstore_page_gets_total", "pages asked for by BatchGet", s["get_misses"],
                        result="miss")
        for name, doc in (("sets", "pages stored"), ("evictions", "pages evicted for capacity"),
                          ("corrupt_pages", "pages dropped because their bytes failed the checksum")):
            if name in s:
                out.counter(f"radixmesh:kvstore_{'page_sets' if name == 'sets' else name}_total", doc, s[name])
        out.gauge("radixmesh:kvstore_indexed_workers", "workers in the global prefix index", len(index.workers))
        out.gauge("radixmesh:kvstore_indexed_pages", "pages the index holds, over workers and tiers",
                  index.page_count())
        staging = self.servicer.staging
        if staging is not None:
            for direction in ("in", "out"):
                out.counter("radixmesh:kvstore_transfer_bytes_total", "page bytes moved by the transfer engine",
                            staging.stats[f"transfer_bytes_{direction}"], direction=direction)
