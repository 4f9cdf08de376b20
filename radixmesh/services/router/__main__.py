"""`python -m radixmesh.services.router --tokenizer-url HOST:PORT --worker-urls HOST:PORT ... [--port 30000]`: the
public front door. HTTP (OpenAI + SGLang native) on --port, the public gRPC API on --grpc-port when given.
SIGTERM/SIGINT: stop accepting, let open requests finish (up to --shutdown-grace-s), then exit."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import signal
import sys
import time

from aiohttp import web

from radixmesh.v1 import router_pb2, router_pb2_grpc
from radixmesh.services.common import auth, event_loop, heap
from radixmesh.services.common.auth import InternalAuthSettings
from radixmesh.services.common.logs import setup_logging
from radixmesh.services.common.metrics import MetricsSettings, ServiceMetrics
from radixmesh.services.common.server import GrpcService, GrpcSettings
from radixmesh.services.common import tracing
from radixmesh.settings import parse_settings
from radixmesh.services.common.tracing import TraceSettings, settings_or_exit, setup_tracing
from radixmesh.services.router import embeddings_api
from radixmesh.services.router import lora_api, native_api, openai_api, openapi, utility_api
from radixmesh.services.router.admission import Admission, admission_middleware
from radixmesh.services.router.core import Router
from radixmesh.services.router.discovery import DnsDiscovery
from radixmesh.services.router.grpc_api import RouterServicer
from radixmesh.services.router.http_common import (INFLIGHT, OPEN_PATHS, errors_middleware, make_auth_middleware,
                                                   routing_key_middleware, traced_errors_middleware)
from radixmesh.services.router.metrics import RouterMetrics
from radixmesh.services.router import peers as peers_mod, supervisor
from radixmesh.services.router.peers import Peers
from radixmesh.services.router.policy_registry import make_policy
from radixmesh.services.router.resilience import CircuitBreaker
from radixmesh.services.router.settings import RouterSettings
from radixmesh.services.router.tokenizer_client import TokenizerUnavailable
from radixmesh.services.router.tokenizer_pool import TokenizerPool, tokenizer_urls
from radixmesh.services.router.workers import WorkerRegistry

log = logging.getLogger("radixmesh.services.router")
STARTUP_WAIT_S = 120.0


def build_app(router: Router, metrics: ServiceMetrics | None = None) -> web.Application:
    """The HTTP API; with `metrics`, every request is counted and GET /metrics serves them (no API key needed)."""
    settings = router.settings
    admission = getattr(router, "admission", None) or Admission.from_settings(settings)
    # with tracing on, the request's server span opens where errors are answered: it covers the whole request
    middlewares = [traced_errors_middleware if tracing.enabled() else errors_middleware,
                   make_auth_middleware(router.tenants, settings.admin_api_key)]
    if admission.limiter is not None or admission.rate is not None:  # no cost per request when off
        middlewares.append(admission_middleware(admission, OPEN_PATHS))
    if "manual" in (settings.policy, settings.prefill_policy, settings.decode_policy):
        middlewares.append(routing_key_middleware)
    if router.metrics is not None:
        middlewares.insert(0, router.metrics.middleware())
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
    app[native_api.ROUTER] = router
    app[INFLIGHT] = {"n": 0}
    native_api.add_routes(app)
    openai_api.add_routes(app)
    embeddings_api.add_routes(app)
    utility_api.add_routes(app)
    lora_api.add_routes(app)
    openapi.add_routes(app)
    peers = getattr(router, "peers", None)
    if peers is not None and metrics is not None:  # one of several router processes: answer for all of them
        async def all_metrics(request: web.Request) -> web.Response:
            return web.Response(body=await peers.scrape_all(), content_type="text/plain", charset="utf-8")
        app.router.add_get("/metrics", all_metrics)
    elif metrics is not None:
        app.router.add_get("/metrics", metrics.handle)
    return app


def router_metrics(router: Router, settings: MetricsSettings) -> ServiceMetrics | None:
    """The router's metrics (labelled with the model its workers serve), attached to `router`; None when off."""
    metrics = ServiceMetrics.from_settings(settings, "router", router.model_name)
    if metrics is not None:
        router.metrics = RouterMetrics(metrics, router.registry, router.policy, router.settings.policy,
                                       getattr(router, "admission", None), router.tokenizer.cache)
    return metrics


