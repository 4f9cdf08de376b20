"""When the sliding layers' KV of a hybrid pool (engine.cache.swa_pool) can go back, and which cached prefixes can
still be used: the cache manager's policy for models that mix sliding and full-attention layers.

The query at position p of a sliding layer with window w sees keys p - w < j <= p. A request's next query is at
position kv_len, so it never again reads keys before kv_len - w + 1. Its row's pages before `swa_from[row]`, the page
of the first key a query at its page-aligned computed length reads (`_window_from`: at most a page earlier, so that
a later hit on the prefix it leaves in the tree finds that window paired), no longer need their SWA partners. Full
layers read every key, so the full pages stay.

Per full page the policy keeps `refs`, the running rows whose window region [swa_from, alloc_len) holds the page, and
`in_tree`, whether the radix tree owns it. Pages leave a window as requests advance (`slide`):
- a page the request owns (table positions >= tree_len, manager.py's layout) loses its partner at once: nothing else
  reads it, and the radix tree only gets it at release, partner-less;
- a page of the tree keeps its partner while any window holds it; once none does, the partner is evictable: it goes
  (least recently used node first, from the front of each node) when the SWA pool is short (`ensure`). The full page
  stays cached, marked by its missing partner.
A partner freed while the step before is still queued is handed out again only to a later step on the same stream, so
nothing reads it rewritten: with a hybrid pool only the compute stream writes KV (no host tier, no PD transfers).

Which cached prefixes a request may use (the rule): a hit of L tokens is computed on from position L, whose window
reads keys from L - w + 1. So every page covering [L - w + 1, L) must have its partner; pages before that may have
lost theirs. `usable` cuts a match back to the longest page-aligned L with that property (0 always qualifies): the
request recomputes what follows, and when it inserts those tokens into the tree, pages the tree holds without
partners take over the request's (`inserted`), so a recomputed window makes the cached path whole again.
"""

from __future__ import annotations

from typing import Callable

import torch

from radixmesh.engine.cache.radix_tree import RadixTree
from radixmesh.engine.cache.req_to_token import ReqToTokenPool
from radixmesh.engine.cache.swa_pool import HybridKVPool
from radixmesh.engine.request import Req


