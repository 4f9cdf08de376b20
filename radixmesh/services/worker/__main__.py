"""`python -m radixmesh.services.worker --model-path PATH --port N [engine flags]`: a worker serving the engine over
gRPC. With --disaggregation-mode null (the default) it is a colocated worker: prefill and decode in one process."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import TYPE_CHECKING

from radixmesh.engine.config import EngineArgs
from radixmesh.v1 import worker_pb2, worker_pb2_grpc
from radixmesh.services.common import auth, event_loop, heap
from radixmesh.services.common.auth import InternalAuthSettings
from radixmesh.services.common.logs import setup_logging
from radixmesh.services.common.metrics import MetricsSettings, ServiceMetrics
from radixmesh.services.common.server import GrpcService
from radixmesh.settings import parse_settings
from radixmesh.services.common.tracing import TraceSettings, setup_tracing
from radixmesh.services.worker.settings import PdSettings, WorkerSettings

if TYPE_CHECKING:
    from radixmesh.engine.engine import Engine


ROLES = {"null": "colocated", "prefill": "prefill", "decode": "decode"}  # --disaggregation-mode -> metrics role


async def serve(settings: WorkerSettings, engine_kwargs: dict, pd: PdSettings | None = None,
                metrics_settings: MetricsSettings | None = None) -> None:
    # torch comes with the engine, imported here: `--help` and a flag error answer in half a second, not four
    from radixmesh.engine.engine import Engine
    from radixmesh.services.worker.servicer import WorkerServicer

    # The worker streams disjoint segments; the router rebuilds cumulative text where a client wants it.
    engine_kwargs = pd_engine_kwargs(settings, kvstore_engine_kwargs(settings, engine_kwargs))
    engine = Engine(**{**engine_kwargs, "stream_output": True, "log_level": settings.log_level})
    prefill_rooms, decode_rooms, bootstrap = _disaggregation(engine, settings, pd or PdSettings())
    metrics_settings = metrics_settings or MetricsSettings()
    metrics = ServiceMetrics.from_settings(metrics_settings, ROLES[settings.disaggregation_mode],
                                           settings.served_model_name or engine.args.model_path)
    servicer = WorkerServicer(engine, settings, prefill_rooms, decode_rooms, metrics)

    def register(server) -> list[str]:
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
        return [worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name]

    registration = metrics_server = announcer = None

    async def on_stop() -> None:  # in-flight calls have drained: leave the routers first, then release
        if announcer is not None:
            await announcer.stop()
        if metrics_server is not None:
            await metrics_server.stop()
        if registration is not None:
            await registration.stop()
        if bootstrap is not None:
            await bootstrap.stop(settings.shutdown_grace_s)
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        if servicer.prompts is not None:
            servicer.prompts.close()
        rooms = prefill_rooms or decode_rooms
        if rooms is not None:
            rooms.transfer.close()

    def on_start() -> None:  # the server answers SERVING now: the routers may call back
        if announcer is not None:
            announcer.start()

    service = GrpcService(settings, register, on_stop, on_start,
                          lanes={"GenerateStream": (servicer.GenerateStream, worker_pb2.GenerateStreamRequest)})
    servicer.draining = service.draining
    announcer = _router_announcer(settings, service.port)
    if metrics is not None:
        metrics_server = await metrics.serve(metrics_settings, settings.host)
    if bootstrap is not None:
        await bootstrap.start()
    if settings.kvstore_url:
        registration = _register_with_kvstore(engine, settings, service.port)
    watchdog = asyncio.create_task(_watch_engine(engine, service))
    await service.run_until_signal()
    if watchdog.done() and watchdog.result():  # stopped because the engine died, not by a signal
        raise SystemExit(1)
    watchdog.cancel()


def pd_engine_kwargs(settings: WorkerSettings, engine_kwargs: dict) -> dict:
    """A prefill or decode worker keeps its sliding layers' KV in the one pool the transfers carry (the engine
    refuses a disaggregated request under hybrid SWA memory, engine.cache.swa_pool), as if started with
    --disable-hybrid-swa-memory; a colocated worker's kwargs are unchanged."""
    if settings.disaggregation_mode == "null" or engine_kwargs.get("disable_hybrid_swa_memory"):
        return engine_kwargs
    return {**engine_kwargs, "disable_hybrid_swa_memory": True}


