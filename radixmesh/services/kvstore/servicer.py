"""radixmesh.v1.KvStoreService over one PageStorage and the prefix index.

Backend calls block, so they run on a thread pool, never on the event loop. Bad input is a ValueError (the shared
interceptor answers INVALID_ARGUMENT with the message); a backend's StorageError answers UNAVAILABLE with its reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor

import grpc

from radixmesh.engine.cache.storage import PageStorage, StorageError, StoredPage
from radixmesh.v1 import kvstore_pb2, kvstore_pb2_grpc
from radixmesh.services.common.errors import Unavailable
from radixmesh.services.common.server import MAX_MESSAGE_BYTES
from radixmesh.services.kvstore import convert
from radixmesh.services.kvstore.index import PrefixIndex, finish, prompt_keys_by_layout
from radixmesh.services.kvstore.subscriber import Subscriptions
from radixmesh.services.kvstore.transfer import SLOT_BYTES, StagingSlots

SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KvStoreService"].full_name
# A BatchGet answer stops before this many bytes of page data (a shorter prefix is a valid answer), under the
# 256 MiB message limit.
RESPONSE_BYTES = MAX_MESSAGE_BYTES - (16 << 20)
LOG_EVERY_S = 10.0  # at most one warning per this many seconds about a failing store in MatchPrefix

log = logging.getLogger(__name__)


class KvStoreServicer(kvstore_pb2_grpc.KvStoreServiceServicer):
    def __init__(self, storage: PageStorage, backend: str, index: PrefixIndex, subscriptions: Subscriptions,
                 executor: Executor, staging: StagingSlots | None = None, timeout_s: float = 2.0):
        self.storage = storage
        self.backend = backend
        self.index = index
        self.subscriptions = subscriptions
        self.executor = executor
        self.staging = staging  # the transfer engine's slots (None: page bytes travel over gRPC only)
        self.timeout_s = timeout_s  # the longest a transfer-engine call waits for a free slot
        self._last_storage_warning = float("-inf")

    def _staging(self) -> StagingSlots:
        if self.staging is None:
            raise ValueError("this kvstore has no transfer engine (start it with --enable-mooncake-transfer); "
                             "send page bytes in the messages instead")
        return self.staging

    async def _run(self, fn, *args):
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        except StorageError as e:
            raise Unavailable(f"{self.backend} storage: {e}") from e

    async def BatchExists(self, request: kvstore_pb2.BatchExistsRequest,
                          context: grpc.aio.ServicerContext) -> kvstore_pb2.BatchExistsResponse:
        keys = convert.check_keys(request.keys)
        return kvstore_pb2.BatchExistsResponse(hit_prefix_len=await self._run(self.storage.exists, keys))

    async def BatchGet(self, request: kvstore_pb2.BatchGetRequest,
                       context: grpc.aio.ServicerContext) -> kvstore_pb2.BatchGetResponse:
        keys = convert.check_keys(request.keys)
        if request.transfer_engine:
            return await self._run(self._get_staged, self._staging(), keys)
        pages = await self._run(self.storage.get, keys)
        return kvstore_pb2.BatchGetResponse(pages=convert.pages_to_proto(_within(pages, RESPONSE_BYTES)))

    def _get_staged(self, staging: StagingSlots, keys: list[bytes]) -> kvstore_pb2.BatchGetResponse:
        """The pages copied into a leased slot, for the caller to read (as many as fit in a slot)."""
        pages = _within(self.storage.get(keys), SLOT_BYTES)
        if not pages:
            return kvstore_pb2.BatchGetResponse()
        slot = staging.take(self.timeout_s)
        try:
            addresses = staging.stage(slot, pages)
        except BaseException:
            staging.give_back(slot)
            raise
        return kvstore_pb2.BatchGetResponse(
            pages=convert.page_heads_to_proto(pages), lease_id=staging.lease(slot),
            staged=kvstore_pb2.TransferPages(session_id=staging.session_id, addresses=addresses))

    async def BatchSet(self, request: kvstore_pb2.BatchSetRequest,
                       context: grpc.aio.ServicerContext) -> kvstore_pb2.BatchSetResponse:
        """Pages whose data does not match their checksum, or that the backend could not keep, count as rejected."""
        layout = convert.request_layout(request)
        if request.HasField("transfer"):
            staging = self._staging()
            moved = convert.transferred_pages_from_proto(request, layout, SLOT_BYTES)
            stored = await self._run(self._set_transferred, staging, moved) if moved.keys else 0
            return kvstore_pb2.BatchSetResponse(stored=stored, rejected=len(moved.keys) - stored)
        pages = convert.pages_from_proto(request.pages, layout)
        stored = await self._run(self.storage.set, pages) if pages else 0
        return kvstore_pb2.BatchSetResponse(stored=stored, rejected=len(pages) - stored)

    def _set_transferred(self, staging: StagingSlots, moved: convert.TransferredPages) -> int:
        """Read the pages from the caller's memory, then store them (the backend refuses any whose bytes changed
        under the read: they fail their checksum)."""
        slot = staging.take(self.timeout_s)
        try:
            data = staging.fetch(slot, moved.session_id, moved.addresses, moved.lengths)
        finally:
            staging.give_back(slot)
        return self.storage.set([StoredPage(k, d, c) for k, d, c in zip(moved.keys, data, moved.checksums)])

    async def ReleaseStaged(self, request: kvstore_pb2.ReleaseStagedRequest,
                            context: grpc.aio.ServicerContext) -> kvstore_pb2.ReleaseStagedResponse:
        return kvstore_pb2.ReleaseStagedResponse(released=self._staging().release(request.lease_id))

    async def MatchPrefix(self, request: kvstore_pb2.MatchPrefixRequest,
                          context: grpc.aio.ServicerContext) -> kvstore_pb2.MatchPrefixResponse:
        tokens = list(request.token_ids)
        # hashing runs on the loop's default pool: a hung backend that holds every storage thread must not stall it
        keys = await asyncio.get_running_loop().run_in_executor(
            None, prompt_keys_by_layout, self.index.layouts(), request.tenant, tokens)
        partials = self.index.partial_matches(keys, tokens, request.tenant)
        stored = await self._stored_pages([p.rest for p in partials])
        return kvstore_pb2.MatchPrefixResponse(matches=[convert.match_to_proto(m) for m in finish(partials, stored)])

    async def _stored_pages(self, rests: list) -> list[int]:
        """Per run of keys, how many from its first the store holds (one backend call per distinct run: a run is
        named by its first key, which covers every page before it, and its length). A failing store counts as
        holding nothing, so the workers' own matches still come back."""
        distinct = {(r[0], len(r)): r for r in rests if len(r)}
        try:
            found = await asyncio.gather(*(self._run(self.storage.exists, list(r)) for r in distinct.values()))
        except Unavailable as e:
            now = time.monotonic()
            if now - self._last_storage_warning >= LOG_EVERY_S:
                log.warning("MatchPrefix without storage tokens: %s", e)
                self._last_storage_warning = now
            return [0] * len(rests)
        by_run = dict(zip(distinct, found))
        return [by_run[(r[0], len(r))] if len(r) else 0 for r in rests]

    async def RegisterWorker(self, request: kvstore_pb2.RegisterWorkerRequest,
                             context: grpc.aio.ServicerContext) -> kvstore_pb2.RegisterWorkerResponse:
        if not request.worker_url:
            raise ValueError("worker_url is required")
        if not request.HasField("layout"):
            raise ValueError("layout is required (the worker's KV layout: its page keys depend on it)")
        layout = convert.layout_from_proto(request.layout)
        subscribed = self.subscriptions.register(request.worker_url, layout, request.uses_storage)
        return kvstore_pb2.RegisterWorkerResponse(subscribed=subscribed)

    async def GetStats(self, request: kvstore_pb2.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> kvstore_pb2.GetStatsResponse:
        stats = await self._run(self.storage.stats)
        staging = self.staging
        return convert.stats_to_proto(self.backend, stats, len(self.index.workers), self.index.page_count(),
                                      staging.session_id if staging else "", staging.stats if staging else None)

    async def Clear(self, request: kvstore_pb2.ClearRequest,
                    context: grpc.aio.ServicerContext) -> kvstore_pb2.ClearResponse:
        return kvstore_pb2.ClearResponse(removed=await self._run(self.storage.clear))


def _within(pages: list, budget: int) -> list:
    """The leading pages whose data fits `budget` bytes."""
    total = 0
    for i, page in enumerate(pages):
        total += len(page.data)
        if total > budget:
            return pages[:i]
    return pages


def add_to_server(servicer: KvStoreServicer, server: grpc.aio.Server) -> list[str]:
    """Register `servicer` on `server`; returns the full service names (for health and reflection)."""
    kvstore_pb2_grpc.add_KvStoreServiceServicer_to_server(servicer, server)
    return [SERVICE_NAME]