class HybridWindowPages:
    """The cache manager's (the only caller) bookkeeping of SWA partners. `tree`: the radix tree, or None."""

    def __init__(self, pool: HybridKVPool, req_to_token: ReqToTokenPool, page: int, tree: RadixTree | None):
        self.pool, self.table, self.page, self.tree = pool, req_to_token, page, tree
        self.window = pool.layout.window
        self.swa = pool.swa_allocator
        pages = pool.allocator.num_pages + 1
        self.refs = torch.zeros(pages, dtype=torch.int64)  # per full page: windows holding it
        self.in_tree = torch.zeros(pages, dtype=torch.bool)  # per full page: the radix tree owns it
        self.swa_from = torch.zeros(req_to_token.host.shape[0], dtype=torch.int64)  # per row, page-aligned
        self.evictable = 0  # tree pages with a partner that no window holds
        self.freed_tokens = 0  # monotonic: SWA tokens requests gave back behind their windows
        self.evicted_tokens = 0  # monotonic: SWA tokens of cached pages dropped for room
        self._order: list | None = None  # device nodes, most recently used first, for `ensure` within an epoch

    # ---- capacity -------------------------------------------------------------------------------------------
    def available_pages(self) -> int:
        """SWA pages that can be handed out now: free ones and evictable partners."""
        return self.swa.num_free + self.evictable

    def ensure(self, n: int) -> bool:
        """Make n SWA pages free, dropping evictable partners of cached pages (module docstring): nodes least
        recently used first, in an order taken once per epoch (`new_epoch`; nodes made since wait for the next)."""
        short = n - self.swa.num_free
        if short <= 0 or not self.evictable or self.tree is None:
            return short <= 0
        if self._order is None:
            self._order = sorted((x for x in self.tree.nodes() if x.on_device), key=lambda x: x.last_access)
            self._order.reverse()  # popped from the end
        while short > 0 and self._order:
            node = self._order[-1]
            victims = self._victims(node)[:short]  # from the node's front: hits ending at its end keep theirs
            if len(victims) < short:
                self._order.pop()  # nothing more to take from it
            self._drop_partners(victims)
            self.evicted_tokens += len(victims) * self.page
            short -= len(victims)
        return self.swa.num_free >= n

    def _victims(self, node) -> torch.Tensor:
        """The pages of a tree node whose partners `ensure` may drop, in token order."""
        if not node.on_device:
            return torch.empty(0, dtype=torch.int64)
        pages = node.value[::self.page] // self.page
        return pages[self._evictable(pages)]

    def new_epoch(self) -> None:
        """Once per scheduler step (the cache manager's poll): the eviction order is taken afresh when next needed."""
        self._order = None

    # ---- pages --------------------------------------------------------------------------------------------
    def paired(self, full_pages: torch.Tensor) -> None:
        """Fresh full pages (host int64) take SWA partners; `ensure(len(full_pages))` made room."""
        swa = self.swa.alloc(len(full_pages))
        assert swa is not None, "SWA pages allocated without ensure()"
        self.pool.pair(full_pages, swa)

    def freeing(self, full_pages: torch.Tensor) -> None:
        """Full pages go back to the pool: their partners go with them; the tree no longer owns them."""
        if not len(full_pages):
            return
        pages = full_pages.unique()
        assert not self.refs[pages].any(), "a page some window holds is being freed"
        self._tracked(pages, lambda: self.in_tree.index_fill_(0, pages, False))
        self._drop_partners(pages[self.pool.swa_of[pages] > 0])

    def _drop_partners(self, pages: torch.Tensor) -> None:
        self._tracked(pages, lambda: self.swa.free(self.pool.unpair(pages)))

    # ---- requests -----------------------------------------------------------------------------------------------
    def usable(self, indices: torch.Tensor) -> int:
        """The longest page-aligned prefix of a cache match (device slots `indices`) a request may compute on from
        (module docstring)."""
        n = len(indices) // self.page
        if n == 0:
            return 0
        lost = (self.pool.swa_of[indices[::self.page] // self.page] == 0).long()
        if not lost.any():
            return len(indices)
        before = torch.cat([torch.zeros(1, dtype=torch.int64), lost.cumsum(0)])  # [n + 1]: lost pages before j
        ends = torch.arange(n + 1) * self.page
        starts = (ends - self.window + 1).clamp(min=0) // self.page
        ok = (before - before[starts]) == 0
        return int(ends[ok].max())

    def hold(self, req: Req) -> None:
        """An admitted request's row holds its window region (tree pages and a tail's page) from here."""
        row = req.pool_idx
        self.swa_from[row] = self._window_from(req)
        self._ref(self._row_pages(row, int(self.swa_from[row]), req.alloc_len), 1)

    def hold_pages(self, full_pages: torch.Tensor) -> None:
        """Pages just allocated to a running request (inside its window region)."""
        self._ref(full_pages, 1)

    def slide(self, reqs: list[Req]) -> None:
        """Move each request's window region up to its next query's window, in one vectorized pass: its own pages
        left behind lose their partners at once, the tree's become evictable when no other window holds them."""
        reqs = [r for r in reqs if r.pool_idx is not None]
        if not reqs:
            return
        page = self.page
        rows = torch.tensor([r.pool_idx for r in reqs], dtype=torch.int64)
        ends = torch.tensor([self._window_from(r) for r in reqs], dtype=torch.int64)
        starts = self.swa_from[rows]
        n = (ends - starts).clamp(min=0) // page  # pages each region leaves behind
        total = int(n.sum())
        if total == 0:
            return
        firsts = (n.cumsum(0) - n).repeat_interleave(n)
        pos = starts.repeat_interleave(n) + (torch.arange(total) - firsts) * page
        pages = self.table.host[rows.repeat_interleave(n), pos] // page
        self._ref(pages, -1)
        tree_lens = torch.tensor([r.tree_len for r in reqs], dtype=torch.int64).repeat_interleave(n)
        own = pages[(pos >= tree_lens) & (self.pool.swa_of[pages] > 0)]
        self._drop_partners(own)
        self.freed_tokens += len(own) * page
        moved = n > 0
        self.swa_from[rows[moved]] = ends[moved]

    def release(self, req: Req) -> None:
        """The request gives back its row: its window region is no longer held (before the manager inserts its
        prefix and frees the rest)."""
        row = req.pool_idx
        self._ref(self._row_pages(row, int(self.swa_from[row]), req.alloc_len), -1)
        self.swa_from[row] = 0

    def inserted(self, req: Req, slots: torch.Tensor, already: int, held: bool) -> None:
        """The tree took the request's computed prefix `slots` (page-aligned, in row order): pages from `already`
        on are the tree's now; before that, from tree_len, the tree keeps pages of its own (the request's copies are
        freed next). A tree page without a partner takes over the request's copy's; `held`: the row goes on, over
        the tree's pages, so the window's references move to them."""
        own = slots[::self.page] // self.page
        first = req.tree_len // self.page
        fresh = own[already // self.page:]
        self._tracked(fresh, lambda: self.in_tree.index_fill_(0, fresh, True))
        if already <= req.tree_len:
            return
        theirs = self.tree.match_prefix(req.tokens(0, already), req.tenant, touch=False).indices
        theirs = theirs[req.tree_len:already:self.page] // self.page
        mine = own[first:already // self.page]
        if held:
            window = torch.arange(req.tree_len, already, self.page) >= self.swa_from[req.pool_idx]
            self._ref(mine[window], -1)
            self._ref(theirs[window], 1)
        revive = (self.pool.swa_of[theirs] == 0) & (self.pool.swa_of[mine] > 0)
        if revive.any():
            src, dst = mine[revive], theirs[revive]
            self._tracked(torch.cat([src, dst]), lambda: self.pool.move_partners(src, dst))

    # ---- helpers --------------------------------------------------------------------------------------------
    def _window_from(self, req: Req) -> int:
        """Where the request's window region starts: the page holding the first key a query at its page-aligned
        computed length may read. Its next query (at kv_len) and every later one read nothing before it; and a
        later request whose cache hit ends where this request's prefix enters the tree (that aligned length)
        finds every page its window reads paired."""
        end = min(req.kv_len, req.fill_len) // self.page * self.page
        return max(0, end - self.window + 1) // self.page * self.page

    def _row_pages(self, row: int, start: int, end: int) -> torch.Tensor:
        """The full pages of a row's positions [start, end) (start page-aligned)."""
        return self.table.host[row, start:end:self.page] // self.page

    def _evictable(self, pages: torch.Tensor) -> torch.Tensor:
        return self.in_tree[pages] & (self.refs[pages] == 0) & (self.pool.swa_of[pages] > 0)

    def _ref(self, pages: torch.Tensor, delta: int) -> None:
        if len(pages):
            self._tracked(pages.unique(), lambda: self.refs.index_add_(0, pages, torch.full_like(pages, delta)))

    def _tracked(self, pages: torch.Tensor, change: Callable[[], object]) -> None:
        """Apply `change` to the state of `pages` (distinct), keeping the evictable count."""
        before = int(self._evictable(pages).sum())
        change()
        self.evictable += int(self._evictable(pages).sum()) - before

    def check(self, reqs: list[Req]) -> None:
        """Tests: the counts agree with the state, and `reqs` (every request holding a row) are all the refs."""
        pages = torch.arange(len(self.refs))
        assert self.evictable == int(self._evictable(pages).sum()), "evictable count drifted"
        want = torch.zeros_like(self.refs)
        for r in reqs:
            held = self._row_pages(r.pool_idx, int(self.swa_from[r.pool_idx]), r.alloc_len)
            want.index_add_(0, held, torch.ones_like(held))
            assert bool((self.pool.swa_of[held] > 0).all()), f"request {r.rid}: a page in its window lost its partner"
        assert torch.equal(want, self.refs), "window references drifted"
        paired = self.pool.swa_of[self.pool.swa_of > 0]
        assert len(paired) == len(paired.unique()), "an SWA page is the partner of two full pages"
        assert len(paired) + self.swa.num_free == self.swa.num_pages, "SWA pages leaked"
