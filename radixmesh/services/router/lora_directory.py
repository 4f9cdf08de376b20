"""Which worker has which LoRA adapter, and routing by adapter.

Each registered worker's adapters are what it reported (services/router/lora_state.py): fetched when it is added,
polled every --health-check-interval-s, and replaced by the answers of the router's own load and unload calls. A
request that names an adapter goes only to workers that have it loaded (`serving`); when no registered worker has
it, every worker is asked again before the request is refused (a worker restarted with other --lora-paths is then
found without waiting for the next poll; a change made through a sibling router process needs no asking: it is
applied here before it is answered, services/router/lora_peers.py); those refreshes are shared by concurrent
requests and happen at most once per `min_refresh_s`, so requests naming unknown adapters cost the workers nothing
more. The answer for an adapter no worker has is a 400 naming it and those loaded; for one that only unhealthy
workers have, a 503.

Run-time changes follow a worker that (re)joins (services/router/lora_sync.py): a worker is only routed adapters once
it is synced, and a request whose adapter only unsynced workers may have waits for their resync. An adapter unloaded
at run time is not listed or routed, whatever a worker's flags brought back."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Collection

from radixmesh.services.router.errors import RouterError
from radixmesh.services.router.lora_state import poll
from radixmesh.services.router.lora_sync import LoraIntent, LoraSync


class LoraDirectory:
    def __init__(self, registry, timeout_s: float, min_refresh_s: float = 1.0, lora_timeout_s: float = 60.0):
        """`registry`: the WorkerRegistry whose workers' adapters this follows (its on_add is set here); `timeout_s`:
        bound on one poll; `lora_timeout_s` (--lora-timeout-s): on each load or unload of a resync (`sync`)."""
        self.registry = registry
        self.timeout_s = timeout_s
        self.min_refresh_s = min_refresh_s
        self._refreshing: asyncio.Future | None = None
        self._refreshed_at = -math.inf
        self.intent = LoraIntent()  # what /load_lora_adapter and /unload_lora_adapter changed (lora_fanout.py)
        self.sync = LoraSync(registry, self.intent, timeout_s, lora_timeout_s)
        registry.on_add = self.sync.joined

    async def refresh(self, worker) -> None:
        """Ask one worker for its adapters, and resync it when it is not synced or lacks a run-time change (the
        registry's poll calls this for every worker)."""
        self.sync.watch(worker)
        if worker.lora.synced:
            await poll(worker.stub, worker.lora, self.timeout_s)
        if self.sync.needs(worker):
            await asyncio.shield(self.sync.resync(worker))

    async def refresh_all(self) -> None:
        """Ask every worker now, unless that was done within `min_refresh_s`; concurrent callers share one round."""
        if self._refreshing is None or self._refreshing.done():
            if time.monotonic() - self._refreshed_at < self.min_refresh_s:
                return
            self._refreshing = asyncio.ensure_future(self._poll_all())
        await asyncio.shield(self._refreshing)

    async def _poll_all(self) -> None:
        await asyncio.gather(*(self.refresh(w) for w in list(self.registry.workers.values())))
        self._refreshed_at = time.monotonic()

    def adapters(self) -> dict[str, str]:
        """Every adapter some registered worker has loaded: name -> the directory it was loaded from, by name."""
        out: dict[str, str] = {}
        for w in self.registry.workers.values():
            for name, path in w.lora.adapters.items():
                if not out.get(name) and name not in self.intent.unloaded:
                    out[name] = path
        return dict(sorted(out.items()))

    def holders(self, name: str) -> list:
        """The registered workers (healthy or not) that have adapter `name` loaded."""
        if name in self.intent.unloaded:
            return []
        return [w for w in self.registry.workers.values() if name in w.lora.adapters]

    def _serves(self, worker, name: str) -> bool:
        return worker.lora.synced and name in worker.lora.adapters and name not in self.intent.unloaded

    async def names_for(self, model, served: Collection[str]) -> Collection[str]:
        """The adapter names a request's `model` may be (request_fields.adapter_of_model): none needed when it is
        absent, not a string, a served model or `<served model>:<adapter>`; else the adapters loaded, asking the
        workers again first when none has `model` (see refresh_all)."""
        if not isinstance(model, str) or not model or model in served or any(
                model.startswith(s + ":") for s in served):
            return ()
        if not self.holders(model):
            await self.refresh_all()
        return self.adapters().keys()

    async def serving(self, workers: list, name: str, role: str) -> list:
        """Those of `workers` (the healthy ones of one role) that have adapter `name` loaded; RouterError 400 when
        no registered worker has it (after asking them again), 503 when only workers left out here have it. Workers
        not synced (just joined or reconnected) count once their resync is done, which this waits for when none of
        the synced ones has the adapter."""
        have = [w for w in workers if self._serves(w, name)]
        if have:
            return have
        await self.sync.settle(workers)
        if not self.holders(name):
            await self.refresh_all()
        have = [w for w in workers if self._serves(w, name)]
        if have:
            return have
        raise self.missing(name, role)

    def missing(self, name: str, role: str) -> RouterError:
        """Why no `role` worker can serve adapter `name`."""
        holders = self.holders(name)
        if holders:
            where = ", ".join(w.url + ("" if w.lora.synced else " (reconnecting)") for w in holders)
            return RouterError(503, f"no healthy {role} worker has LoRA adapter {name!r} loaded (it is loaded on "
                                    f"{where})")
        if not any(w.lora.enabled for w in self.registry.workers.values()):
            return RouterError(400, f"unknown LoRA adapter {name!r}: no worker serves LoRA adapters (start the "
                                    "workers with --enable-lora)")
        loaded = ", ".join(self.adapters()) or "none"
        return RouterError(400, f"unknown LoRA adapter {name!r} (loaded: {loaded})")