def kvstore_engine_kwargs(settings: WorkerSettings, engine_kwargs: dict) -> dict:
    """With --kvstore-url the engine publishes KV events, and `--hicache-storage-backend kvstore` reads and writes
    pages there unless --hicache-storage-url names another kvstore."""
    kwargs = dict(engine_kwargs)
    uses_kvstore = kwargs.get("hicache_storage_backend") == "kvstore"
    if uses_kvstore:
        from radixmesh.services.kvstore.client import register_kvstore_backend

        register_kvstore_backend()
    if not settings.kvstore_url:
        if uses_kvstore and not kwargs.get("hicache_storage_url"):
            raise SystemExit("--hicache-storage-backend kvstore needs --hicache-storage-url or --kvstore-url")
        return kwargs
    kwargs.setdefault("kv_events_config", '{"publisher": "kvstore"}')
    if uses_kvstore:
        kwargs.setdefault("hicache_storage_url", settings.kvstore_url)
    return kwargs


def advertised_url(settings: WorkerSettings, port: int) -> str:
    """host:port the kvstore and the routers know this worker by: --advertise-url, else where it listens (this
    host's address when that is a wildcard)."""
    from radixmesh.services.common.transfer_host import transfer_host

    return settings.advertise_url or f"{transfer_host(None, settings.host)}:{port}"


def _router_announcer(settings: WorkerSettings, port: int):
    """With --router-url: the registration with the router(s), started once the gRPC server serves."""
    if not settings.router_url:
        return None
    from radixmesh.services.worker.announce import RouterAnnouncer

    return RouterAnnouncer(settings.router_url, advertised_url(settings, port), settings.router_api_key,
                           settings.router_lease_s)


def _register_with_kvstore(engine: Engine, settings: WorkerSettings, port: int):
    """Announce this worker to the kvstore (again every few seconds, so a restarted kvstore finds it)."""
    from radixmesh.engine.cache.build import kv_layout
    from radixmesh.services.kvstore.client import WorkerRegistration

    url = advertised_url(settings, port)
    uses_storage = (engine.args.hicache_storage_backend == "kvstore"
                    and engine.args.hicache_storage_url == settings.kvstore_url)
    registration = WorkerRegistration(settings.kvstore_url, url, kv_layout(engine.args, engine.model_config),
                                      uses_storage)
    registration.start()
    logging.getLogger(__name__).info("publishing KV events to the kvstore at %s as %s", settings.kvstore_url, url)
    return registration


def _disaggregation(engine: Engine, settings: WorkerSettings, pd: PdSettings):
    """Prefill mode: the transfer backend and the bootstrap server decode workers call; decode mode: the backend
    and the per-request handoff. Returns (prefill rooms, decode rooms, bootstrap server), None where unused."""
    mode = settings.disaggregation_mode
    if mode == "null":
        return None, None, None
    from radixmesh.services.common.kv_transfer import KvTransfer
    from radixmesh.services.common.transfer_host import transfer_host

    host = transfer_host(pd.disaggregation_transfer_host, settings.host)
    transfer = KvTransfer(engine, pd.disaggregation_transfer_backend, host, pd.disaggregation_inject_fault,
                          receives=mode == "decode")
    address = f"{host}:{settings.port}"
    if mode == "decode":
        from radixmesh.services.worker.receive import DecodeRooms

        return None, DecodeRooms(engine, transfer, address, pd.disaggregation_bootstrap_timeout,
                                 pd.disaggregation_transfer_timeout, pd.disaggregation_verify_kv,
                                 pd.disaggregation_prealloc_queue_size), None
    import grpc

    from radixmesh.v1 import bootstrap_pb2_grpc
    from radixmesh.services.common.server import SERVER_OPTIONS
    from radixmesh.services.common.trace_grpc import server_interceptors
    from radixmesh.services.prefill.bootstrap import PrefillRooms

    rooms = PrefillRooms(engine, transfer, address, pd.disaggregation_bootstrap_timeout,
                         pd.disaggregation_transfer_timeout)
    interceptors = [*auth.server_interceptors(), *server_interceptors()]  # the internal token first
    server = grpc.aio.server(interceptors=interceptors or None, options=SERVER_OPTIONS)
    bootstrap_pb2_grpc.add_KvBootstrapServiceServicer_to_server(rooms, server)
    where = f"{settings.host}:{settings.disaggregation_bootstrap_port}"
    rooms.bootstrap_port = auth.add_port(server, where)
    if rooms.bootstrap_port == 0:
        raise OSError(f"cannot listen on {where} (--disaggregation-bootstrap-port)")
    logging.getLogger(__name__).info("KV bootstrap on %s, transfer backend %s at %s", where,
                                     pd.disaggregation_transfer_backend, transfer.session_id)
    return rooms, None, server


