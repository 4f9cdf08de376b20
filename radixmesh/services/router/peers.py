"""One router process among several (--router-workers N; services/router/supervisor.py runs them): the link to the
supervisor's hub, a Unix socket carrying newline-delimited JSON.

What this process changes, it announces; what its siblings announce, it applies without announcing again:
- the worker registry: workers added (POST /add_worker, DNS discovery), removed, their leases renewed;
- health: only process 0 probes the workers; it, and any process whose request found a worker failing, announce
  each transition (and a worker lost with its open requests), so every process routes on the same view;
- cache-aware routes: every pick's (worker, prefix blocks), sent in batches every few milliseconds, so each
  process's approximate trees hold what all of them sent where and the hit rate does not fall as N grows;
- metrics: GET /metrics on any process answers for all of them (each sample labelled router_process);
- run-time LoRA changes: made one at a time across the processes, applied by every process before they are answered
  (services/router/lora_peers.py).
A process the supervisor starts again gets the registry, health and run-time LoRA changes from the hub; its trees
fill from its siblings' routes from then on. When the hub goes away (the supervisor died), the process shuts down
gracefully."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
from collections import defaultdict
from typing import Any

import orjson

from radixmesh.services.router.lora_peers import LoraPeer

log = logging.getLogger(__name__)
HUB_ENV = "RADIXMESH_ROUTER_HUB"  # the hub's socket path: set for the supervisor's children
INDEX_ENV = "RADIXMESH_ROUTER_INDEX"  # this process's index, 0..N-1
COUNT_ENV = "RADIXMESH_ROUTER_PROCESSES"  # N
LINE_LIMIT = 64 * 1024 * 1024
ROUTE_FLUSH_S = 0.005
SCRAPE_TIMEOUT_S = 5.0


def from_env() -> tuple[str, int, int] | None:
    """(hub path, index, process count) when this process is one of the supervisor's, else None."""
    path = os.environ.get(HUB_ENV)
    if not path:
        return None
    return path, int(os.environ.get(INDEX_ENV, "0")), int(os.environ.get(COUNT_ENV, "1"))


