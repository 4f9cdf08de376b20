"""Prometheus metrics for every service: the flags, one registry per service with the `model_name` and `role`
labels on every series, SGLang's histogram buckets, and the /metrics HTTP endpoint.

    settings = MetricsSettings(enable_metrics=True, metrics_port=9100)
    metrics = ServiceMetrics.from_settings(settings, role="kvstore", model_name="")   # None when metrics are off
    ops = metrics.counter("radixmesh:kvstore_operations_total", "KV store calls", ("op", "result"))
    ops.labels("get", "hit").inc()                  # model_name and role are filled in
    metrics.collect(lambda out: out.gauge("radixmesh:kvstore_pages", "pages held", store.pages))
    server = await metrics.serve(settings, default_host)   # aiohttp on the running event loop; server.port

Counters only go up while the process lives: a service creates its metrics once and never resets them. Values the
service already keeps (an engine's load report, a store's counters) are read at scrape time by a collector function
(`collect`), optionally refreshed first by an async hook (`before_scrape`), so nothing is recomputed per request.
Scrapes run on the service's own event loop, so collectors may read loop-owned state without locks; anything that
blocks belongs in a `before_scrape` hook that runs it in an executor.
When metrics are off a service holds None instead of a ServiceMetrics and pays nothing."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable, Sequence

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST, PlatformCollector, ProcessCollector, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger(__name__)

ROLES = ("colocated", "prefill", "decode", "router", "tokenizer", "kvstore", "launcher")
BASE_LABELS = ("model_name", "role")

# SGLang's default buckets (seconds), so dashboards built for SGLang read ours unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 15.0,
                20.0, 25.0, 30.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.2, 0.4,
               0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0)
QUEUE_BUCKETS = (0.0, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Calls that take micro- to milliseconds (tokenization, a store lookup, a routing decision).
FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Whole requests as a router sees them: SGLang's function-latency buckets, 0.05 s x 1.5^k.
REQUEST_BUCKETS = tuple(round(0.05 * 1.5 ** k, 4) for k in range(18))


@dataclass(frozen=True, slots=True)
class MetricsSettings:
    """The metrics flags every service takes (pass it to parse_settings as an extra class)."""

    enable_metrics: bool = field(default=False, metadata={
        "help": "export Prometheus metrics at /metrics (gRPC services: on --metrics-port)"})
    metrics_port: int | None = field(default=None, metadata={
        "help": "HTTP port of /metrics (0: pick a free one and log it); giving it turns metrics on"})
    metrics_host: str | None = field(default=None, metadata={
        "help": "address the /metrics port listens on (default: the service's --host)"})

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")

    @property
    def enabled(self) -> bool:
        """--enable-metrics, or a --metrics-port (asking for a port means asking for metrics)."""
        return self.enable_metrics or self.metrics_port is not None


class Families:
    """What one collector pass reports: gauges and counters from values the service already keeps. Every sample
    gets the service's model_name and role; `labels` adds more."""

    def __init__(self, base: dict[str, str]):
        self._base = base
        self._families: dict[str, tuple[Metric, tuple[str, ...]]] = {}  # name -> (family, its extra label names)

    def _add(self, cls, name: str, doc: str, value: float, labels: dict[str, str]) -> None:
        if name not in self._families:
            self._families[name] = (cls(name, doc, labels=[*BASE_LABELS, *labels]), tuple(labels))
        family, names = self._families[name]
        family.add_metric([*self._base.values(), *(labels[k] for k in names)], value)

    def gauge(self, name: str, doc: str, value: float, **labels: str) -> None:
        """One sample; the first call for a name fixes its help text and label names."""
        self._add(GaugeMetricFamily, name, doc, value, labels)

    def counter(self, name: str, doc: str, value: float, **labels: str) -> None:
        """`value` must never decrease while the process lives (a total the service keeps)."""
        self._add(CounterMetricFamily, name, doc, value, labels)

    def families(self) -> Iterable[Metric]:
        return [family for family, _ in self._families.values()]


