"""/load_lora_adapter and /unload_lora_adapter across the mesh: all workers or none.

A change goes to every registered worker at once (colocated, prefill and decode workers alike: a disaggregated
request runs its adapter on both sides), each call bounded by --lora-timeout-s. When every worker did it, the
answer is the adapters loaded now. When one did not, what the others did is undone before the answer (a load is
unloaded again; an unload is loaded again from the directory the adapter had come from), so no adapter is left
loaded on some workers only, and the error names every worker that failed and why: a 400 when each refused it (bad
input: the engine's reason), a 504 when one timed out, else a 503. A call that failed without an answer (timed out,
unreachable) may still have done its change there, so it is undone too; the worker answers that undo with NOT_FOUND
or ALREADY_EXISTS when there was nothing to undo. Changes are made one at a time (a load racing an unload of the
same name could leave either half done), under the lock that resyncs of (re)joining workers hold too
(services/router/lora_sync.py); a change made everywhere is recorded in the LoraIntent those resyncs apply. With
--router-workers N, one at a time across the processes too: a change first takes the mesh-wide turn and, once made,
is applied by every other process before it is answered (services/router/lora_peers.py)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import grpc

from radixmesh.v1 import worker_pb2
from radixmesh.services.router.errors import RouterError
from radixmesh.services.router.lora_peers import Alone, turn_wait_s
from radixmesh.services.router.lora_sync import LoraIntent

log = logging.getLogger(__name__)
# the worker refused the change for its input or its state: nothing changed there, and a client can do better
REFUSED = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND,
                     grpc.StatusCode.FAILED_PRECONDITION})


@dataclass(slots=True)
class Outcome:
    """One worker's answer: its response, or the status it failed with."""

    worker: Any
    response: Any = None
    code: grpc.StatusCode | None = None
    details: str = ""

    @property
    def ok(self) -> bool:
        return self.code is None

    @property
    def unsure(self) -> bool:
        """Failed without saying whether the change happened (a timeout, a lost connection)."""
        return self.code is not None and self.code not in REFUSED


def role_of(worker) -> str:
    mode = worker.info.disaggregation_mode
    return "colocated" if mode in ("", "null") else mode


class LoraFanout:
    def __init__(self, registry, timeout_s: float, intent: LoraIntent | None = None, peers=None):
        """`registry`: the WorkerRegistry whose workers change; `timeout_s`: bound on each worker call; `intent`:
        where the changes made are recorded (the router's LoraDirectory.intent; None: a record of its own);
        `peers`: the sibling router processes' part (lora_peers.LoraPeer: `turn(wait_s)`, `announce(...)`; None:
        this is the only process)."""
        self.registry = registry
        self.timeout_s = timeout_s
        self.intent = intent if intent is not None else LoraIntent()
        self.peers = peers if peers is not None else Alone()

    async def load(self, name: str, path: str) -> None:
        """Load adapter `name` from `path` on every worker; RouterError (everything undone) when one fails."""
        async with self.peers.turn(turn_wait_s(self.timeout_s)), self.intent.lock:
            request = worker_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
            outcomes = await self._on_each(self._workers(), lambda w: w.stub.LoadLoraAdapter(
                request, timeout=self.timeout_s))
            failed = [o for o in outcomes if not o.ok]
            if failed:
                undo = [o.worker for o in outcomes if o.ok or o.unsure]
                notes = await self._undo(undo, lambda w: w.stub.UnloadLoraAdapter(
                    worker_pb2.UnloadLoraAdapterRequest(lora_name=name), timeout=self.timeout_s))
                raise _failure(f"LoRA adapter {name!r} not loaded", failed, notes)
            self.intent.did_load(name, path)
            for w in self.registry.workers.values():
                w.lora.refused.pop(name, None)  # a worker that refused it on rejoining may take it now
            await self.peers.announce("load", name, path, [o.worker.url for o in outcomes])

    async def unload(self, name: str) -> None:
        """Unload adapter `name` from every worker that has it; RouterError (everything undone) when one fails,
        400 when none has it."""
        async with self.peers.turn(turn_wait_s(self.timeout_s)), self.intent.lock:
            workers = self._workers()
            paths = {w.url: w.lora.adapters.get(name, "") for w in workers}  # to load it again from, if need be
            request = worker_pb2.UnloadLoraAdapterRequest(lora_name=name)
            outcomes = await self._on_each(workers, lambda w: w.stub.UnloadLoraAdapter(
                request, timeout=self.timeout_s))
            failed = [o for o in outcomes if not o.ok and o.code != grpc.StatusCode.NOT_FOUND]
            for o in outcomes:
                if o.ok:
                    paths[o.worker.url] = o.response.lora_path or paths[o.worker.url]
            if not failed and not any(o.ok for o in outcomes):
                raise RouterError(400, f"no LoRA adapter named {name!r} is loaded")
            if failed:
                undo = [o.worker for o in outcomes if o.ok or o.unsure]
                notes = await self._undo(undo, lambda w: self._reload(w, name, paths[w.url]))
                raise _failure(f"LoRA adapter {name!r} not unloaded", failed, notes)
            self.intent.did_unload(name)
            await self.peers.announce("unload", name, "", [o.worker.url for o in outcomes])

    def _workers(self) -> list:
        workers = list(self.registry.workers.values())
        if not workers:
            raise RouterError(503, "no worker is registered")
        return workers

    def _reload(self, worker, name: str, path: str):
        if not path:
            raise ValueError("the directory it was loaded from is not known")
        request = worker_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        return worker.stub.LoadLoraAdapter(request, timeout=self.timeout_s)

    @staticmethod
    async def _on_each(workers: list, call: Callable[[Any], Awaitable]) -> list[Outcome]:
        """`call(worker)` on every worker at once; each answer is taken into the worker's LoRA state."""
        async def one(w) -> Outcome:
            try:
                response = await call(w)
            except grpc.aio.AioRpcError as e:
                return Outcome(w, code=e.code(), details=e.details() or e.code().name)
            except ValueError as e:  # refused before the call was made
                return Outcome(w, code=grpc.StatusCode.FAILED_PRECONDITION, details=str(e))
            w.lora.changed(response.adapters)
            return Outcome(w, response)
        return list(await asyncio.gather(*(one(w) for w in workers)))

    async def _undo(self, workers: list, call: Callable[[Any], Awaitable]) -> list[str]:
        """Undo a failed change on `workers` (best effort: each failure is logged and reported); what to tell."""
        outcomes = await self._on_each(workers, call)
        done = [o.worker.url for o in outcomes
                if o.ok or o.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS)]
        notes = [f"undone on {', '.join(done)}"] if done else []
        for o in outcomes:
            if not o.ok and o.code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS):
                log.warning("could not undo a LoRA adapter change on worker %s: %s", o.worker.url, o.details)
                notes.append(f"NOT undone on {o.worker.url}: {o.details}")
        return notes


def _failure(what: str, failed: list[Outcome], notes: list[str]) -> RouterError:
    reasons = "; ".join(f"worker {o.worker.url} ({role_of(o.worker)}): {o.details}" for o in failed)
    if all(o.code in REFUSED for o in failed):
        status = 400
    elif any(o.code == grpc.StatusCode.DEADLINE_EXCEEDED for o in failed):
        status = 504
    else:
        status = 503
    return RouterError(status, f"{what}: {reasons}" + "".join(f"; {n}" for n in notes))
