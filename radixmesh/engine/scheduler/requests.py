"""Every request the scheduler holds, grouped by state, and the one place a request changes state (`move`).

    WAITING     `waiting`      queued for admission (FCFS, or longest cached prefix first)
    PREFILLING  `prefilling`   admitted, its prompt being computed; `chunked` is the one with chunks still to run
    RUNNING     `running`      decoding
    PREALLOC    `prealloc`     a decode-role request (PD) waiting for destination pages, FCFS
    RECEIVING   `receiving`    a decode-role request with pages, waiting for its KV and first token from its peer
    HELD        `held`         finished for its caller, pages pinned until released: a prefill-role request whose KV
                               is being sent, or a decode-role one aborted while its peer could still write
    FINISHED    (none)         done: it holds nothing

Edges: WAITING -> PREFILLING -> RUNNING (prefill role: -> HELD); PREALLOC -> RECEIVING -> RUNNING;
RUNNING or PREFILLING -> WAITING (retracted: KV pages ran out); HELD -> FINISHED (released); any live state ->
FINISHED (done, aborted, failed); RECEIVING -> HELD (aborted while its peer may still write). Anything else is a bug,
and `move` says so. A request in a step still in flight keeps its state; the step is the scheduler's, not a state.
"""

from __future__ import annotations

from typing import Callable

from radixmesh.engine.request import Req, ReqState

S = ReqState
_EDGES = {
    S.WAITING: {S.PREFILLING, S.FINISHED},
    S.PREFILLING: {S.RUNNING, S.HELD, S.WAITING, S.FINISHED},
    S.RUNNING: {S.WAITING, S.FINISHED},
    S.PREALLOC: {S.RECEIVING, S.FINISHED},
    S.RECEIVING: {S.RUNNING, S.HELD, S.FINISHED},
    S.HELD: {S.FINISHED},
    S.FINISHED: set(),
}
# Each live state's collection: a list in arrival order, or a dict by rid (looked up by the peer's calls).
_LISTS = {S.WAITING: "waiting", S.PREFILLING: "prefilling", S.RUNNING: "running", S.PREALLOC: "prealloc"}
_DICTS = {S.RECEIVING: "receiving", S.HELD: "held"}


class Requests:
    def __init__(self):
        self.waiting: list[Req] = []
        self.prefilling: list[Req] = []
        self.chunked: Req | None = None  # of `prefilling`, the request whose next chunk is still to run
        self.running: list[Req] = []
        self.prealloc: list[Req] = []
        self.receiving: dict[str, Req] = {}
        self.held: dict[str, Req] = {}
        self.changed = False  # a request moved since the scheduler last cleared this
        self.on_finished: Callable[[Req], None] | None = None  # called as each request moves to FINISHED

    def add(self, req: Req, decode_role: bool) -> None:
        """A new request: queued for admission, or (decode role) for pre-allocation."""
        req.state = S.PREALLOC if decode_role else S.WAITING
        (self.prealloc if decode_role else self.waiting).append(req)

    def move(self, req: Req, to: ReqState) -> None:
        """Take `req` out of its state's collection and put it in `to`'s. Raises on an edge the table forbids."""
        if to not in _EDGES[req.state]:
            raise RuntimeError(f"request {req.rid}: no move from {req.state.name} to {to.name}")
        self._leave(req)
        req.state = to
        if to is S.FINISHED and self.on_finished is not None:
            self.on_finished(req)
        if to in _LISTS:
            getattr(self, _LISTS[to]).append(req)
        elif to in _DICTS:
            getattr(self, _DICTS[to])[req.rid] = req
        self.changed = True

    def admit(self, reqs: list[Req]) -> None:
        """WAITING -> PREFILLING for a batch the planner admitted (one pass over the queue, not one per request)."""
        taken = {id(r) for r in reqs}
        self.waiting = [r for r in self.waiting if id(r) not in taken]
        for r in reqs:
            r.state = S.PREFILLING
        self.prefilling += reqs

    def _leave(self, req: Req) -> None:
        if req.state in _LISTS:
            getattr(self, _LISTS[req.state]).remove(req)
        elif req.state in _DICTS:
            del getattr(self, _DICTS[req.state])[req.rid]
        if self.chunked is req:
            self.chunked = None

    def find(self, rid: str) -> Req | None:
        """The live request (not FINISHED) named `rid`, or None; a HELD one only when nothing else has the name."""
        for group in (self.prealloc, self.receiving.values(), self.waiting, self.prefilling, self.running):
            for r in group:
                if r.rid == rid:
                    return r
        return self.held.get(rid)

    def has_work(self) -> bool:
        """Requests a step can advance: waiting, prefilling or decoding ones, and decode-role ones awaiting pages."""
        return bool(self.waiting or self.prefilling or self.running or self.prealloc)

    def counts(self) -> dict:
        return {"waiting": len(self.waiting), "running": len(self.running) + (self.chunked is not None),
                "prealloc_waiting": len(self.prealloc), "prealloc_rooms": len(self.receiving),
                "held_rooms": len(self.held)}
