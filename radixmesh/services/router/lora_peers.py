"""Run-time LoRA changes among router processes (--router-workers N): one router, whatever N is.

A change (POST /load_lora_adapter, /unload_lora_adapter: services/router/lora_fanout.py) is made by the process the
kernel handed the request to, in three steps over the supervisor's hub (services/router/peers.py, supervisor.py):

1. it waits for its turn: the hub grants one turn at a time, in the order asked (`LoraLedger`), so two changes made
   through two processes never interleave on the workers (a load and an unload of one name would leave it loaded on
   some workers only). A turn is given back when the change ends, or by the hub when the holder's link breaks (the
   process died); a process that waited longer than a change can take answers 503.
2. it makes the change on every worker (all or none, as one process would).
3. it announces a change made: every other process applies it at once (its LoraIntent, what it knows each worker
   has loaded) and acknowledges; the change is answered once all have, so a request naming a loaded adapter is
   routed, and one naming an unloaded adapter refused, through whichever process it reaches next.

The hub keeps the intent (what was loaded and unloaded at run time) and hands it to every process that joins in its
snapshot: a process the supervisor starts again resyncs (re)joining workers as its siblings do (lora_sync.py).
Applied changes are not announced again. Resyncs of (re)joining workers (lora_sync.py) take the turn too, so none
loads or unloads by an intent a sibling is changing; each process resyncs on its own (a worker that rejoins is
resynced by all of them: the first does the work, the others' loads and unloads find it done).

One turn for all names, as one process has one lock for all its changes: changes are rare, and a resync may touch
several names at once. The hub grants it rather than one process making every change: every process has the
workers' channels and the fan-out already, a forwarded change would need its HTTP answer carried back from a process
that may itself be restarting, and the hub outlives every router process, so a dead holder's turn is freed by the
one party that sees its link break."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from radixmesh.services.router.errors import RouterError

log = logging.getLogger(__name__)
ACK_TIMEOUT_S = 5.0  # a change is answered after this long even when a sibling has not applied it (logged)


def turn_wait_s(call_timeout_s: float) -> float:
    """How long a change or resync waits for the turn another one holds: that one's calls and then their undo, each
    within `call_timeout_s` (--lora-timeout-s), and its announcement."""
    return 2 * call_timeout_s + ACK_TIMEOUT_S


class Alone:
    """The other router processes' part when there are none: no turn to wait for, nobody to tell."""

    @contextlib.asynccontextmanager
    async def turn(self, wait_s: float):
        yield

    async def announce(self, change: str, name: str, path: str, urls: list[str]) -> None:
        pass


class LoraLedger:
    """The hub's side: the mesh's intent and the turn to change it. Links are opaque (the hub's writers);
    `send(link, msg)` writes to one."""

    def __init__(self, send: Callable[[Any, dict], None]):
        self.send = send
        self.loaded: dict[str, str] = {}  # as LoraIntent's: name -> directory, loaded at run time
        self.unloaded: set[str] = set()  # unloaded at run time, not loaded again since
        self.holder: tuple[Any, int] | None = None  # (link, its turn id) changing adapters now
        self.waiting: deque[tuple[Any, int]] = deque()
        self._seqs = itertools.count()
        self._pending: dict[int, tuple[Any, int, set]] = {}  # seq -> (announcer, its id, links yet to apply it)

    def snapshot(self) -> dict[str, Any]:
        return {"loaded": dict(self.loaded), "unloaded": sorted(self.unloaded)}

    def handle(self, msg: dict[str, Any], link, others: list) -> None:
        """One lora_* message from `link`; `others`: every other process's link."""
        op = msg["op"]
        if op == "lora_lock":
            self.waiting.append((link, msg["id"]))
            self._grant()
        elif op == "lora_unlock":
            self._release((link, msg["id"]))
        elif op == "lora":
            self._record(msg, link, others)
        elif op == "lora_ack":
            self._acked(msg["seq"], link)

    def left(self, link) -> None:
        """`link` broke: its turn and its place in line are given up, and it applies nothing any more."""
        self.waiting = deque(w for w in self.waiting if w[0] is not link)
        if self.holder is not None and self.holder[0] is link:
            log.warning("a router process died while changing LoRA adapters; the next change may go ahead")
            self.holder = None
            self._grant()
        for seq, (announcer, _, _) in list(self._pending.items()):
            if announcer is link:
                del self._pending[seq]
            else:
                self._acked(seq, link)

    def _grant(self) -> None:
        if self.holder is None and self.waiting:
            self.holder = self.waiting.popleft()
            self.send(self.holder[0], {"op": "lora_granted", "id": self.holder[1]})

    def _release(self, turn: tuple[Any, int]) -> None:
        if self.holder is not None and self.holder[0] is turn[0] and self.holder[1] == turn[1]:
            self.holder = None
            self._grant()
        else:  # given up before it was granted
            self.waiting = deque(w for w in self.waiting if not (w[0] is turn[0] and w[1] == turn[1]))

    def _record(self, msg: dict[str, Any], link, others: list) -> None:
        name = msg["name"]
        if msg["change"] == "load":
            self.loaded[name] = msg["path"]
            self.unloaded.discard(name)
        else:
            self.loaded.pop(name, None)
            self.unloaded.add(name)
        seq = next(self._seqs)
        self._pending[seq] = (link, msg["id"], set(others))
        forward = {**msg, "seq": seq}
        del forward["id"]
        for other in others:
            self.send(other, forward)
        self._acked(seq, None)

    def _acked(self, seq: int, link) -> None:
        pending = self._pending.get(seq)
        if pending is None:
            return
        pending[2].discard(link)
        if not pending[2]:
            del self._pending[seq]
            self.send(pending[0], {"op": "lora_applied", "id": pending[1]})


