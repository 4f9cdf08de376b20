"""Per registered worker, a task that follows its KV events (WorkerService.SubscribeKvEvents, from a snapshot:
after_sequence=0) into the prefix index.

The worker is in the index while its stream is open. When the stream breaks or ends, the worker leaves the index
and the task opens a new stream after a bounded, growing backoff (a RegisterWorker meanwhile retries at once). A
worker that has not re-registered for worker_ttl_s by then is forgotten. Workers re-register every few seconds, so
after a kvstore restart the index is rebuilt from their snapshots.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from radixmesh.engine.cache.storage import KvLayout
from radixmesh.v1 import worker_pb2, worker_pb2_grpc
from radixmesh.services.common.server import channel
from radixmesh.services.kvstore import convert
from radixmesh.services.kvstore.index import IndexedWorker, PrefixIndex

log = logging.getLogger(__name__)

INITIAL_BACKOFF_S = 0.2


@dataclass(slots=True)
class Subscription:
    url: str
    layout: KvLayout
    uses_storage: bool
    last_registered: float
    connected: bool = False  # a stream is open (or opening)
    events: int = 0  # events applied from the current stream
    last_sequence: int = 0
    snapshot_sequence: int = -1  # the sequence of the current stream's snapshot
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


class Subscriptions:
    """Used from the event loop only."""

    def __init__(self, index: PrefixIndex, worker_ttl_s: float = 15.0, backoff_max_s: float = 5.0):
        self.index = index
        self.worker_ttl_s = worker_ttl_s
        self.backoff_max_s = backoff_max_s
        self._subs: dict[str, Subscription] = {}

    def register(self, url: str, layout: KvLayout, uses_storage: bool) -> bool:
        """Follow `url`'s events; False when its stream is already open with the same layout."""
        sub = self._subs.get(url)
        now = time.monotonic()
        if sub is not None and sub.layout == layout and sub.uses_storage == uses_storage:
            sub.last_registered = now
            if sub.connected:
                return False
            sub.wake.set()  # waiting out a backoff: try now
            return True
        if sub is not None:
            log.info("worker %s re-registered with a different layout or storage use; re-subscribing", url)
            sub.task.cancel()
        sub = Subscription(url, layout, uses_storage, now)
        sub.task = asyncio.get_running_loop().create_task(self._run(sub), name=f"kv-events {url}")
        self._subs[url] = sub
        log.info("subscribing to KV events of worker %s (%s, uses storage: %s)", url, layout.tag().decode(),
                 uses_storage)
        return True

    def subscribed(self) -> list[str]:
        return sorted(self._subs)

    async def _run(self, sub: Subscription) -> None:
        delay = INITIAL_BACKOFF_S
        try:
            while True:
                reason = await self._follow(sub)
                if sub.events:
                    delay = INITIAL_BACKOFF_S
                if time.monotonic() - sub.last_registered > self.worker_ttl_s:
                    log.info("forgetting worker %s: %s, and it has not re-registered for %.0f s", sub.url, reason,
                             self.worker_ttl_s)
                    return
                log.warning("worker %s left the prefix index: %s; re-subscribing in %.1f s", sub.url, reason, delay)
                sub.wake.clear()
                try:
                    await asyncio.wait_for(sub.wake.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                delay = min(delay * 2, self.backoff_max_s)
        finally:
            if self._subs.get(sub.url) is sub:
                del self._subs[sub.url]

    async def _follow(self, sub: Subscription) -> str:
        """One stream: the worker is in the index from the stream's first answer (its headers, at the latest with the
        snapshot's first event) until it ends. Returns why it ended."""
        sub.connected, sub.events, sub.last_sequence, sub.snapshot_sequence = True, 0, 0, -1
        entry = None
        try:
            async with channel(sub.url) as ch:
                call = worker_pb2_grpc.WorkerServiceStub(ch).SubscribeKvEvents(
                    worker_pb2.SubscribeKvEventsRequest(after_sequence=0))
                await call.initial_metadata()  # the worker answered: from now on its events are the truth
                entry = self.index.add(sub.url, sub.layout, sub.uses_storage)
                async for event in call:
                    self._apply(sub, entry, event)
            return "its event stream ended"
        except grpc.aio.AioRpcError as e:
            return f"its event stream failed ({e.code().name}: {e.details()})"
        except Exception as e:  # noqa: BLE001 - a bad event must not end the subscription for good
            log.exception("worker %s: cannot apply a KV event", sub.url)
            return f"a KV event could not be applied ({type(e).__name__}: {e})"
        finally:
            sub.connected = False
            if entry is not None:
                self.index.drop(entry)

    def _apply(self, sub: Subscription, entry: IndexedWorker, event: worker_pb2.SubscribeKvEventsResponse) -> None:
        kind = event.WhichOneof("event")
        # A snapshot is a `cleared` event and the cache's pages, all at the sequence the snapshot was taken at;
        # live events after it count up from there.
        snapshot = kind == "cleared" or event.sequence == sub.snapshot_sequence
        if sub.last_sequence and (event.sequence < sub.last_sequence or
                                  (event.sequence == sub.last_sequence and not snapshot)):
            log.warning("worker %s: KV event sequence went from %d to %d", sub.url, sub.last_sequence, event.sequence)
        if kind == "cleared":
            sub.snapshot_sequence = event.sequence
        sub.last_sequence = event.sequence
        sub.events += 1
        if kind == "cleared":
            entry.clear()
            return
        if kind not in ("stored", "removed"):
            return
        body = getattr(event, kind)
        tier = convert.tier_from_proto(body.tier)
        if tier is None:
            log.warning("worker %s: a %s event without a tier (%d); ignored", sub.url, kind, body.tier)
            return
        if kind == "stored":
            if body.page_size and body.page_size != entry.layout.page_size:
                log.warning("worker %s: stored pages of size %d, registered with page size %d; ignored", sub.url,
                            body.page_size, entry.layout.page_size)
                return
            entry.store(body.page_hashes, tier)
        else:
            entry.remove(body.page_hashes, tier)

    async def close(self) -> None:
        tasks = [s.task for s in self._subs.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._subs.clear()
