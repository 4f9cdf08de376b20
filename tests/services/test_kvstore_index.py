"""The kvstore's global prefix index, against a real kvstore process. A small in-process WorkerService stands in
for a worker's KV event stream (a snapshot of its pages, then stored / removed / cleared events); RegisterWorker
makes the kvstore subscribe to it, and MatchPrefix must count device, host and storage tokens per worker and
tenant, follow removals and clears, drop a worker whose stream breaks, and rebuild after a kvstore restart."""

from __future__ import annotations

import asyncio
import time
from typing import Sequence

import grpc
import pytest

from radixmesh.engine.cache.page_keys import namespace_root, prompt_keys
from radixmesh.engine.cache.storage import KvLayout, StorageOptions, make_page
from radixmesh.v1 import kvstore_pb2 as pb
from radixmesh.v1 import worker_pb2, worker_pb2_grpc
from radixmesh.services.kvstore import convert
from radixmesh.services.kvstore.client import KvStoreStorage, WorkerRegistration, async_channel, match_prefix
from radixmesh.services.kvstore.index import WorkerMatch
from tests.redis_fixture import redis_server  # noqa: F401 - a fixture
from tests.services.test_kvstore_service import KvStoreProcess

pytestmark = pytest.mark.timeout(60)

LAYOUT_A = KvLayout("tiny", page_size=4, dtype="float16", num_layers=2, num_kv_heads=2, head_dim=8)
LAYOUT_B = KvLayout("tiny", page_size=8, dtype="float16", num_layers=2, num_kv_heads=2, head_dim=8)
TOKENS = list(range(100, 140))  # 10 pages of LAYOUT_A, 5 of LAYOUT_B
DEVICE, HOST = worker_pb2.KV_TIER_DEVICE, worker_pb2.KV_TIER_HOST
FLAGS = ["--backend", "memory", "--worker-ttl-s", "1", "--subscribe-backoff-max-s", "0.3"]


class FakeWorkerEvents(worker_pb2_grpc.WorkerServiceServicer):
    """A worker's prefix cache as far as its KV events go: per tier, the page keys it holds. A new subscriber gets
    a snapshot (stored events), then every change; `refuse` makes new subscriptions fail (a worker going away)."""

    def __init__(self, layout: KvLayout):
        self.layout = layout
        self.tiers: dict[int, dict[bytes, list[int]]] = {DEVICE: {}, HOST: {}}  # key -> the page's tokens
        self.sequence = 0
        self.streams: list[asyncio.Queue] = []
        self.refuse = False
        self.server: grpc.aio.Server | None = None
        self.url = ""

    async def start(self) -> None:
        self.server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(self, self.server)
        self.url = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(0)

    def _event(self, **body) -> worker_pb2.SubscribeKvEventsResponse:
        self.sequence += 1
        return worker_pb2.SubscribeKvEventsResponse(sequence=self.sequence, **body)

    def _publish(self, event) -> None:
        for queue in self.streams:
            queue.put_nowait(event)

    def store(self, tokens: Sequence[int], tier: int, tenant: str = "", first: int = 0, last: int | None = None):
        """Pages first..last-1 of `tokens` (under `tenant`) enter `tier`."""
        size = self.layout.page_size
        keys = prompt_keys(self.layout, tenant, tokens)[first:last]
        parent = prompt_keys(self.layout, tenant, tokens)[first - 1] if first else namespace_root(self.layout, tenant)
        page_tokens = list(tokens[first * size:(first + len(keys)) * size])
        for i, key in enumerate(keys):
            self.tiers[tier][key] = page_tokens[i * size:(i + 1) * size]
        self._publish(self._event(stored=worker_pb2.KvPagesStored(
            page_hashes=keys, parent_hash=parent, token_ids=page_tokens, page_size=size, tier=tier)))
        return keys

    def remove(self, keys: Sequence[bytes], tier: int) -> None:
        for key in keys:
            self.tiers[tier].pop(key, None)
        self._publish(self._event(removed=worker_pb2.KvPagesRemoved(page_hashes=keys, tier=tier)))

    def clear(self) -> None:
        self.tiers = {DEVICE: {}, HOST: {}}
        self._publish(self._event(cleared=worker_pb2.KvCacheCleared()))

    def end_streams(self, refuse: bool) -> None:
        self.refuse = refuse
        self._publish(None)

    async def SubscribeKvEvents(self, request, context):
        if self.refuse:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "shutting down")
        assert request.after_sequence == 0
        queue: asyncio.Queue = asyncio.Queue()
        # the snapshot as a worker sends it: `cleared`, then one stored event per tier, all at the current sequence
        at = self.sequence
        queue.put_nowait(worker_pb2.SubscribeKvEventsResponse(sequence=at, cleared=worker_pb2.KvCacheCleared()))
        for tier, pages in self.tiers.items():
            if pages:
                queue.put_nowait(worker_pb2.SubscribeKvEventsResponse(sequence=at, stored=worker_pb2.KvPagesStored(
                    page_hashes=list(pages), token_ids=[t for p in pages.values() for t in p],
                    page_size=self.layout.page_size, tier=tier)))
        self.streams.append(queue)
        try:
            while (event := await queue.get()) is not None:
                yield event
        finally:
            self.streams.remove(queue)


