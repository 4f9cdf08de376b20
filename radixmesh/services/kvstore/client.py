"""Clients of the kvstore.

- `KvStoreStorage`: the engine's PageStorage over the network (a synchronous channel: the engine calls it from its
  own storage thread). Every call is bounded by options.timeout_s; any gRPC error becomes StorageError.
  `register_kvstore_backend()` makes it `open_storage("kvstore", options)` (options.url = host:port).
  `KvStoreTransferStorage` (options.transport "mooncake") moves the page bytes with the Mooncake transfer engine,
  straight from and into the host pool (`services.kvstore.transfer` says how that stays safe).
- `WorkerRegistration`: a worker's task that calls RegisterWorker every few seconds, so the kvstore follows its KV
  events (again after a kvstore restart).
- `match_prefix()`: MatchPrefix for routers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Callable, Sequence

import grpc

from radixmesh.engine.cache.storage import (KvLayout, StorageError, StorageOptions, StoredPage,
                                            register_storage_backend)
from radixmesh.v1 import kvstore_pb2, kvstore_pb2_grpc
from radixmesh.services.common import tracing
from radixmesh.services.common.auth_channel import aio_channel, sync_channel
from radixmesh.services.common.server import CHANNEL_OPTIONS, RECONNECT_OPTIONS
from radixmesh.services.kvstore import convert
from radixmesh.services.kvstore.index import WorkerMatch
from radixmesh.services.kvstore.transfer import SLOT_BYTES

log = logging.getLogger(__name__)

# Pages per request are bounded well under the 256 MiB message limit.
REQUEST_BYTES = SLOT_BYTES


def byte_chunks(pages: list[StoredPage], budget: int):
    """Consecutive runs of `pages` of at most `budget` bytes of data each (a larger page goes alone)."""
    start = 0
    while start < len(pages):
        end, size = start, 0
        while end < len(pages) and (end == start or size + len(pages[end].data) <= budget):
            size += len(pages[end].data)
            end += 1
        yield pages[start:end]
        start = end


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
        self._channel = sync_channel(self.url, CHANNEL_OPTIONS + RECONNECT_OPTIONS)
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
        stored = 0
        for chunk in byte_chunks(pages, REQUEST_BYTES):
            request = kvstore_pb2.BatchSetRequest(layout=self._layout, pages=convert.pages_to_proto(chunk))
            stored += self._call("BatchSet", request).stored
        return stored

    def clear(self) -> int:
        return self._call("Clear", kvstore_pb2.ClearRequest()).removed

    def stats(self) -> dict:
        return convert.stats_from_proto(self._call("GetStats", kvstore_pb2.GetStatsRequest()))

    def close(self) -> None:
        self._channel.close()


class KvStoreTransferStorage(KvStoreStorage):
    """KvStoreStorage whose page bytes travel by the Mooncake transfer engine (the store must run with
    --enable-mooncake-transfer): the store reads pages to set from this process's memory, and this process reads
    the pages it gets from the store's staging slots, then releases them. Pages given or wanted as bytes pass
    through a registered staging buffer; once the engine registered the host pool (`register_host`), pages move
    straight from and into it (`set_from`, `get_into`)."""

    def __init__(self, options: StorageOptions):
        super().__init__(options)
        from radixmesh.services.kvstore.transfer import PageTransport, route_host

        host = options.transfer_host or route_host(self.url)
        try:
            self._transport = PageTransport(host)
        except RuntimeError as e:
            self.close()
            raise StorageError(f"kvstore {self.url}: cannot start the transfer engine on {host}: {e}") from e

    def register_host(self, ptr: int, nbytes: int) -> None:
        try:
            self._transport.register_host(ptr, nbytes)
        except RuntimeError as e:
            raise StorageError(f"cannot register the host pool with the transfer engine: {e}") from e

    def _pages_per_call(self, page_bytes: int) -> int:
        return max(SLOT_BYTES // page_bytes, 1)

    def set_from(self, keys: list[bytes], checksums: list[int], addresses: list[int], page_bytes: int) -> int:
        stored, step = 0, self._pages_per_call(page_bytes)
        for at in range(0, len(keys), step):
            stored += self._set_call(keys[at:at + step], checksums[at:at + step], addresses[at:at + step],
                                     [page_bytes] * len(keys[at:at + step]))
        return stored

    def _set_call(self, keys, checksums, addresses, lengths) -> int:
        pages = [kvstore_pb2.KvPage(key=k, checksum=c, length=n) for k, c, n in zip(keys, checksums, lengths)]
        transfer = kvstore_pb2.TransferPages(session_id=self._transport.session_id, addresses=addresses)
        return self._call("BatchSet", kvstore_pb2.BatchSetRequest(layout=self._layout, pages=pages,
                                                                  transfer=transfer)).stored

    def set(self, pages: list[StoredPage]) -> int:
        """Through the staging buffer, SLOT_BYTES at a time."""
        stored = 0
        for chunk in byte_chunks(pages, SLOT_BYTES):
            with self._transport.staging_lock:
                addresses = self._transport.put_staging(chunk)
                stored += self._set_call([p.key for p in chunk], [p.checksum for p in chunk], addresses,
                                         [len(p.data) for p in chunk])
        return stored

    def _get_staged(self, keys: list[bytes], local: Callable[[int, int], int]) -> list[tuple[bytes, int, int, int]]:
        """One BatchGet with the transfer engine: the store stages the pages, this process reads page i into
        local(i, length), then releases the lease. Returns (key, checksum, local address, length) per page read."""
        response = self._call("BatchGet", kvstore_pb2.BatchGetRequest(layout=self._layout, keys=keys,
                                                                      transfer_engine=True))
        if not response.pages:
            return []
        try:
            staged, lengths = response.staged, {p.length for p in response.pages}
            if len(staged.addresses) != len(response.pages) or len(lengths) != 1:
                raise StorageError(f"kvstore {self.url} BatchGet: {len(staged.addresses)} staged addresses for "
                                   f"{len(response.pages)} pages of lengths {sorted(lengths)}")
            (length,) = lengths
            targets = [local(i, length) for i in range(len(response.pages))]
            self._transport.read(staged.session_id, list(staged.addresses), targets, length)
            return [(p.key, p.checksum, t, length) for p, t in zip(response.pages, targets)]
        finally:
            try:
                self._call("ReleaseStaged", kvstore_pb2.ReleaseStagedRequest(lease_id=response.lease_id))
            except StorageError as e:  # the lease expires on its own
                log.warning("%s", e)

    def get_into(self, keys: list[bytes], addresses: list[int], page_bytes: int) -> list[int]:
        def local(i: int, length: int, base: int = 0) -> int:
            if length != page_bytes:
                raise StorageError(f"kvstore {self.url} staged pages of {length} bytes; expected {page_bytes}")
            return addresses[base + i]

        checksums: list[int] = []
        step = self._pages_per_call(page_bytes)
        for at in range(0, len(keys), step):
            chunk = keys[at:at + step]
            got = self._get_staged(chunk, functools.partial(local, base=at))
            checksums.extend(crc for _, crc, _, _ in got)
            if len(got) < len(chunk):
                break
        return checksums

    def get(self, keys: list[bytes]) -> list[StoredPage]:
        """Through the staging buffer, SLOT_BYTES at a time."""
        base = self._transport.staging_base

        def local(i: int, length: int) -> int:
            if (i + 1) * length > SLOT_BYTES:
                raise StorageError(f"kvstore {self.url} staged more than {SLOT_BYTES} bytes in one call")
            return base + i * length

        out: list[StoredPage] = []
        step = self._pages_per_call(self._page_bytes) if self._page_bytes else max(len(keys), 1)
        for start in range(0, len(keys), step):
            chunk = keys[start:start + step]
            with self._transport.staging_lock:
                got = self._get_staged(chunk, local)
                out.extend(StoredPage(k, self._transport.staged_bytes(a, n), crc) for k, crc, a, n in got)
            if len(got) < len(chunk):
                break
        return out

    def close(self) -> None:
        super().close()
        transport = getattr(self, "_transport", None)
        if transport is not None:
            transport.close()


def open_kvstore(options: StorageOptions) -> KvStoreStorage:
    if options.transport == "mooncake":
        return KvStoreTransferStorage(options)
    return KvStoreStorage(options)


def register_kvstore_backend() -> None:
    """`open_storage("kvstore", StorageOptions(url="host:port", layout=..., timeout_s=..., transport=...))` opens a
    KvStoreStorage (or, with transport "mooncake", a KvStoreTransferStorage)."""
    register_storage_backend("kvstore", open_kvstore)


def async_channel(url: str) -> grpc.aio.Channel:
    """A channel to the kvstore with the large-message options, a short reconnect backoff and this process's
    internal credentials."""
    return aio_channel(_target(url), CHANNEL_OPTIONS + RECONNECT_OPTIONS)


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
    with tracing.span("kvstore MatchPrefix", "client", prompt_tokens=len(token_ids)):
        response = await stub.MatchPrefix(request, timeout=timeout_s)
    return [convert.match_from_proto(m) for m in response.matches]
