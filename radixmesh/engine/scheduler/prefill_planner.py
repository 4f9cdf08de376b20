"""Chooses which waiting requests join the next prefill batch, and how many of their tokens.

Budgets per batch: `max_prefill_tokens` new tokens (a batch of one may exceed it), `chunked_prefill_size` tokens
(the last admitted request may be cut into a chunk), `max_running_requests`, and KV memory: the new tokens plus a
reserve for the tokens running requests are still expected to generate (`new_token_ratio` of their remaining
`max_new_tokens`, the ratio scaled by `schedule_conservativeness`).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixmesh.engine.cache.manager import CacheManager
from radixmesh.engine.request import Req

# Remaining max_new_tokens above this count only up to it when reserving memory (a request asking for 100k tokens
# should not block admission forever; retraction handles the rare overrun).
CLIP_MAX_NEW_TOKENS = 4096
# Past this many waiting requests, longest-prefix-first ordering costs more than it saves; fall back to FCFS.
LPM_MAX_QUEUE = 128


@dataclass(slots=True)
class PlannerLimits:
    max_prefill_tokens: int
    chunked_prefill_size: int  # <= 0: no chunking
    max_running_requests: int
    page_size: int
    schedule_policy: str
    max_adapters: int = 0  # LoRA adapters running at once (--max-loras-per-batch; 0: no limit)


class NewTokenRatio:
    """Fraction of a running request's remaining max_new_tokens to keep in reserve; decays while decoding goes
    well, jumps back after a retraction."""

    def __init__(self, conservativeness: float):
        self.init = min(0.7 * conservativeness, 1.0)
        self.min = self.init * 0.2
        self.decay = (self.init - self.min) / 600
        self.value = self.init

    def step(self) -> None:
        self.value = max(self.value - self.decay, self.min)

    def on_retract(self) -> None:
        self.value = min(1.0, max(self.value, self.init) / 0.7)


class PrefillPlanner:
    def __init__(self, limits: PlannerLimits, cache: CacheManager, ratio: NewTokenRatio):
        self.limits = limits
        self.cache = cache
        self.ratio = ratio

    def reserved_tokens(self, reqs: list[Req]) -> int:
        return int(sum(min(r.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) for r in reqs) * self.ratio.value)

    def order(self, waiting: list[Req]) -> list[Req]:
        if self.limits.schedule_policy == "lpm" and self.cache.tree is not None and len(waiting) <= LPM_MAX_QUEUE:
            prefix = {id(r): self.cache.match_len(r.fill_ids, r.tenant) for r in waiting}
            return sorted(waiting, key=lambda r: (-prefix[id(r)], r.arrival))
        return sorted(waiting, key=lambda r: r.arrival)

    def _room(self, reserved: int) -> int:
        """Whole pages' worth of tokens that can be allocated beyond the reserve."""
        page = self.cache.page
        return max(self.cache.available_tokens() - reserved, 0) // page * page

    def continue_chunked(self, req: Req, running: list[Req]) -> bool:
        """Give the partially prefilled request its next chunk. Returns False when memory allows no progress."""
        left = req.fill_len - req.kv_len
        room = self._room(self.reserved_tokens(running))
        extend = min(left, room + (-req.alloc_len) % self.cache.page)
        if extend < left:
            extend = extend // self.cache.page * self.cache.page
        return extend > 0 and self._set_extend(req, self._chunk(extend, left))

    def _chunk(self, extend: int, left: int) -> int:
        size = self.limits.chunked_prefill_size
        if size > 0 and extend > size:
            return size
        return extend if extend == left else extend // self.limits.page_size * self.limits.page_size

    def _set_extend(self, req: Req, extend: int) -> bool:
        if extend <= 0 or self.cache.alloc_tokens(req, extend) is None:
            return False
        req.extend_len = extend
        return True

    def plan(self, waiting: list[Req], running: list[Req], busy_slots: int, used_tokens: int = 0,
             chunked: Req | None = None) -> list[Req]:
        """Admit requests from `waiting` (not removed from it here). Admitted requests hold a table row, a locked
        cached prefix and KV slots for `extend_len` new tokens. `busy_slots`: running requests plus a chunked one;
        `used_tokens`: prefill tokens this batch already carries (a continuing chunk); `chunked`: the request whose
        prefill is still in chunks (its adapter runs too)."""
        admitted: list[Req] = []
        reserved = self.reserved_tokens(running)
        token_budget = self.limits.max_prefill_tokens - used_tokens
        chunk_size = self.limits.chunked_prefill_size
        chunk_budget = (chunk_size if chunk_size > 0 else 1 << 62) - used_tokens
        tiers = self.cache.hierarchy
        limit = self.limits.max_adapters
        holding = [*running, chunked] if chunked is not None else running
        adapters = {r.lora_slot for r in holding if r.lora_slot} if limit else set()
        for req in self.order(waiting):
            if busy_slots + len(admitted) >= self.limits.max_running_requests or chunk_budget <= 0:
                break
            if tiers is not None and not tiers.prefetch_ready(req):
                continue  # its L3 prefetch is still running and the policy says wait
            if limit and req.lora_slot and req.lora_slot not in adapters and len(adapters) >= limit:
                continue  # another adapter would make the batch run more than --max-loras-per-batch
            if not self.cache.admit(req):
                break
            left = req.fill_len - req.kv_len
            future = int(min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) * self.ratio.value)
            room = self._room(reserved)
            extend = left if left + future <= room else 0
            if extend == 0 and not admitted and busy_slots == 0 and room > 0:
                extend = min(left, room)  # alone in the engine: make progress even if the reserve does not fit
            extend = self._chunk(min(extend, chunk_budget), left) if extend else 0
            if (admitted or used_tokens) and extend > token_budget or not self._set_extend(req, extend):
                self.cache.release(req)
                break
            if req.retractions == 0 and not req.output_ids:
                req.cached_tokens = req.kv_len  # the tree's prefix and a tail's tokens after it
                self.cache.count_hit(req)
            admitted.append(req)
            if limit and req.lora_slot:
                adapters.add(req.lora_slot)
            reserved += future
            token_budget -= extend
            chunk_budget -= extend
            if extend < left:
                break  # a chunked request ends the batch
        return admitted
