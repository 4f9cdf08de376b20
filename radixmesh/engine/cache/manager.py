"""The cache manager: the only code that allocates and frees KV pages.

It owns the page allocator, the request-to-token table and (unless the radix cache is disabled) the radix tree.
Per request it tracks three lengths over the request's row of the table (all in tokens):
    tree_len  <= kv_len <= alloc_len
    [0, tree_len)         slots owned by the radix tree (the request holds a lock on them); page-aligned
    [tree_len, alloc_len) slots owned by the request; a partially filled last page always belongs to the request
    [0, kv_len)           slots whose KV has been computed (or copied in from the cache)
With pages of more than one token, the partly filled last page of a released request is kept as a tail of the tree
(engine.cache.tails): a later request that continues those tokens gets their KV copied into its own first page.
When every layer of the model slides (`window`), a running request's own pages behind the window go back to the pool
as it advances (engine.cache.swa: what is freed, and what the tree may then keep). When only some do and their KV has
a pool of its own (engine.cache.swa_pool), every full page holds an SWA partner page while a window may read it:
engine.cache.swa_hybrid says which, and which cached prefixes stay usable.
"""

from __future__ import annotations

import logging

import torch

from radixmesh.engine.cache.kv_events import KvEventLog, Tier
from radixmesh.engine.cache.kv_pool import KVPool
from radixmesh.engine.cache.radix_tree import RadixTree
from radixmesh.engine.cache.req_to_token import ReqToTokenPool
from radixmesh.engine.cache.swa import SlidingWindowPages
from radixmesh.engine.cache.swa_hybrid import HybridWindowPages
from radixmesh.engine.cache.swa_pool import HybridKVPool
from radixmesh.engine.cache.tails import TailCache
from radixmesh.engine.request import Req

log = logging.getLogger(__name__)


