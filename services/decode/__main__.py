"""`python -m services.decode --model-path PATH --port N [engine flags]`: a worker serving the engine over gRPC.
With --disaggregation-mode null (the default) it is a colocated worker: prefill and decode in one process."""

from __future__ import annotations

import asyncio
import logging
import sys

from engine.config import EngineArgs
from engine.engine import Engine
from radixmesh.v1 import worker_pb2, worker_pb2_grpc
from services.common.logs import setup_logging
from services.common.server import GrpcService
from services.common.settings import parse_settings
from services.decode.servicer import WorkerServicer
from services.decode.settings import WorkerSettings


async def serve(settings: WorkerSettings, engine_kwargs: dict) -> None:
    # The worker streams disjoint segments; the router rebuilds cumulative text where a client wants it.
    engine = Engine(**{**engine_kwargs, "stream_output": True, "log_level": settings.log_level})
    servicer = WorkerServicer(engine, settings)

    def register(server) -> list[str]:
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
        return [worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name]

    async def on_stop() -> None:
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    service = GrpcService(settings, register, on_stop)
    watchdog = asyncio.create_task(_watch_engine(engine, service))
    await service.run_until_signal()
    if watchdog.done():  # stopped because the engine died, not by a signal
        raise SystemExit(1)
    watchdog.cancel()


async def _watch_engine(engine: Engine, service: GrpcService) -> None:
    """A worker whose scheduler died must not keep answering SERVING: stop (health NOT_SERVING, calls drained) and
    exit non-zero, so routers move on and a supervisor restarts it."""
    while engine.alive:
        await asyncio.sleep(1.0)
    logging.getLogger(__name__).error("the engine's scheduler is not running; stopping this worker")
    service.request_stop()


def main(argv: list[str] | None = None, description: str = "radixmesh worker (colocated or decode)") -> None:
    settings, engine_kwargs = parse_settings(description, WorkerSettings, argv, EngineArgs)
    if not engine_kwargs.get("model_path"):
        sys.exit("--model-path is required")
    setup_logging(f"{settings.disaggregation_mode if settings.disaggregation_mode != 'null' else 'worker'}",
                  settings.log_level)
    asyncio.run(serve(settings, engine_kwargs))


if __name__ == "__main__":
    main()
