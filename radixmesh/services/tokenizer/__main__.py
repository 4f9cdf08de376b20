"""`python -m radixmesh.services.tokenizer --model-path PATH [--port N] [--chat-template NAME_OR_FILE]`: serve
radixmesh.v1.TokenizerService until SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import sys
from typing import Sequence

from radixmesh.v1 import tokenizer_pb2
from radixmesh.services.common import auth, event_loop, heap
from radixmesh.services.common.auth import InternalAuthSettings
from radixmesh.services.common.logs import setup_logging
from radixmesh.services.common.metrics import MetricsSettings, ServiceMetrics
from radixmesh.services.common.server import GrpcService
from radixmesh.settings import parse_settings
from radixmesh.services.common.tracing import TraceSettings, settings_or_exit, setup_tracing
from radixmesh.services.tokenizer.backend import TokenizerBackend
from radixmesh.services.tokenizer.metrics import TokenizerMetrics
from radixmesh.services.tokenizer.servicer import TokenizerServicer, add_to_server
from radixmesh.services.tokenizer.settings import TokenizerSettings
from radixmesh.services.tokenizer.without_torch import leave_out, restart_with_torch

log = logging.getLogger("radixmesh.services.tokenizer")


async def serve(settings: TokenizerSettings, backend: TokenizerBackend,
                metrics_settings: MetricsSettings | None = None) -> None:
    metrics_settings = metrics_settings or MetricsSettings()
    metrics = ServiceMetrics.from_settings(metrics_settings, "tokenizer",
                                           settings.served_model_name or settings.model_path)
    servicer = TokenizerServicer(backend, TokenizerMetrics(metrics) if metrics is not None else None)
    metrics_server = None

    async def on_stop() -> None:
        if metrics_server is not None:
            await metrics_server.stop()
        backend.close()

    service = GrpcService(settings, lambda server: add_to_server(servicer, server), on_stop,
                          lanes={"TokenizeStream": (servicer.TokenizeStream, tokenizer_pb2.TokenizeStreamRequest)})
    servicer.draining = service.draining
    if metrics is not None:
        metrics_server = await metrics.serve(metrics_settings, settings.host)
    await service.run_until_signal()


def parse_args(argv: Sequence[str] | None = None):
    """The flags -> (settings, MetricsSettings keyword arguments, TraceSettings keyword arguments,
    InternalAuthSettings keyword arguments); exits with the reason on a flag it does not know or a bad value."""
    return parse_settings(
        "radixmesh tokenizer service: chat templates, tokenization, detokenization.", TokenizerSettings, argv,
        MetricsSettings, TraceSettings, InternalAuthSettings)


def main(argv: Sequence[str] | None = None, own_process: bool = False) -> int:
    """`own_process`: this process is the service's alone (`python -m`), so torch is left out of it (without_torch)."""
    settings, metrics_kwargs, trace_kwargs, auth_kwargs = parse_args(argv)
    setup_logging("tokenizer", settings.log_level)
    without_torch = own_process and leave_out(settings.trust_remote_code)
    auth.setup(auth_kwargs)
    setup_tracing(settings_or_exit(trace_kwargs), "tokenizer")
    try:
        metrics_settings = MetricsSettings(**metrics_kwargs)
        backend = TokenizerBackend.from_settings(settings)
    except ImportError as e:
        if without_torch:
            restart_with_torch(e)
        raise
    except (OSError, ValueError) as e:
        log.error("cannot start: %s", e)
        return 1
    heap.opt_in()
    event_loop.run(serve(settings, backend, metrics_settings), settings.event_loop)
    return 0


if __name__ == "__main__":
    sys.exit(main(own_process=True))