async def build_router(settings: RouterSettings) -> Router:
    tokenizer = TokenizerPool(tokenizer_urls(settings.tokenizer_url), settings.connect_timeout_s,
                              settings.tokenizer_cache_l0_max_entries if settings.tokenizer_cache_enable_l0 else 0,
                              stream_lanes=not settings.disable_stream_lane)
    await tokenizer.connect(STARTUP_WAIT_S)
    registry = WorkerRegistry(
        settings.connect_timeout_s, settings.health_check_interval_s, probe_timeout_s=settings.health_check_timeout_secs,
        failure_threshold=settings.health_failure_threshold, success_threshold=settings.health_success_threshold,
        probing=not settings.disable_health_check, new_breaker=lambda: CircuitBreaker(
            settings.cb_failure_threshold, settings.cb_success_threshold, settings.cb_timeout_duration_secs,
            settings.cb_window_duration_secs, enabled=not settings.disable_circuit_breaker),
        stream_lanes=not settings.disable_stream_lane)
    for url in settings.worker_urls:
        try:
            await registry.add(url)
        except ValueError as e:
            log.error("worker not added (add it later with POST /add_worker?url=...): %s", e)
    if settings.discovery_dns:
        discovery = DnsDiscovery(registry, settings.discovery_dns)
        await discovery.refresh()
        registry.schedule(settings.discovery_interval_s, discovery.refresh)
    policy = make_policy(settings.policy, settings, registry)
    roles = {role: make_policy(name, settings, registry) for role, name in
             (("prefill", settings.prefill_policy), ("decode", settings.decode_policy)) if name is not None}
    router = Router(settings, registry, policy, tokenizer, roles)
    for worker in list(registry.workers.values()):  # added before the router set registry.on_add
        router.lora.sync.joined(worker)
    registry.every(settings.health_check_interval_s, router.lora.refresh)  # each worker's LoRA adapters
    registry.start()
    router.admission = Admission.from_settings(settings)  # the HTTP and gRPC front ends share its limits
    return router