async def start_kvstore(tmp_path, *flags: str) -> KvStoreProcess:
    kv = KvStoreProcess(tmp_path, [*FLAGS, *flags])
    await asyncio.to_thread(kv.start)
    return kv


async def register(channel, worker: FakeWorkerEvents, uses_storage: bool) -> bool:
    from radixmesh.v1 import kvstore_pb2_grpc

    request = pb.RegisterWorkerRequest(worker_url=worker.url, layout=convert.layout_to_proto(worker.layout),
                                       uses_storage=uses_storage)
    return (await kvstore_pb2_grpc.KvStoreServiceStub(channel).RegisterWorker(request, timeout=2)).subscribed


async def until(channel, expected: list[WorkerMatch], tenant: str = "", tokens=TOKENS, timeout_s: float = 10.0):
    """Polls MatchPrefix until it answers `expected` (events reach the index asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = await match_prefix(channel, tokens, tenant, timeout_s=2.0)
        except grpc.aio.AioRpcError as e:  # a restarted kvstore: the channel reconnects within its backoff
            got = e.code()
        if got == expected:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"MatchPrefix answered {got}, expected {expected}")
        await asyncio.sleep(0.02)


async def stats(channel) -> pb.GetStatsResponse:
    from radixmesh.v1 import kvstore_pb2_grpc

    return await kvstore_pb2_grpc.KvStoreServiceStub(channel).GetStats(pb.GetStatsRequest(), timeout=2)


def store_pages(kv: KvStoreProcess, layout: KvLayout, tenant: str, pages: range) -> None:
    store = KvStoreStorage(StorageOptions(url=kv.url, timeout_s=2.0, layout=layout))
    keys = prompt_keys(layout, tenant, TOKENS)
    assert store.set([make_page(keys[i], bytes([i]) * layout.page_bytes) for i in pages]) == len(pages)
    store.close()


async def test_match_prefix_counts_tiers_and_storage_per_worker_and_tenant(tmp_path):
    kv = await start_kvstore(tmp_path)
    a, b = FakeWorkerEvents(LAYOUT_A), FakeWorkerEvents(LAYOUT_B)
    await a.start()
    await b.start()
    a.store(TOKENS, DEVICE, last=4)  # device: pages 0-3; host: pages 2-6 (2 and 3 are in both)
    a.store(TOKENS, HOST, first=2, last=7)
    b.store(TOKENS, DEVICE, last=2)
    b.store(TOKENS, DEVICE, tenant="t2", last=5)
    await asyncio.to_thread(store_pages, kv, LAYOUT_A, "", range(0, 9))  # the store: pages 0-8 of LAYOUT_A
    channel = async_channel(kv.url)
    try:
        assert await register(channel, a, uses_storage=True) is True
        assert await register(channel, b, uses_storage=False) is True
        assert await register(channel, a, uses_storage=True) is False  # already subscribed
        # a: 4 device pages (16 tokens), then 3 host pages (4-6), then the store's pages 7-8; b: 2 pages of 8 tokens
        await until(channel, [WorkerMatch(a.url, 16, 12, 8), WorkerMatch(b.url, 16, 0, 0)])
        # tenant t2: only b's t2 pages; a's pages and the store's (tenant "") never match
        await until(channel, [WorkerMatch(b.url, 40, 0, 0), WorkerMatch(a.url, 0, 0, 0)], tenant="t2")
        # a shorter prompt: only full pages count (9 tokens = 2 pages of a, 1 of b)
        tied = sorted([WorkerMatch(a.url, 8, 0, 0), WorkerMatch(b.url, 8, 0, 0)])  # ties: by url
        await until(channel, tied, tokens=TOKENS[:9])
        # a change after the snapshot: a's page 7 enters host, so the store counts from page 8
        a.store(TOKENS, HOST, first=7, last=8)
        await until(channel, [WorkerMatch(a.url, 16, 16, 4), WorkerMatch(b.url, 16, 0, 0)])
        response = await stats(channel)
        assert response.indexed_workers == 2 and response.indexed_pages == (4 + 6) + (2 + 5)
    finally:
        await channel.close()
        await a.stop()
        await b.stop()
        kv.kill()


async def test_removed_and_cleared_events_and_a_broken_stream(tmp_path):
    kv = await start_kvstore(tmp_path)
    a = FakeWorkerEvents(LAYOUT_A)
    await a.start()
    await asyncio.to_thread(store_pages, kv, LAYOUT_A, "", range(0, 9))
    channel = async_channel(kv.url)
    try:
        await register(channel, a, uses_storage=True)
        device = a.store(TOKENS, DEVICE, last=4)
        a.store(TOKENS, HOST, first=2, last=7)
        await until(channel, [WorkerMatch(a.url, 16, 12, 8)])
        a.remove(device[2:], DEVICE)  # demoted pages 2-3 stay on host: device 0-1, host 2-6
        await until(channel, [WorkerMatch(a.url, 8, 20, 8)])
        a.remove(device[:1], DEVICE)  # page 0 gone everywhere: nothing matches from the worker; the store has 0-8
        await until(channel, [WorkerMatch(a.url, 0, 0, 36)])
        a.store(TOKENS, DEVICE, last=2)
        await until(channel, [WorkerMatch(a.url, 8, 20, 8)])
        a.clear()
        await until(channel, [WorkerMatch(a.url, 0, 0, 36)])
        assert (await stats(channel)).indexed_pages == 0
        a.store(TOKENS, DEVICE, last=3)
        await until(channel, [WorkerMatch(a.url, 12, 0, 24)])

        a.end_streams(refuse=True)  # the worker goes away: its stream ends, new ones fail
        await until(channel, [])
        assert (await stats(channel)).indexed_workers == 0
        a.refuse = False  # back: it re-registers and the kvstore takes a fresh snapshot
        await register(channel, a, uses_storage=True)
        await until(channel, [WorkerMatch(a.url, 12, 0, 24)])

        await a.stop()  # a worker that dies and does not re-register is dropped, then forgotten after its ttl
        await until(channel, [])
        deadline = time.monotonic() + 5
        while f"forgetting worker {a.url}" not in kv.output():
            assert time.monotonic() < deadline, kv.output()
            await asyncio.sleep(0.05)
    finally:
        await channel.close()
        await a.stop()
        kv.kill()


async def test_the_index_is_rebuilt_after_a_kvstore_restart(tmp_path):
    kv = await start_kvstore(tmp_path)
    a = FakeWorkerEvents(LAYOUT_A)
    await a.start()
    a.store(TOKENS, DEVICE, last=5)
    a.store(TOKENS, DEVICE, tenant="t2", last=2)
    registration = WorkerRegistration(kv.url, a.url, LAYOUT_A, uses_storage=False, interval_s=0.2)
    registration.start()
    channel = async_channel(kv.url)
    try:
        await until(channel, [WorkerMatch(a.url, 20, 0, 0)])
        kv.kill()
        await asyncio.sleep(0.3)  # the registration fails meanwhile (logged, not raised)
        assert not registration._task.done()
        await asyncio.to_thread(kv.start)  # same port, empty index
        a.store(TOKENS, HOST, first=5, last=6)
        await until(channel, [WorkerMatch(a.url, 20, 4, 0)])
        await until(channel, [WorkerMatch(a.url, 8, 0, 0)], tenant="t2")
        assert kv.starts == 2 and registration.registered >= 2
        assert "sequence went" not in kv.output()  # a snapshot's events share its sequence: no complaint
    finally:
        await registration.stop()
        await channel.close()
        await a.stop()
        kv.kill()


async def test_storage_tokens_from_redis_and_a_failing_store(tmp_path, redis_server):  # noqa: F811
    """Over the redis backend: storage tokens come from redis; while redis is down MatchPrefix still answers the
    workers' own matches (storage counts as 0), and counts again once redis is back."""
    kv = await start_kvstore(tmp_path, "--backend", "redis", "--storage-url", redis_server.url,
                             "--storage-timeout-s", "0.3")
    a = FakeWorkerEvents(LAYOUT_A)
    await a.start()
    a.store(TOKENS, DEVICE, last=2)
    channel = async_channel(kv.url)
    try:
        await asyncio.to_thread(store_pages, kv, LAYOUT_A, "", range(0, 6))
        await register(channel, a, uses_storage=True)
        await until(channel, [WorkerMatch(a.url, 8, 0, 16)])
        redis_server.stop()
        await until(channel, [WorkerMatch(a.url, 8, 0, 0)])
        redis_server.start()  # empty again
        await asyncio.to_thread(store_pages, kv, LAYOUT_A, "", range(0, 3))
        await until(channel, [WorkerMatch(a.url, 8, 0, 4)])
    finally:
        await channel.close()
        await a.stop()
        kv.kill()