async def _watch_engine(engine: Engine, service: GrpcService) -> bool:
    """A worker whose scheduler died must not keep answering SERVING: stop (health NOT_SERVING, calls drained) and
    exit non-zero, so routers move on and a supervisor restarts it. True when it stopped the worker; False when a
    stop (a signal) came first, since that stop shuts the engine down itself."""
    while engine.alive:
        if service.stop_requested:
            return False
        await asyncio.sleep(1.0)
    if service.stop_requested:
        return False
    logging.getLogger(__name__).error("the engine's scheduler is not running; stopping this worker")
    service.request_stop(grace_s=0)  # nothing in flight can finish without the scheduler
    return True


def _serve_follower_node(engine_kwargs: dict) -> int:
    """--node-rank > 0: this machine runs its tensor-parallel ranks of the worker whose node 0 serves gRPC."""
    from radixmesh.engine.config import resolve_args
    from radixmesh.engine.model_config import ModelConfig
    from radixmesh.engine.tp_worker import serve_node

    args = EngineArgs.from_kwargs(**engine_kwargs)
    try:
        args = resolve_args(args, ModelConfig.from_path(args.model_path, args.revision))
    except ValueError as e:
        return str(e)
    return serve_node(args)


def parse_args(argv: list[str] | None = None, description: str = "radixmesh worker (colocated or decode)"):
    """The worker's flags -> (WorkerSettings, PdSettings, MetricsSettings, TraceSettings, engine keyword arguments,
    InternalAuthSettings); exits with the reason on a flag it does not know or a bad value."""
    settings, pd_kwargs, metrics_kwargs, trace_kwargs, engine_kwargs, auth_kwargs = parse_settings(
        description, WorkerSettings, argv, PdSettings, MetricsSettings, TraceSettings, EngineArgs, InternalAuthSettings)
    if not engine_kwargs.get("model_path"):
        sys.exit("--model-path is required")
    try:
        return (settings, PdSettings(**pd_kwargs), MetricsSettings(**metrics_kwargs), TraceSettings(**trace_kwargs),
                engine_kwargs, InternalAuthSettings(**auth_kwargs))
    except ValueError as e:
        sys.exit(str(e))


def main(argv: list[str] | None = None, description: str = "radixmesh worker (colocated or decode)") -> None:
    settings, pd, metrics_settings, trace_settings, engine_kwargs, auth_settings = parse_args(argv, description)
    setup_logging(f"{settings.disaggregation_mode if settings.disaggregation_mode != 'null' else 'worker'}",
                  settings.log_level)
    if (engine_kwargs.get("nnodes") or 1) > 1 and settings.disaggregation_mode != "null":
        sys.exit("--nnodes > 1 does not run with prefill/decode disaggregation: the KV shards of every rank are "
                 "staged through node 0's memory for the transfer; run a PD worker's ranks on one node")
    if engine_kwargs.get("node_rank"):
        sys.exit(_serve_follower_node(engine_kwargs))
    auth.setup(auth_settings)
    setup_tracing(trace_settings, ROLES[settings.disaggregation_mode])
    heap.opt_in()
    event_loop.run(serve(settings, engine_kwargs, pd, metrics_settings), settings.event_loop)


if __name__ == "__main__":
    main()