class LoraPeer:
    """This process's side: its turn, its announcements, and its siblings' changes applied to `router` (its
    LoraDirectory's intent, its workers' LoraState)."""

    def __init__(self, send: Callable[[dict], None], router):
        self._send = send
        self.router = router
        self._ids = itertools.count()
        self._waits: dict[int, asyncio.Future] = {}  # turn or announcement id -> the hub's answer

    @contextlib.asynccontextmanager
    async def turn(self, wait_s: float):
        """Holds the mesh-wide turn to change adapters; RouterError 503 when another process's change kept it for
        longer than `wait_s`."""
        turn_id, granted = self._ask()
        self._send({"op": "lora_lock", "id": turn_id})
        try:
            try:
                await asyncio.wait_for(granted, wait_s)
            except TimeoutError:
                raise RouterError(503, f"another LoRA adapter change, made through another router process, did not "
                                       f"end within {wait_s:.0f} s; nothing was changed, try again") from None
            yield
        finally:
            self._waits.pop(turn_id, None)
            self._send({"op": "lora_unlock", "id": turn_id})

    async def announce(self, change: str, name: str, path: str, urls: list[str]) -> None:
        """Tells the other processes of a change made (`change`: load or unload of adapter `name`, from `path`, on
        the workers at `urls`); returns once every one has applied it (at most ACK_TIMEOUT_S)."""
        announce_id, applied = self._ask()
        self._send({"op": "lora", "id": announce_id, "change": change, "name": name, "path": path, "workers": urls})
        try:
            await asyncio.wait_for(applied, ACK_TIMEOUT_S)
        except TimeoutError:
            log.warning("LoRA adapter %s: %sed; not every router process said it applied it within %.0f s", name,
                        change, ACK_TIMEOUT_S)
        finally:
            self._waits.pop(announce_id, None)

    def _ask(self) -> tuple[int, asyncio.Future]:
        ask_id = next(self._ids)
        self._waits[ask_id] = fut = asyncio.get_running_loop().create_future()
        return ask_id, fut

    def handle(self, msg: dict[str, Any]) -> None:
        """A lora_* message from the hub."""
        op = msg["op"]
        if op in ("lora_granted", "lora_applied"):
            fut = self._waits.get(msg["id"])
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif op == "lora":
            self._apply(msg)
            self._send({"op": "lora_ack", "seq": msg["seq"]})

    def _apply(self, msg: dict[str, Any]) -> None:
        """A sibling's change, made on the workers at msg["workers"], applied here without announcing it again."""
        lora, workers = self.router.lora, self.router.registry.workers
        name, loaded = msg["name"], msg["change"] == "load"
        if loaded:
            lora.intent.did_load(name, msg["path"])
            for w in workers.values():
                w.lora.refused.pop(name, None)  # a worker that refused it on rejoining may take it now
        else:
            lora.intent.did_unload(name)
        for url in msg["workers"]:
            worker = workers.get(url)
            if worker is not None:
                worker.lora.applied(name, msg["path"] if loaded else None)

    def restore(self, snapshot: dict[str, Any] | None) -> None:
        """The hub's intent, taken when this process joins; then each worker not in line with it is resynced."""
        if snapshot is None:
            return
        intent = self.router.lora.intent
        intent.loaded = dict(snapshot["loaded"])
        intent.unloaded = set(snapshot["unloaded"])
        task = asyncio.ensure_future(self._resync_all())
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or log.error(
            "resyncing the workers with the router's LoRA intent failed: %r", t.exception()))

    async def _resync_all(self) -> None:
        sync = self.router.lora.sync
        async with self.router.lora.intent.lock:  # resyncs under way that read the intent before it are done
            pass
        for worker in list(self.router.registry.workers.values()):
            sync.watch(worker)
            if sync.needs(worker):
                sync.resync(worker)
