"""The scheduler's side of prefill/decode disaggregation (see engine.disaggregation.handoff for the roles).

    queue      decode-role requests waiting for pre-allocation (FCFS; the head waits until it fits)
    receiving  decode-role requests whose destination pages are allocated, waiting for their KV and first token
    held       requests finished for their caller whose pages stay pinned until `release`: prefill-role requests
               whose KV is being sent, and decode-role requests that failed while a write could still land
"""

from __future__ import annotations

import logging

from radixmesh.engine.cache.manager import CacheManager
from radixmesh.engine.disaggregation.handoff import DecodeRole
from radixmesh.engine.request import Req, ReqStatus

log = logging.getLogger(__name__)


class Handoffs:
    def __init__(self, cache: CacheManager, reserved_decode_tokens: int):
        self.cache = cache
        self.reserve = reserved_decode_tokens
        self.queue: list[Req] = []
        self.receiving: dict[str, Req] = {}
        self.held: dict[str, Req] = {}

    def has_work(self) -> bool:
        return bool(self.queue)

    def _reserve_of(self, req: Req) -> int:
        return min(self.reserve, req.remaining_new_tokens())

    def preallocate(self, running: list[Req]) -> list[Req]:
        """Allocate destination pages for queued requests while they fit, keeping `num_reserved_decode_tokens` per
        active request (running, receiving, and the new one) free for decoding. Returns the requests allocated;
        their callers are told through `on_allocated` by the scheduler."""
        done: list[Req] = []
        reserved = sum(self._reserve_of(r) for r in running) + sum(self._reserve_of(r) for r in
                                                                  self.receiving.values())
        while self.queue:
            req = self.queue[0]
            if not self.cache.admit(req, whole_prompt=True):
                break  # no free request row
            n = req.fill_len - req.tree_len  # the prompt, and a migrated request's tokens so far
            need = self.cache.pages_for(req.tree_len, n) * self.cache.page
            alone = not running and not self.receiving and not done
            fits = need + reserved + self._reserve_of(req) <= self.cache.available_tokens()
            if not (fits or alone) or (n and self.cache.alloc_tokens(req, n) is None):
                self.cache.release(req)
                break
            self.queue.pop(0)
            self.cache.count_hit(req)
            req.status = ReqStatus.RUNNING
            self.receiving[req.rid] = req
            reserved += self._reserve_of(req)
            done.append(req)
        return done

    def destination(self, req: Req) -> tuple[list[int], int]:
        """(pages to fill, tokens already cached) of a just-allocated request."""
        return self.cache.pages_of(req, req.tree_len, req.fill_len), req.tree_len

    def hold(self, req: Req) -> list[int]:
        """Pin a prefilled request's KV (its aligned prefix joins the radix tree, locked) and return its pages."""
        self.cache.cache_unfinished(req)
        self.held[req.rid] = req
        return self.cache.pages_of(req, 0, req.kv_len)

    def release(self, rid: str) -> bool:
        req = self.held.pop(rid, None)
        if req is None:
            return False
        self.cache.release(req)
        return True

    def take(self, rid: str) -> tuple[str, Req] | None:
        """Remove `rid` from the queue or the receiving set: ("queued" | "receiving", req), or None."""
        for i, r in enumerate(self.queue):
            if r.rid == rid:
                return "queued", self.queue.pop(i)
        req = self.receiving.pop(rid, None)
        return ("receiving", req) if req is not None else None

    @staticmethod
    def is_decode(req: Req) -> bool:
        return isinstance(req.handoff, DecodeRole)

    def counts(self) -> dict:
        return {"prealloc_waiting": len(self.queue), "prealloc_rooms": len(self.receiving),
                "held_rooms": len(self.held)}
