"""Clients of the kvstore.

- `KvStoreStorage`: the engine's PageStorage over the network (a synchronous channel: the engine calls it from its
  own storage thread). Every call is bounded by options.timeout_s; any gRPC error becomes StorageError.
  `register_kvstore_backend()` makes it `open_storage("kvstore", options)` (options.url = host:port).
- `WorkerRegistration`: a worker's task that calls RegisterWorker every few seconds, so the kvstore follows its KV
  events (again after a kvstore restart).
- `match_prefix()`: MatchPrefix for routers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

import grpc

from engine.cache.storage import (KvLayout, StorageError, StorageOptions, StoredPage, register_storage_backend)
from radixmesh.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.common.server import CHANNEL_OPTIONS
from services.kvstore import convert
from services.kvstore.index import WorkerMatch

log = logging.getLogger(__name__)

# A restarted kvstore is found again within a second or two (gRPC's default reconnect backoff grows to 120 s).
# Pages per request are bounded well under the 256 MiB message limit.
REQUEST_BYTES = 64 << 20
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                     ("grpc.max_reconnect_backoff_ms", 1000)]


def _target(url: str) -> str:
    return url.removeprefix("grpc://").removeprefix("kvstore://")


class KvStoreStorage:
    """PageStorage over the kvstore service. Thread-safe (a gRPC channel is)."""

    def __init__(self, options: StorageOptions):
        if not options.url:
            raise StorageError("the kvstore storage backend needs the kvstore's host:port as its url")
        self.url = _target(options.url)
        self.timeout_s = options.timeout_s
        self._layout = convert.layout_to_proto(options.layout) if options.layout is not None else None
        self._page_bytes = options.layout.page_bytes if options.layout is not None else 0
        self._channel = grpc.insecure_channel(self.url, options=CHANNEL_OPTIONS + RECONNECT_OPTIONS)
        self._stub = kvstore_pb2_grpc.KvStoreServiceStub(self._channel)

    def _call(self, method: str, request):
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise StorageError(f"kvstore {self.url} {method}: {e.code().name}: {e.details()}") from e

    def exists(self, keys: list[bytes]) -> int:
        if not keys:
            return 0
        return self._call("BatchExists", kvstore_pb2.BatchExistsRequest(layout=self._layout, keys=keys)).hit_prefix_len

    def get(self, keys: list[bytes]) -> list[StoredPage]:
        """One call per REQUEST_BYTES of pages (when the layout tells their size), until one comes back short."""
        out: list[StoredPage] = []
        step = max(REQUEST_BYTES // self._page_bytes, 1) if self._page_bytes else max(len(keys), 1)
        for start in range(0, len(keys), step):
            chunk = keys[start:start + step]
            response = self._call("BatchGet", kvstore_pb2.BatchGetRequest(layout=self._layout, keys=chunk))
            out.extend(StoredPage(p.key, p.data, p.checksum) for p in response.pages)
            if len(response.pages) < len(chunk):
                break
        return out

    def set(self, pages: list[StoredPage]) -> int:
        """One call per REQUEST_BYTES of pages."""
        stored, start = 0, 0
        while start < len(pages):
            end, size = start, 0
            while end < len(pages) and (end == start or size + len(pages[end].data) <= REQUEST_BYTES):
                size += len(pages[end].data)
                end += 1
            request = kvstore_pb2.BatchSetRequest(layout=self._layout, pages=convert.pages_to_proto(pages[start:end]))
            stored += self._call("BatchSet", request).stored
            start = end
        return stored

    def clear(self) -> int:
        return self._call("Clear", kvstore_pb2.ClearRequest()).removed

    def stats(self) -> dict:
        return convert.stats_from_proto(self._call("GetStats", kvstore_pb2.GetStatsRequest()))

    def close(self) -> None:
        self._channel.close()


def register_kvstore_backend() -> None:
    """`open_storage("kvstore", StorageOptions(url="host:port", layout=..., timeout_s=...))` opens a KvStoreStorage."""
    register_storage_backend("kvstore", KvStoreStorage)


def async_channel(url: str) -> grpc.aio.Channel:
    """A channel to the kvstore with the large-message options and a short reconnect backoff."""
    return grpc.aio.insecure_channel(_target(url), options=CHANNEL_OPTIONS + RECONNECT_OPTIONS)


class WorkerRegistration:
    """Calls RegisterWorker every `interval_s` until stop(). A kvstore that is down is logged (once per outage),
    never raised: the worker serves without the global index meanwhile."""

    def __init__(self, kvstore_url: str, worker_url: str, layout: KvLayout, uses_storage: bool,
                 interval_s: float = 3.0, timeout_s: float = 2.0):
        self.kvstore_url = kvstore_url
        self.request = kvstore_pb2.RegisterWorkerRequest(worker_url=worker_url, layout=convert.layout_to_proto(layout),
                                                         uses_storage=uses_storage)
        self.interval_s = interval_s
        self.timeout_s = min(timeout_s, interval_s)
        self.registered = 0  # successful calls
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._channel = async_channel(self.kvstore_url)
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="kvstore-registration")

    async def _loop(self) -> None:
        stub = kvstore_pb2_grpc.KvStoreServiceStub(self._channel)
        failing = False
        while True:
            try:
                await stub.RegisterWorker(self.request, timeout=self.timeout_s)
                self.registered += 1
                if failing:
                    log.info("registered with kvstore %s again", self.kvstore_url)
                failing = False
            except grpc.aio.AioRpcError as e:
                if not failing:
                    log.warning("cannot register with kvstore %s (%s: %s); retrying every %.1f s", self.kvstore_url,
                                e.code().name, e.details(), self.interval_s)
                failing = True
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._channel is not None:
            await self._channel.close(grace=None)
            self._channel = None


async def match_prefix(stub_or_channel, token_ids: Sequence[int], tenant: str = "",
                       timeout_s: float = 0.1) -> list[WorkerMatch]:
    """Every indexed worker's match of the prompt, best first. Raises grpc.aio.AioRpcError (the caller decides
    whether to route without the index)."""
    stub = stub_or_channel
    if isinstance(stub_or_channel, grpc.aio.Channel):
        stub = kvstore_pb2_grpc.KvStoreServiceStub(stub_or_channel)
    request = kvstore_pb2.MatchPrefixRequest(token_ids=token_ids, tenant=tenant)
    response = await stub.MatchPrefix(request, timeout=timeout_s)
    return [convert.match_from_proto(m) for m in response.matches]