class Peers:
    def __init__(self, router, path: str, index: int):
        self.router, self.path, self.index = router, path, index
        self.metrics = None  # ServiceMetrics, set by the caller when metrics are on
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._routes: dict[str, list] = defaultdict(list)  # role -> [[url, keys], ...] not sent yet
        self._flush: asyncio.TimerHandle | None = None
        self._ids = itertools.count()
        self._scrapes: dict[int, asyncio.Future] = {}
        self.lora = LoraPeer(self._send, router)  # run-time LoRA changes (services/router/lora_fanout.py)
        router.lora.sync.peers = self.lora  # resyncs of (re)joining workers take the same turn as changes
        self.closing = False

    async def connect(self, timeout_s: float = 30.0) -> None:
        """Joins the hub and applies its snapshot (the workers the others added, their leases and health, the
        run-time LoRA changes) before returning, so this process serves with the same registry as its siblings."""
        reader, self._writer = await asyncio.open_unix_connection(self.path, limit=LINE_LIMIT)
        self._snapshot_done = asyncio.get_running_loop().create_future()
        self._reader_task = asyncio.create_task(self._read(reader))
        self._send({"op": "hello", "index": self.index, "pid": os.getpid()})
        await asyncio.wait_for(self._snapshot_done, timeout_s)
        registry = self.router.registry
        registry.on_change = self._announce
        for role, policy in self.router.role_policies.items():  # a policy serving several roles: its first role
            if hasattr(policy, "learn") and policy.on_insert is None:
                policy.on_insert = lambda url, keys, role=role: self._route(role, url, keys)

    def ready(self) -> None:
        """Tells the supervisor this process serves (sent once its ports are open)."""
        self._send({"op": "ready", "index": self.index, "pid": os.getpid()})

    def _send(self, msg: dict[str, Any]) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(orjson.dumps(msg) + b"\n")

    def _announce(self, op: str, url: str, **details) -> None:
        self._send({"op": op, "url": url, **details})

    def _route(self, role: str, url: str, keys: list[int]) -> None:
        self._routes[role].append([url, keys])
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(ROUTE_FLUSH_S, self._send_routes)

    def _send_routes(self) -> None:
        self._flush = None
        routes, self._routes = self._routes, defaultdict(list)
        for role, batch in routes.items():
            self._send({"op": "route", "role": role, "routes": batch})

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _add(self, url: str, lease_s: float | None = None, has_lease: bool = False) -> None:
        try:
            await self.router.registry.add(url, quiet=True)
        except ValueError as e:
            log.warning("a sibling router added %s, but this process cannot reach it: %s", url, e)
            return
        if has_lease:
            self.router.registry.lease(url, lease_s, quiet=True)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while line := await reader.readline():
                try:
                    self._apply(orjson.loads(line))
                except Exception:  # noqa: BLE001 - one bad message must not end the link
                    log.exception("bad message from the router hub: %.200r", line)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        if not self.closing:
            log.error("the router supervisor's hub went away; shutting this router process down")
            os.kill(os.getpid(), signal.SIGTERM)

    def _apply(self, msg: dict[str, Any]) -> None:
        op, registry = msg["op"], self.router.registry
        worker = registry.workers.get(msg.get("url", ""))
        if op == "route":
            policy = self.router.role_policies.get(msg["role"])
            if policy is not None and hasattr(policy, "learn"):
                for url, keys in msg["routes"]:
                    policy.learn(url, keys)
        elif op == "add":
            self._spawn(self._add(msg["url"]))
        elif op == "lease":
            registry.lease(msg["url"], msg["lease_s"], quiet=True)
        elif op == "remove":
            self._spawn(registry.remove(msg["url"], quiet=True))
        elif op == "health" and worker is not None:
            reason = f"router process {msg.get('from')}: {msg.get('reason')}"
            if msg["healthy"]:
                registry.mark_healthy(worker, reason, quiet=True)
            else:
                registry.mark_failed(worker, reason, quiet=True)
        elif op == "lost" and worker is not None:
            registry.on_lost(worker)
        elif op.startswith("lora"):
            self.lora.handle(msg)
        elif op == "snapshot":  # on (re)start: what the others added, their leases and health, the LoRA intent
            self.lora.restore(msg.get("lora"))
            self._spawn(self._apply_snapshot(msg))
        elif op == "scrape":
            self._spawn(self._answer_scrape(msg["id"]))
        elif op == "scraped_all":
            fut = self._scrapes.pop(msg["id"], None)
            if fut is not None and not fut.done():
                fut.set_result(msg["text"].encode())

    async def _apply_snapshot(self, msg: dict[str, Any]) -> None:
        try:
            await asyncio.gather(*(self._snapshot_worker(url, entry) for url, entry in msg["workers"].items()),
                                 *(self.router.registry.remove(url, quiet=True) for url in msg["removed"]))
        finally:
            if not self._snapshot_done.done():
                self._snapshot_done.set_result(None)

    async def _snapshot_worker(self, url: str, entry: dict[str, Any]) -> None:
        await self._add(url, entry.get("lease_s"), "lease_s" in entry)
        worker = self.router.registry.workers.get(url)
        if worker is not None and entry.get("healthy") is False:
            self.router.registry.mark_failed(worker, "unhealthy when this process started", quiet=True)

    async def _answer_scrape(self, scrape_id: int) -> None:
        text = (await self.metrics.exposition()).decode() if self.metrics is not None else ""
        self._send({"op": "scraped", "id": scrape_id, "index": self.index, "text": text})

    async def scrape_all(self) -> bytes:
        """Every router process's metrics, merged by the hub (each sample labelled router_process)."""
        scrape_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._scrapes[scrape_id] = fut
        self._send({"op": "scrape_all", "id": scrape_id})
        try:
            return await asyncio.wait_for(fut, SCRAPE_TIMEOUT_S)
        finally:
            self._scrapes.pop(scrape_id, None)

    async def close(self) -> None:
        self.closing = True
        if self._flush is not None:
            self._flush.cancel()
            self._send_routes()
        if self._writer is not None:
            self._writer.close()
        for task in [*self._tasks, self._reader_task]:
            if task is not None:
                task.cancel()