async def _drain(app: web.Application, grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    while app[INFLIGHT]["n"] > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if app[INFLIGHT]["n"]:
        log.warning("%d requests still open after %.0f s; closing them", app[INFLIGHT]["n"], grace_s)


def share_limits(settings: RouterSettings, count: int) -> RouterSettings:
    """One of `count` router processes' admission limits: the concurrency limit, its queue and each key's rate
    divided among them (rounded up; the kernel spreads connections evenly, not exactly)."""
    changes = {}
    if settings.max_concurrent_requests > 0:
        changes["max_concurrent_requests"] = math.ceil(settings.max_concurrent_requests / count)
        changes["queue_size"] = math.ceil(settings.queue_size / count)
    if settings.rate_limit_tokens_per_second is not None:
        rate = settings.rate_limit_tokens_per_second
        changes["rate_limit_tokens_per_second"] = rate / count
        changes["rate_limit_burst"] = max((settings.rate_limit_burst or max(rate, 1.0)) / count, 1.0)
    return dataclasses.replace(settings, **changes)


async def serve(settings: RouterSettings, metrics_settings: MetricsSettings | None = None) -> None:
    link = peers_mod.from_env()
    if link is not None:
        settings = share_limits(settings, link[2])
        if link[1] != 0:  # process 0 probes the workers and tells the others
            settings = dataclasses.replace(settings, disable_health_check=True)
    try:
        router = await build_router(settings)
    except TokenizerUnavailable as e:
        log.error("cannot start: %s", e)
        raise SystemExit(1) from None
    metrics_settings = metrics_settings or MetricsSettings()
    peers = None
    if link is not None:
        router.peers = peers = Peers(router, link[0], link[1])
        await peers.connect()
        if metrics_settings.enabled:  # the supervisor serves --metrics-port for all the processes
            metrics_settings = dataclasses.replace(metrics_settings, enable_metrics=True, metrics_port=None)
    metrics = router_metrics(router, metrics_settings)
    if peers is not None:
        peers.metrics = metrics
    app = build_app(router, metrics)
    # handler_cancellation: a client that disconnects cancels its handler, which cancels the worker call (the
    # worker aborts the request and frees its KV pages), also for non-streaming requests
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, reuse_port=peers is not None)
    await site.start()
    # /metrics is on the API port; --metrics-port also serves it on a port of its own (as SGLang's router does)
    metrics_server = await metrics.serve(metrics_settings, settings.host) \
        if metrics is not None and metrics_settings.metrics_port is not None else None
    grpc_service = None
    if settings.grpc_port is not None:
        def register(server) -> list[str]:
            router_pb2_grpc.add_RouterServiceServicer_to_server(RouterServicer(router), server)
            return [router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name]
        grpc_service = GrpcService(GrpcSettings(settings.host, settings.grpc_port, settings.shutdown_grace_s,
                                                settings.log_level), register, internal=False,  # public: API keys
                                   reuse_port=peers is not None)
        await grpc_service.start()
    log.info("router listening on http://%s:%d (%d workers, policy %s, %s event loop)", settings.host,
             settings.port, len(router.registry.workers), settings.policy,
             event_loop.running())
    if peers is not None:
        peers.ready()
    heap.serving()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: no new requests; %d open", app[INFLIGHT]["n"])
    await site.stop()
    stops = [_drain(app, settings.shutdown_grace_s)]
    if grpc_service is not None:
        stops.append(grpc_service.stop())
    await asyncio.gather(*stops)
    if router.abort_all("the server is shutting down"):  # still open after the grace period: end them with an error
        await _drain(app, 2.0)
    await runner.cleanup()
    if metrics_server is not None:
        await metrics_server.stop()
    if peers is not None:
        await peers.close()
    await router.registry.close()
    await router.tokenizer.close()
    for policy in {id(p): p for p in router.role_policies.values()}.values():
        close_policy = getattr(policy, "close", None)
        if close_policy is not None:
            await close_policy()
    log.info("stopped")


def parse_args(argv: list[str] | None = None):
    """The flags -> (RouterSettings, MetricsSettings keyword arguments, TraceSettings keyword arguments,
    InternalAuthSettings keyword arguments: the credentials of its calls to the mesh's services); exits with the
    reason on a flag it does not know or a bad value."""
    return parse_settings("radixmesh router: the public HTTP (OpenAI, SGLang) and gRPC front door", RouterSettings,
                          argv, MetricsSettings, TraceSettings, InternalAuthSettings)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    settings, metrics_kwargs, trace_kwargs, auth_kwargs = parse_args(argv)
    trace_settings = settings_or_exit(trace_kwargs)  # checked before --router-workers starts any process
    link = peers_mod.from_env()
    setup_logging("router" if link is None else f"router-{link[1]}", settings.log_level)
    auth.setup(auth_kwargs)
    try:
        metrics_settings = MetricsSettings(**metrics_kwargs)
    except ValueError as e:
        sys.exit(str(e))
    count = settings.router_workers or supervisor.cores()
    if count > 1 and link is None:
        sys.exit(asyncio.run(supervisor.supervise(argv, count, settings.shutdown_grace_s,
                                                  metrics_settings.metrics_host or settings.host,
                                                  metrics_settings.metrics_port)))
    setup_tracing(trace_settings, "router")
    heap.opt_in()
    event_loop.run(serve(settings, metrics_settings), settings.event_loop)


if __name__ == "__main__":
    sys.exit(main())
