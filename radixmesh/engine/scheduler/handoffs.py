"""The cache side of prefill/decode disaggregation (see engine.disaggregation.handoff for the roles): destination
pages for decode-role requests (PREALLOC -> RECEIVING in engine.scheduler.requests), and the pinned pages of requests
whose KV a peer reads or writes (HELD) until they are released."""

from __future__ import annotations

import logging

from radixmesh.engine.cache.manager import CacheManager
from radixmesh.engine.disaggregation.handoff import DecodeRole
from radixmesh.engine.request import Req, ReqState
from radixmesh.engine.scheduler.requests import Requests

log = logging.getLogger(__name__)


class Handoffs:
    def __init__(self, cache: CacheManager, requests: Requests, reserved_decode_tokens: int, max_adapters: int = 0):
        """`max_adapters`: LoRA adapters running at once (--max-loras-per-batch; 0: no limit)."""
        self.cache = cache
        self.requests = requests
        self.reserve = reserved_decode_tokens
        self.max_adapters = max_adapters

    def _reserve_of(self, req: Req) -> int:
        return min(self.reserve, req.remaining_new_tokens())

    def preallocate(self) -> list[Req]:
        """Allocate destination pages for queued decode-role requests while they fit, keeping
        `num_reserved_decode_tokens` per active request (running, receiving, and the new one) free for decoding;
        each allocated request moves to RECEIVING. Returns them; the scheduler tells their callers. A request of a
        LoRA adapter beyond the --max-loras-per-batch running or receiving waits (FCFS) until one's requests end."""
        reqs = self.requests
        done: list[Req] = []
        limit = self.max_adapters
        adapters = {r.lora_slot for r in (*reqs.running, *reqs.receiving.values()) if r.lora_slot} if limit else set()
        reserved = sum(self._reserve_of(r) for r in reqs.running) + sum(self._reserve_of(r) for r in
                                                                       reqs.receiving.values())
        while reqs.prealloc:
            req = reqs.prealloc[0]
            if limit and req.lora_slot and req.lora_slot not in adapters and len(adapters) >= limit:
                break
            if not self.cache.admit(req, whole_prompt=True):
                break  # no free request row
            n = req.fill_len - req.tree_len  # the prompt, and a migrated request's tokens so far
            need = self.cache.pages_for(req.tree_len, n) * self.cache.page
            alone = not reqs.running and not reqs.receiving and not done
            fits = need + reserved + self._reserve_of(req) <= self.cache.available_tokens()
            if not (fits or alone) or (n and self.cache.alloc_tokens(req, n) is None):
                self.cache.release(req)
                break
            self.cache.count_hit(req)
            reqs.move(req, ReqState.RECEIVING)
            reserved += self._reserve_of(req)
            done.append(req)
            if req.lora_slot:
                adapters.add(req.lora_slot)
        return done

    def destination(self, req: Req) -> tuple[list[int], int]:
        """(pages to fill, tokens already cached) of a just-allocated request."""
        return self.cache.pages_of(req, req.tree_len, req.fill_len), req.tree_len

    def hold(self, req: Req) -> list[int]:
        """Pin a prefilled request's KV (its aligned prefix joins the radix tree, locked), move it to HELD and
        return its pages."""
        self.cache.cache_unfinished(req)
        self.requests.move(req, ReqState.HELD)
        return self.cache.pages_of(req, 0, req.kv_len)

    def release(self, rid: str) -> bool:
        """Free the pages of the HELD request `rid` (it is FINISHED then); False when no request is held so."""
        req = self.requests.held.get(rid)
        if req is None:
            return False
        self.requests.move(req, ReqState.FINISHED)
        self.cache.release(req)
        return True

    @staticmethod
    def is_decode(req: Req) -> bool:
        return isinstance(req.handoff, DecodeRole)