class _Collected:
    """A prometheus collector over one `fn(Families)`."""

    def __init__(self, base: dict[str, str], fn: Callable[[Families], None]):
        self._base, self._fn = base, fn

    def describe(self) -> list:
        return []  # registered without a trial collect; names are not checked for clashes

    def collect(self) -> Iterable[Metric]:
        out = Families(self._base)
        try:
            self._fn(out)
        except Exception:  # noqa: BLE001 - one failing source must not fail the whole scrape
            log.exception("metrics collector failed; its series are left out of this scrape")
            return []
        return out.families()


class _Bound:
    """A labelled metric with model_name and role filled in: `.labels(*extra)` takes only the other labels."""

    __slots__ = ("_metric", "_base")

    def __init__(self, metric, base: tuple[str, str]):
        self._metric, self._base = metric, base

    def labels(self, *extra: str):
        return self._metric.labels(*self._base, *extra)


class ServiceMetrics:
    """One service's metrics: its own registry (several services may share a process in tests), the process
    collectors, and the constant labels."""

    def __init__(self, role: str, model_name: str = ""):
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        disable_created_metrics()  # no *_created series next to counters and histograms (as SGLang's output)
        self.role, self.model_name = role, model_name
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self._base = (model_name, role)
        self._hooks: list[Callable[[], Awaitable[None]]] = []

    @classmethod
    def from_settings(cls, settings: MetricsSettings, role: str, model_name: str = "") -> "ServiceMetrics | None":
        return cls(role, model_name) if settings.enabled else None

    # ---- instruments updated as things happen ------------------------------------------------------------------
    def _make(self, cls, name: str, doc: str, labels: Sequence[str], **kw):
        metric = cls(name, doc, [*BASE_LABELS, *labels], registry=self.registry, **kw)
        return _Bound(metric, self._base) if labels else metric.labels(*self._base)

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()):
        """A counter; without extra `labels` the child itself (`.inc(n)`), else `.labels(*values).inc(n)`.
        Name it with the `_total` suffix (the exposition shows it so)."""
        return self._make(Counter, name, doc, labels)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()):
        return self._make(Gauge, name, doc, labels)

    def histogram(self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()):
        return self._make(Histogram, name, doc, labels, buckets=buckets)

    # ---- values read at scrape time ----------------------------------------------------------------------------
    def collect(self, fn: Callable[[Families], None]) -> None:
        """Call `fn(families)` on every scrape (on the service's event loop) to report values kept elsewhere."""
        self.registry.register(_Collected(dict(zip(BASE_LABELS, self._base)), fn))

    def before_scrape(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Await `hook()` before each scrape, e.g. to fetch a snapshot in an executor for a collector to read."""
        self._hooks.append(hook)

    async def exposition(self) -> bytes:
        for hook in self._hooks:
            try:
                await hook()
            except Exception:  # noqa: BLE001 - report what can be reported
                log.exception("metrics refresh failed; reporting the values from the last scrape")
        return generate_latest(self.registry)

    async def handle(self, request: web.Request) -> web.Response:
        """aiohttp handler for GET /metrics (add it to an existing app, as the router does)."""
        body = await self.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def serve(self, settings: MetricsSettings, default_host: str) -> "MetricsServer":
        """Listen for GET /metrics on --metrics-host:--metrics-port (default host: `default_host`; port 0 when
        only --enable-metrics was given) on the running event loop."""
        host = settings.metrics_host or default_host
        port = settings.metrics_port or 0
        try:
            sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        except OSError as e:
            raise OSError(f"cannot serve metrics on {host}:{port} (--metrics-port): {e}") from None
        app = web.Application()
        app.router.add_get("/metrics", self.handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        bound = sock.getsockname()[1]
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return MetricsServer(runner, bound)


@dataclass(slots=True)
class MetricsServer:
    runner: web.AppRunner
    port: int

    async def stop(self) -> None:
        await self.runner.cleanup()
