"""Run-time LoRA changes survive a worker that (re)joins.

A worker comes up with its --lora-paths adapters only: one the launcher restarted on its port, one that registered
or was discovered anew. The router remembers the mesh's run-time changes (`LoraIntent`: what /load_lora_adapter
loaded and /unload_lora_adapter unloaded, through any of its processes: services/router/lora_peers.py) and applies
them to such a worker before it is routed any adapter: it loads the run-time adapters it lacks and unloads those
unloaded at run time that its flags brought back (an unloaded adapter never comes back). Each call is bounded by
--lora-timeout-s; one that fails is logged with its reason, and the worker then serves the others but not that
adapter (tried again once it reconnects or the adapter is loaded anew).

Which workers need it: one just added (WorkerRegistry.on_add), and one whose connection was lost (the process may
be a new one once the channel is READY again): a watcher per worker follows its channel's connectivity and marks it
unsynced (LoraState.lost) the moment it leaves READY. A periodic poll that finds a run-time adapter missing, or an
unloaded one present, resyncs too. Resyncs and the fan-out's changes hold the same lock (`LoraIntent.lock`), and a
resync reads the intent under it, so a resync racing an unload either ran before it (the unload then reaches the
worker) or sees the adapter unloaded. With --router-workers N, resyncs also take the mesh-wide turn first, as
changes do (services/router/lora_peers.py), so none acts on an intent that a sibling process is changing."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from radixmesh.v1 import worker_pb2
from radixmesh.services.router.errors import RouterError
from radixmesh.services.router.lora_peers import Alone, turn_wait_s
from radixmesh.services.router.lora_state import poll

log = logging.getLogger(__name__)
READY = grpc.ChannelConnectivity.READY
SHUTDOWN = grpc.ChannelConnectivity.SHUTDOWN


@dataclass(slots=True)
class LoraIntent:
    """The mesh's run-time LoRA changes: those made through this router process, and with --router-workers N those
    its siblings made (lora_peers.py applies them, and gives a process that joins the hub's record)."""

    loaded: dict[str, str] = field(default_factory=dict)  # name -> directory: loaded at run time, not unloaded since
    unloaded: set[str] = field(default_factory=set)  # unloaded at run time, not loaded again since
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # held by every change and every resync

    def did_load(self, name: str, path: str) -> None:
        self.loaded[name] = path
        self.unloaded.discard(name)

    def did_unload(self, name: str) -> None:
        self.loaded.pop(name, None)
        self.unloaded.add(name)

    def to_load(self, state) -> dict[str, str]:
        """The run-time adapters a worker's LoraState lacks (those it refused since it connected left out)."""
        return {n: p for n, p in self.loaded.items() if n not in state.adapters and n not in state.refused}

    def to_unload(self, state) -> list[str]:
        """The adapters unloaded at run time that a worker's LoraState has (its flags brought them back)."""
        return sorted(n for n in self.unloaded if n in state.adapters and n not in state.refused)


class LoraSync:
    def __init__(self, registry, intent: LoraIntent, poll_timeout_s: float, load_timeout_s: float):
        """`registry`: the WorkerRegistry; `poll_timeout_s` bounds a ListLoraAdapters call, `load_timeout_s`
        (--lora-timeout-s) each load or unload."""
        self.registry = registry
        self.intent = intent
        self.poll_timeout_s = poll_timeout_s
        self.load_timeout_s = load_timeout_s
        self.peers = Alone()  # with --router-workers N: this process's lora_peers.LoraPeer (its mesh-wide turn)
        self._resyncs: dict[object, asyncio.Task] = {}  # worker -> its resync under way
        self._watchers: dict[object, asyncio.Task] = {}  # worker -> the task following its channel

    def joined(self, worker) -> None:
        """A worker was added: follow its connection and resync it now."""
        self.watch(worker)
        self.resync(worker)

    def watch(self, worker) -> None:
        """Follow `worker`'s channel until it is closed (WorkerRegistry.remove and close do) or the worker removed
        (once per worker)."""
        task = self._watchers.get(worker)
        if task is None or task.done():
            self._watchers[worker] = task = asyncio.ensure_future(self._watch(worker))
            task.add_done_callback(lambda _t, w=worker: self._watchers.pop(w, None) if self._watchers.get(w) is _t
                                   else None)

    def needs(self, worker) -> bool:
        """Whether `worker` (as last polled) lacks a run-time adapter or has one unloaded at run time."""
        state = worker.lora
        return not state.synced or (state.enabled and bool(self.intent.to_load(state) or self.intent.to_unload(state)))

    def resync(self, worker) -> asyncio.Task:
        """The resync of `worker` under way, or a new one: poll it, apply the run-time changes, mark it synced (not
        when its connection was lost meanwhile, nor when it did not answer: the next poll or reconnect tries again)."""
        task = self._resyncs.get(worker)
        if task is None or task.done():
            self._resyncs[worker] = task = asyncio.ensure_future(self._resync(worker))
        return task

    async def settle(self, workers: list) -> None:
        """Wait for the resyncs of those `workers` that are not synced (each is bounded by its calls' timeouts)."""
        pending = [self.resync(w) for w in workers if not w.lora.synced]
        if pending:
            await asyncio.gather(*(asyncio.shield(t) for t in pending), return_exceptions=True)

    async def _resync(self, worker) -> None:
        state = worker.lora
        generation = state.generation
        if not await poll(worker.stub, state, self.poll_timeout_s):
            return
        try:
            await self._apply(worker)
        except RouterError as e:  # the mesh-wide turn did not come in time: the next poll or reconnect tries again
            log.warning("LoRA adapters of worker %s not resynced: %s", worker.url, e.message)
            return
        if state.generation == generation:
            state.synced = True

    async def _apply(self, worker) -> None:
        """Brings `worker` in line with the intent, holding the mesh-wide turn (as changes do: no sibling process
        changes the intent meanwhile) and then the intent's lock."""
        state = worker.lora
        async with self.peers.turn(turn_wait_s(self.load_timeout_s)), self.intent.lock:
            if state.enabled:
                loads, unloads = self.intent.to_load(state), self.intent.to_unload(state)
                await asyncio.gather(*(self._load(worker, n, p) for n, p in loads.items()),
                                     *(self._unload(worker, n) for n in unloads))
            elif self.intent.loaded and not state.synced:
                log.warning("worker %s (re)joined without --enable-lora: it serves none of the LoRA adapters loaded "
                            "at run time (%s)", worker.url, ", ".join(sorted(self.intent.loaded)))

    async def _load(self, worker, name: str, path: str) -> None:
        request = worker_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        try:
            response = await worker.stub.LoadLoraAdapter(request, timeout=self.load_timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.ALREADY_EXISTS:  # loaded since it was polled (a sibling's resync did)
                worker.lora.applied(name, path)
                return
            reason = f"{e.code().name}: {e.details()}"
            worker.lora.refused[name] = reason
            log.warning("LoRA adapter %s (loaded at run time from %s) could not be loaded on worker %s, which "
                        "(re)joined without it; that worker will not serve it. %s", name, path, worker.url, reason)
            return
        worker.lora.changed(response.adapters)
        log.info("LoRA adapter %s loaded again on worker %s, which (re)joined without it", name, worker.url)

    async def _unload(self, worker, name: str) -> None:
        request = worker_pb2.UnloadLoraAdapterRequest(lora_name=name)
        try:
            response = await worker.stub.UnloadLoraAdapter(request, timeout=self.load_timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:  # unloaded since it was polled
                worker.lora.applied(name, None)
                return
            reason = f"{e.code().name}: {e.details()}"
            worker.lora.refused[name] = reason
            log.warning("LoRA adapter %s, unloaded at run time, is loaded on worker %s (from its --lora-paths) and "
                        "could not be unloaded there; no request for it goes there. %s", name, worker.url, reason)
            return
        worker.lora.changed(response.adapters)
        log.info("LoRA adapter %s, unloaded at run time, unloaded from worker %s, which (re)joined with it", name,
                 worker.url)

    async def _watch(self, worker) -> None:
        """Marks `worker` unsynced when its channel leaves READY, and resyncs it once READY again."""
        channel = worker.channel
        state = channel.get_state(try_to_connect=True)
        while self.registry.workers.get(worker.url) is worker and state != SHUTDOWN:
            try:
                await channel.wait_for_state_change(state)
            except (asyncio.CancelledError, RuntimeError, ValueError):  # the channel was closed under it
                return
            new = channel.get_state(try_to_connect=True)
            if state == READY and new != READY:
                worker.lora.lost()
                log.info("lost the connection to worker %s (%s): no LoRA requests go there until it is resynced",
                         worker.url, new.name)
            elif new == READY and not worker.lora.synced and self.registry.workers.get(worker.url) is worker:
                self.resync(worker)
            state = new