class CacheManager:
    """`events`: where page changes are published (KV events), or None. `hierarchy` (set by the engine after
    construction): the host and storage tiers, engine.cache.hierarchy.CacheHierarchy, or None. `window`: the
    largest layer window when every layer slides and pages behind it may be freed (engine.cache.swa), else None."""

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool, tree: RadixTree | None,
                 events: KvEventLog | None = None, window: int | None = None):
        self.kv = kv_pool
        # pools that mirror this one's slots (an EAGLE head's KV: engine.speculative.setup): each copies what this
        # pool copies (`copy_page_prefix(src, dst, n)`) and forgets what it frees (`pages_freed(pages)`)
        self.page_followers: list = []
        self.pages = kv_pool.allocator
        self.page = kv_pool.page_size
        self.req_to_token = req_to_token
        self.tree = tree
        self.events = events
        self.hierarchy = None
        self.evicted_tokens = 0
        # Monotonic, for metrics: prompt tokens looked up at admission, and those found per tier (device: already
        # there; host: loaded back from the host pool). Counted once per request, when it is admitted for good.
        self.lookup_tokens = 0
        self.hit_tokens = {"device": 0, "host": 0}
        self.tails = TailCache(self) if tree is not None and self.page > 1 else None
        if self.tails is not None:
            tree.on_remove = self.tails.node_removed
        self.swa = SlidingWindowPages(req_to_token, self.page, self._free_slots, window) if window is not None else None
        # a hybrid pool's sliding-layer pages (engine.cache.swa_hybrid); None with one pool
        self.hybrid = HybridWindowPages(kv_pool, req_to_token, self.page, tree) \
            if isinstance(kv_pool, HybridKVPool) else None

    # ---- capacity -------------------------------------------------------------------------------------------
    @property
    def max_total_tokens(self) -> int:
        return self.kv.capacity_tokens

    def evictable_tokens(self) -> int:
        return self.tree.evictable_size if self.tree else 0

    def available_tokens(self) -> int:
        """Tokens that can be handed out now: free pages plus what eviction can reclaim."""
        tails = self.tails.evictable_pages if self.tails is not None else 0
        full = (self.pages.num_free + tails) * self.page + self.evictable_tokens()
        return full if self.hybrid is None else min(full, (self.hybrid.available_pages() + tails) * self.page)

    def pages_for(self, start: int, n: int) -> int:
        """New pages needed to grow a row from `start` tokens to `start + n`."""
        return -(-(start + n) // self.page) - -(-start // self.page)

    def ensure_free_pages(self, n: int) -> bool:
        """Make n device pages free, evicting (demoting, with a host tier) least recently used cached pages."""
        if n > self.pages.num_free and self.tails is not None:
            self.tails.evict_device(n - self.pages.num_free)  # tails first: at most a page of tokens each
        short = (n - self.pages.num_free) * self.page
        if short > 0 and self.tree is not None:
            leaves = self.tree.device_leaves()
            while short > 0 and (leaf := next(leaves, None)) is not None:
                if self.hierarchy is not None:
                    self.hierarchy.demote(leaf)
                    # no room on the host for it: its host-only descendants (from L3) go with it, unless copies
                    # still read them
                    if not leaf.on_host and leaf.children and not self.hierarchy.drop_host_subtree(leaf):
                        continue
                keys = leaf.page_keys
                slots = self.tree.drop_device(leaf)
                self._free_slots(slots)
                short -= len(slots)
                self.evicted_tokens += len(slots)
                if self.events is not None and keys:
                    self.events.removed(Tier.DEVICE, keys)
        if self.hybrid is not None and not self.hybrid.ensure(n):  # (tails hold SWA partners too)
            if self.tails is not None:
                self.tails.evict_device(n - self.hybrid.swa.num_free)
            if self.hybrid.swa.num_free < n:
                return False
        return self.pages.num_free >= n

    def alloc_pages(self, n: int) -> torch.Tensor:
        """n fresh device pages (host int64), with SWA partners under a hybrid pool; `ensure_free_pages(n)` first."""
        pages = self.pages.alloc(n)
        if self.hybrid is not None:
            self.hybrid.paired(pages)
        return pages

    def _free_slots(self, slots: torch.Tensor) -> None:
        """Free the pages of page-aligned slot runs (each run starts on a page boundary)."""
        if len(slots):
            self.free_pages(slots if self.page == 1 else slots[slots % self.page == 0] // self.page)

    def free_pages(self, pages: list[int] | torch.Tensor) -> None:
        pages = torch.as_tensor(pages, dtype=torch.int64)
        if self.hybrid is not None:
            self.hybrid.freeing(pages)
        for follow in self.page_followers:
            follow.pages_freed(pages)
        self.pages.free(pages)

    def copy_page_prefix(self, src: int, dst: int, n: int) -> None:
        """The KV of the first n slots of device page src into page dst, every layer (in stream order before the
        next forward; under tensor parallelism every rank does the same, from the step journal)."""
        self.kv.copy_page_prefix(src, dst, n)
        for follow in self.page_followers:
            follow.copy_page_prefix(src, dst, n)
        if self.req_to_token.journal is not None:
            self.req_to_token.journal.append(("copy_pages", src, dst, n))

    # ---- prefix matching ------------------------------------------------------------------------------------
    def match_len(self, tokens: list[int], namespace: str = "") -> int:
        """Cached prefix length for `tokens` on the device and host (no lock taken); the last token is always
        left to compute."""
        if self.tree is None or len(tokens) <= 1:
            return 0
        match = self.tree.match_prefix(tokens[:-1], namespace, touch=False)
        if self.hybrid is not None:
            return self.hybrid.usable(match.indices)
        return len(match.indices) + match.host_len

    def admit(self, req: Req, whole_prompt: bool = False) -> bool:
        """Give `req` a table row and its cached prefix (locked).
        Returns False, changing nothing, when no row is free. Normally the last token is left to compute (its
        logits give the next token); `whole_prompt` lets the prefix cover every token (a decode-side request whose
        next token comes from its prefill worker)."""
        row = self.req_to_token.alloc()
        if row is None:
            return False
        req.pool_idx = row
        req.kv_len = req.alloc_len = req.tree_len = req.host_loaded_tokens = 0
        if self.swa is not None:
            self.swa.admitted(req)
        if self.tree is not None:
            limit = req.fill_len if whole_prompt else req.fill_len - 1
            if not whole_prompt and req.logprob is not None and req.logprob.start >= 0 and not req.output_ids:
                limit = min(limit, max(req.logprob.start - 1, 0))  # prompt logprobs need those logits computed
            match = self.tree.match_prefix(req.tokens(0, limit), req.tenant)
            indices, node = match.indices, match.node
            usable = self.hybrid.usable(indices) if self.hybrid is not None else len(indices)
            if usable < len(indices):  # the window there lost its SWA pages (engine.cache.swa_hybrid); no tail
                limit, indices = usable, indices[:usable]
            self.tree.lock(node)
            if self.hierarchy is not None:
                self.hierarchy.on_match(match)
                loaded = self.hierarchy.load_back(match) if match.host_nodes else None
                if loaded is not None:
                    req.host_loaded_tokens = len(loaded[0])
                    indices = torch.cat([indices, loaded[0]])
                    self.tree.lock(loaded[1])
                    self.tree.unlock(node)
                    node = loaded[1]
                self.hierarchy.forget(req)
            req.locked_node = node
            self.req_to_token.write(row, 0, indices)
            req.kv_len = req.alloc_len = req.tree_len = len(indices)
            # (not for a PD decode side's whole prompt: its KV arrives in whole pages after the tree's prefix)
            if self.tails is not None and not whole_prompt and limit > req.tree_len:
                self._take_tail(req, node, limit)
        if self.hybrid is not None:
            self.hybrid.hold(req)
        return True

    def _take_tail(self, req: Req, node, limit: int) -> None:
        """After the tree's match (ending at `node`): the next tokens from a tail, into the request's first page."""
        start = req.tree_len
        got = self.tails.take(node, req.tokens(start, min(limit, start + self.page - 1)))
        if got is None:
            return
        page, n, pending = got
        self.req_to_token.write(req.pool_idx, start, page * self.page + torch.arange(n, dtype=torch.int64))
        req.kv_len = req.alloc_len = start + n
        if pending is not None:
            req.host_loaded_tokens += n
            req.tail_load = (pending, page)

    def count_hit(self, req: Req) -> None:
        """Add an admitted request's prompt and the cached prefix its admission found to the hit counters."""
        self.lookup_tokens += len(req.input_ids)
        self.hit_tokens["device"] += req.kv_len - req.host_loaded_tokens
        self.hit_tokens["host"] += req.host_loaded_tokens

    def hit_counts(self) -> dict:
        """The prefix-cache counters (monotonic): lookup_tokens, device_hit_tokens, host_loaded_hit_tokens."""
        return {"lookup_tokens": self.lookup_tokens, "device_hit_tokens": self.hit_tokens["device"],
                "host_loaded_hit_tokens": self.hit_tokens["host"]}

    # ---- allocation -----------------------------------------------------------------------------------------
    def alloc_tokens(self, req: Req, n: int) -> torch.Tensor | None:
        """Allocate slots for tokens [alloc_len, alloc_len + n) of `req`, evicting if needed. Returns the slots
        (host int64 [n]) or None, allocating nothing, when memory is short. Under a sliding window the request's
        pages behind it are freed first (the next chunk of a chunked prefill reads none of them)."""
        self.slide([req])
        start = req.alloc_len
        need = self.pages_for(start, n)
        if not self.ensure_free_pages(need):
            return None
        in_last = min((-start) % self.page, n)
        parts = []
        if in_last:
            last = int(self.req_to_token.host[req.pool_idx, start - 1])
            parts.append(torch.arange(last + 1, last + 1 + in_last, dtype=torch.int64))
        if need:
            pages = self.alloc_pages(need)
            if self.hybrid is not None:
                self.hybrid.hold_pages(pages)
            slots = (pages[:, None] * self.page + torch.arange(self.page)).reshape(-1)
            parts.append(slots[: n - in_last])
        slots = torch.cat(parts) if len(parts) > 1 else parts[0]
        self.req_to_token.write(req.pool_idx, start, slots)
        req.alloc_len = start + n
        return slots

    def settle(self) -> None:
        """Under a sliding window, the pages running requests slid behind it before the last schedule go back to
        the pool (engine.cache.swa); nothing otherwise. The scheduler calls it as each schedule begins."""
        if self.swa is not None:
            self.swa.settle()

    def slide(self, reqs: list[Req]) -> None:
        """Under a sliding window (every layer slides), free the pages of `reqs` their next queries no longer see;
        under a hybrid pool, those pages' SWA partners (engine.cache.swa_hybrid); nothing otherwise. Called before a
        decode step's memory check, so those pages count as free."""
        if self.swa is not None:
            self.swa.slide(reqs)
        if self.hybrid is not None:
            self.hybrid.slide(reqs)

    def alloc_decode(self, reqs: list[Req]) -> torch.Tensor | None:
        """One slot per request at its alloc_len (a decode step), in one vectorized pass and one device write.
        Returns the slots (host int64 [len(reqs)]) or None, allocating nothing, when memory is short."""
        rows = torch.tensor([r.pool_idx for r in reqs], dtype=torch.int64)
        pos = torch.tensor([r.alloc_len for r in reqs], dtype=torch.int64)
        fresh = pos % self.page == 0  # the next token starts a new page
        n_fresh = int(fresh.sum())
        if not self.ensure_free_pages(n_fresh):
            return None
        slots = self.req_to_token.host[rows, (pos - 1).clamp(min=0)] + 1
        if n_fresh:
            pages = self.alloc_pages(n_fresh)
            if self.hybrid is not None:
                self.hybrid.hold_pages(pages)
            slots[fresh] = pages * self.page
        self.req_to_token.scatter(rows, pos, slots)
        for r in reqs:
            r.alloc_len += 1
        return slots

    def alloc_spans(self, reqs: list[Req], counts: list[int]) -> torch.Tensor | None:
        """Slots for tokens [alloc_len, alloc_len + counts[i]) of each request (a count may be 0; every request
        holds a slot already), in one vectorized pass and one table write: a speculative step's drafts. Returns
        the slots (host int64, concatenated in batch order) or None, allocating nothing, when memory is short."""
        n = torch.tensor(counts, dtype=torch.int64)
        total = int(n.sum())
        if total == 0:
            return torch.empty(0, dtype=torch.int64)
        ends = n.cumsum(0)
        begins = ends - n
        rows = torch.tensor([r.pool_idx for r in reqs], dtype=torch.int64).repeat_interleave(n)
        index = torch.arange(total)
        pos = torch.tensor([r.alloc_len for r in reqs], dtype=torch.int64).repeat_interleave(n) + \
            index - begins.repeat_interleave(n)
        fresh = pos % self.page == 0  # the token starts a new page
        n_fresh = int(fresh.sum())
        if not self.ensure_free_pages(n_fresh):
            return None
        # runs of consecutive slots start at a fresh page or at a request's first new token (after its last slot)
        starts = fresh.clone()
        starts[begins[n > 0]] = True
        at = starts.nonzero().squeeze(1)
        base = torch.empty(len(at), dtype=torch.int64)
        new_page = fresh[at]
        if n_fresh:
            base[new_page] = self.alloc_pages(n_fresh) * self.page
        after = at[~new_page]
        base[~new_page] = self.req_to_token.host[rows[after], pos[after] - 1] + 1
        run = starts.long().cumsum(0) - 1
        slots = base[run] + index - at[run]
        self.req_to_token.scatter(rows, pos, slots)
        for r, c in zip(reqs, counts):
            r.alloc_len += c
        return slots

    def trim(self, req: Req, length: int, freed: list[torch.Tensor] | None = None) -> None:
        """Shrink the request's allocation to its first `length` tokens (kv_len <= length <= alloc_len): the pages
        wholly past it go back to the pool (a speculative verify's rejected drafts); slots after it in its last
        page stay the request's, for its next tokens. `freed`: collects those pages' slots instead, for one
        `free_trimmed` over a whole step (nothing may allocate in between)."""
        if not req.kv_len <= length <= req.alloc_len:
            raise ValueError(f"request {req.rid}: cannot trim to {length} tokens (kv_len {req.kv_len}, "
                             f"alloc_len {req.alloc_len})")
        keep = -(-length // self.page) * self.page
        if keep < req.alloc_len:
            slots = self.req_to_token.read(req.pool_idx, keep, req.alloc_len)
            if freed is None:
                self._free_slots(slots)
            else:
                freed.append(slots.clone())
        req.alloc_len = length

    def free_trimmed(self, freed: list[torch.Tensor]) -> None:
        """The pages `trim` collected go back to the pool."""
        if freed:
            self._free_slots(torch.cat(freed))
            freed.clear()

    def pages_of(self, req: Req, start: int, end: int) -> list[int]:
        """The pages holding tokens [start, end) of `req` (start page-aligned), in token order."""
        return (self.req_to_token.read(req.pool_idx, start, end)[::self.page] // self.page).tolist()

    def slots_of_new_tokens(self, reqs: list[Req]) -> torch.Tensor:
        """KV slots of tokens [kv_len, kv_len + extend_len) of each request, concatenated (host int64)."""
        if all(r.extend_len == 1 for r in reqs):
            rows = torch.tensor([r.pool_idx for r in reqs], dtype=torch.int64)
            return self.req_to_token.host[rows, torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)]
        return torch.cat([self.req_to_token.read(r.pool_idx, r.kv_len, r.kv_len + r.extend_len) for r in reqs])

    # ---- release --------------------------------------------------------------------------------------------
    def _insert_computed(self, req: Req, held: bool = False) -> int:
        """Insert the request's computed, page-aligned KV into the tree and free its duplicate slots.
        Returns the aligned length now owned by the tree. Only tokens the host knows can key the tree: with
        overlap scheduling the KV of an in-flight token (one past fill_len) may be computed already. `held`: the
        request goes on over the tree's pages (a hybrid pool's window references move to them)."""
        aligned = min(req.kv_len, req.fill_len) // self.page * self.page
        if self.tree is None or aligned <= req.tree_len or (self.swa is not None and self.swa.slid(req)):
            return req.tree_len  # (a slid request's prefix lacks freed pages: the tree keeps complete ones only)
        slots = self.req_to_token.read(req.pool_idx, 0, aligned).clone()
        already = self.tree.insert(req.tokens(0, aligned), slots, req.tenant)
        if self.hybrid is not None:
            self.hybrid.inserted(req, slots, already, held)
        if already > req.tree_len:
            self._free_slots(slots[req.tree_len:already])
        added = self.tree.take_added()
        if self.hierarchy is not None:
            self.hierarchy.after_insert(added)
        elif self.events is not None:
            for node in added:
                self.events.stored(Tier.DEVICE, node.page_keys, self.tree.last_key(node.parent), node.key)
        return aligned

    def cache_unfinished(self, req: Req) -> None:
        """Share a running request's computed prefix through the tree; the request keeps using it under a lock.
        (Under a sliding window: not once the request has freed pages of its own, engine.cache.swa.)"""
        if self.tree is None:
            return
        aligned = self._insert_computed(req, held=True)
        if aligned == req.tree_len:
            return
        indices, node, _ = self.tree.match_prefix(req.tokens(0, aligned), req.tenant)
        assert len(indices) == aligned, "a just-inserted prefix must match in full"
        self.req_to_token.write(req.pool_idx, 0, indices)
        self.tree.lock(node)
        self.tree.unlock(req.locked_node)
        req.locked_node, req.tree_len = node, aligned

    def release(self, req: Req) -> None:
        """Give back everything `req` holds: its computed prefix goes to the tree (evictable), the rest is freed.
        Used for finished, aborted and retracted requests alike."""
        if self.hierarchy is not None:
            self.hierarchy.forget(req)
        if req.pool_idx is None:
            return
        if self.hybrid is not None:
            self.hybrid.release(req)
        owned_from = self._insert_computed(req)
        live_from = owned_from if self.swa is None else self.swa.live_from(req, owned_from)
        tail = self.req_to_token.read(req.pool_idx, live_from, req.alloc_len)
        kept = None
        if req.tail_load is not None:
            pending, page = req.tail_load
            req.tail_load = None
            if not pending.done():  # released before its forward: a load still writes the page, freed once done
                self.tails.defer([pending], [page])
                kept = page
        if kept is None and live_from == owned_from:
            kept = self._keep_tail(req, owned_from, tail)
        if kept is not None:
            tail = tail[tail // self.page != kept]
        self._free_slots(tail)
        if req.locked_node is not None:
            self.tree.unlock(req.locked_node)
        self.req_to_token.free(req.pool_idx)
        req.pool_idx, req.locked_node = None, None
        req.kv_len = req.alloc_len = req.tree_len = 0

    def _keep_tail(self, req: Req, owned_from: int, slots: torch.Tensor) -> int | None:
        """Keep the request's computed, partly filled page after what the tree owns as a tail; returns its page."""
        end = min(req.kv_len, req.fill_len)
        if self.tails is None or end <= owned_from or end - owned_from >= self.page or not len(slots):
            return None
        match = self.tree.match_prefix(req.tokens(0, owned_from), req.tenant, touch=False)
        if len(match.indices) != owned_from:
            return None
        page = int(slots[0]) // self.page
        return page if self.tails.keep(match.node, req.tokens(owned_from, end), page) else None

    def tier_stats(self) -> dict:
        """Per-tier sizes, hits and measured speeds (tokens/s; 0 until measured) for load reports."""
        h = self.hierarchy
        if h is None:
            return {}
        out = {"host_total_tokens": h.host.capacity_tokens, "host_cached_tokens": self.tree.host_size,
               "host_hit_tokens": h.hit_tokens["host"], "storage_hit_tokens": h.hit_tokens["storage"],
               "host_load_tokens_per_s": h.host_load_tokens_per_s}
        if h.io is not None:
            # a best_effort worker does not wait for its L3 pages: routers should not count on them
            out["storage_load_tokens_per_s"] = h.io.fetch_tokens_per_s if h.prefetch_policy != "best_effort" else 0.0
            out.update({f"storage_{k}": v for k, v in h.io.stats.items()})
        return out

    def kv_snapshot(self) -> tuple[int, list]:
        """(the event sequence now, a STORED event per node and tier): the whole cache as KV events. Scheduler
        thread only, so no event can slip between the snapshot and its sequence number."""
        from radixmesh.engine.cache.kv_events import EventKind, KvEvent

        if self.events is None or self.tree is None:
            return 0, []
        out = []
        for node in self.tree.nodes():  # parents first, as the events' chaining needs
            for tier, held in ((Tier.DEVICE, node.on_device), (Tier.HOST, node.on_host)):
                if held and node.page_keys:
                    out.append(KvEvent(0, EventKind.STORED, tier, tuple(node.page_keys),
                                       self.tree.last_key(node.parent), tuple(node.key), self.page))
        return self.events.sequence, out

    def issue_loads(self) -> list | None:
        """Called by the model runner as a forward starts (ModelRunner.kv_loads): issue the host -> device loads that
        admissions queued, and return the CUDA events that forward's layer l waits for (None: nothing to wait
        for). Nothing may read a loaded page before this."""
        return self.hierarchy.mover.take_ready() if self.hierarchy is not None else None

    def poll(self) -> None:
        """Once per scheduler step: finish tier copies and storage jobs that are done; a new eviction epoch
        (RadixTree.begin_epoch)."""
        if self.tree is not None:
            self.tree.begin_epoch()
        if self.hybrid is not None:
            self.hybrid.new_epoch()
        if self.hierarchy is not None:
            self.hierarchy.poll()
        if self.tails is not None:
            self.tails.poll()

    def flush(self) -> bool:
        """Drop the whole prefix cache (every tier of this worker; not the shared L3 store). Refused (False) while
        any request holds a lock in it. Pages slid behind a sliding window go back to the pool first (the scheduler
        flushes only with no step in flight)."""
        self.settle()
        if self.tree is not None:
            if self.hierarchy is not None:
                self.hierarchy.drain()
            if self.tree.protected_size:
                return False
            if self.tails is not None:
                self.tails.clear()
            if self.hierarchy is not None:
                self.hierarchy.release_all()
            self._free_slots(self.tree.reset())
            if self.events is not None:
                self.events.cleared()
        return True
