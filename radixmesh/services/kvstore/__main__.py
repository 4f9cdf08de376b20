"""`python -m radixmesh.services.kvstore --backend memory|file|redis|mooncake [--storage-url URL] [--capacity-bytes N]
[--ttl-s S] [--enable-mooncake-transfer] --port N`: serve radixmesh.v1.KvStoreService (the L3 page store and the
global prefix index) until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from radixmesh.engine.cache.storage import PageStorage, StorageError, open_storage
from radixmesh.services.common import auth, event_loop, heap
from radixmesh.services.common.auth import InternalAuthSettings
from radixmesh.services.common.transfer_host import transfer_host
from radixmesh.services.common.logs import setup_logging
from radixmesh.services.common.metrics import MetricsSettings, ServiceMetrics
from radixmesh.services.common.server import GrpcService
from radixmesh.settings import parse_settings
from radixmesh.services.common.tracing import TraceSettings, settings_or_exit, setup_tracing
from radixmesh.services.kvstore.index import PrefixIndex
from radixmesh.services.kvstore.metrics import KvStoreMetrics
from radixmesh.services.kvstore.servicer import KvStoreServicer, add_to_server
from radixmesh.services.kvstore.settings import KvStoreSettings
from radixmesh.services.kvstore.subscriber import Subscriptions
from radixmesh.services.kvstore.transfer import StagingSlots

log = logging.getLogger("radixmesh.services.kvstore")


async def serve(settings: KvStoreSettings, storage: PageStorage, staging: StagingSlots | None = None,
                metrics_settings: MetricsSettings | None = None) -> None:
    executor = ThreadPoolExecutor(settings.storage_threads, thread_name_prefix="kvstore-storage")
    index = PrefixIndex()
    subscriptions = Subscriptions(index, settings.worker_ttl_s, settings.subscribe_backoff_max_s)
    servicer = KvStoreServicer(storage, settings.backend, index, subscriptions, executor, staging,
                               settings.storage_timeout_s)
    metrics_settings = metrics_settings or MetricsSettings()
    metrics = ServiceMetrics.from_settings(metrics_settings, "kvstore")
    metrics_server = None
    if metrics is not None:
        KvStoreMetrics(metrics, servicer)
        metrics_server = await metrics.serve(metrics_settings, settings.host)

    async def on_stop() -> None:
        if metrics_server is not None:
            await metrics_server.stop()
        await subscriptions.close()
        await asyncio.get_running_loop().run_in_executor(executor, storage.close)
        executor.shutdown(wait=False)
        if staging is not None:
            staging.close()

    service = GrpcService(settings, lambda server: add_to_server(servicer, server), on_stop)
    log.info("storage backend %s%s", settings.backend, f" at {settings.storage_url}" if settings.storage_url else "")
    await service.run_until_signal()


def parse_args(argv: Sequence[str] | None = None):
    """The flags -> (settings, MetricsSettings keyword arguments, TraceSettings keyword arguments,
    InternalAuthSettings keyword arguments); exits with the reason on a flag it does not know or a bad value."""
    return parse_settings(
        "radixmesh kvstore: the shared L3 KV page store and the global prefix index.", KvStoreSettings, argv,
        MetricsSettings, TraceSettings, InternalAuthSettings)


def main(argv: Sequence[str] | None = None) -> int:
    settings, metrics_kwargs, trace_kwargs, auth_kwargs = parse_args(argv)
    setup_logging("kvstore", settings.log_level)
    auth.setup(auth_kwargs)
    setup_tracing(settings_or_exit(trace_kwargs), "kvstore")
    try:
        metrics_settings = MetricsSettings(**metrics_kwargs)
    except ValueError as e:
        log.error("cannot start: %s", e)
        return 1
    try:
        storage = open_storage(settings.backend, settings.storage_options())
    except (StorageError, ValueError) as e:
        log.error("cannot open the %s storage: %s", settings.backend, e)
        return 1
    staging = None
    if settings.enable_mooncake_transfer:
        try:
            staging = StagingSlots(transfer_host(settings.transfer_host, settings.host),
                                   settings.transfer_buffer_bytes, settings.transfer_lease_s)
        except RuntimeError as e:
            log.error("cannot start the Mooncake transfer engine: %s", e)
            storage.close()
            return 1
    heap.opt_in()
    event_loop.run(serve(settings, storage, staging, metrics_settings), settings.event_loop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
