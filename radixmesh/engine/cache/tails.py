"""Tails: the partly filled last page of a finished sequence, kept beside the radix tree for the next turn.

The tree holds whole pages only, so when a request ends, the KV of its last, partly filled page (up to page_size - 1
tokens: with 64-token pages, most of a 64-token answer) used to be freed, and the conversation's next turn computed
those tokens again. The cache manager now keeps that page as a tail of the tree node its tokens follow, keyed by the
tokens themselves. A later request whose match ends at that node and whose next tokens begin with some of the tail's
gets them copied into the first page of its own: from the tail's device page (a device-to-device copy of those slots
in every layer, one launch) or, when only the host tier holds the tail, by a host -> device load of the page into a
fresh page (issued by the request's forward, like the tree's loads). The tail stays for others; the request owns its
copy. Tails never enter the tree, the KV events or the L3 store (they are not whole pages).

Lifetimes: a tail's device page is evictable and goes before any tree node (`evict_device`); with a host tier it is
backed up at creation (write_through) or when evicted (the other policies), and its host page goes before any tree
node's host copy (`evict_host`). Both go when the tail's node leaves the tree, and at a flush. A page a copy still
reads or writes is freed only once that copy is done (`poll`).
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field

import torch

from radixmesh.engine.cache.radix_tree import TreeNode


@dataclass(slots=True, eq=False)
class Tail:
    node: TreeNode
    tokens: tuple[int, ...]  # 1 .. page_size - 1 tokens following node's last token
    page: int | None  # device page holding their KV in its first len(tokens) slots
    host_page: int | None = None
    copies: list = field(default_factory=list)  # Pendings of copies reading or writing its pages


class TailCache:
    """Owned by the cache manager (engine.cache.manager.CacheManager), which calls it from admit, release, eviction,
    poll and flush. `hierarchy` (engine.cache.hierarchy.CacheHierarchy or None) gives tails a host tier."""

    def __init__(self, manager):
        self.m = manager
        self.page = manager.page
        self._device: collections.OrderedDict[Tail, None] = collections.OrderedDict()  # LRU first
        self._host: collections.OrderedDict[Tail, None] = collections.OrderedDict()
        self._busy: set[Tail] = set()  # tails with copies in flight
        self._deferred: list[tuple[list, list[int], list[int]]] = []  # (copies, device pages, host pages)
        self._pinned: Tail | None = None  # the tail `take` is copying from: eviction leaves it alone

    @property
    def evictable_pages(self) -> int:
        """Device pages eviction can take now (a tail whose backup is still running waits for it)."""
        return len(self._device) - sum(1 for t in self._busy if t.page is not None)

    def held_device_pages(self) -> list[int]:
        """Every device page tails hold, or wait to free (for accounting checks)."""
        return [t.page for t in self._device] + [p for _, dev, _ in self._deferred for p in dev]

    def tails(self) -> list[Tail]:
        """Every live tail (for checks)."""
        return list({**dict.fromkeys(self._device), **dict.fromkeys(self._host)})

    # ---- keep -----------------------------------------------------------------------------------------------------
    def keep(self, node: TreeNode, tokens: list[int], page: int) -> bool:
        """Make device page `page` (its first len(tokens) slots hold their KV) a tail of `node`. False when `node`
        already covers those tokens (a tail with them, or more, or a child starting with them): the caller frees it."""
        key = tuple(tokens)
        for child in node.children.values():
            if tuple(child.key[:len(key)]) == key:
                return False
        tails = node.tails if node.tails is not None else {}
        for other in list(tails.values()):
            if other.tokens[:len(key)] == key:
                self._touch(other)
                return False
            if key[:len(other.tokens)] == other.tokens:  # the new one holds the old one's tokens and more
                self._drop(other)
        tail = Tail(node, key, page)
        tails[key] = tail
        node.tails = tails
        self._device[tail] = None
        h = self.m.hierarchy
        if h is not None and h.write_policy == "write_through":
            self._back_up(tail)
        return True

    def _back_up(self, tail: Tail):
        """Queue a copy of the tail's device page to a new host page (tracked in tail.copies); its Pending, or None
        when the host has no room."""
        h = self.m.hierarchy
        pages = h._alloc_host(1)
        if pages is None or tail.page is None:  # (making room on the host may drop this tail's node, and it)
            if pages is not None:
                h._free_host(pages * self.page)
            return None
        pending = h.mover.to_host([tail.page], pages.tolist())
        tail.host_page = int(pages[0])
        self._host[tail] = None
        self._track(tail, pending)
        return pending

    def _track(self, tail: Tail, pending) -> None:
        tail.copies.append(pending)
        self._busy.add(tail)

    # ---- take -----------------------------------------------------------------------------------------------------
    def take(self, node: TreeNode, tokens: list[int]) -> tuple[int, int, object] | None:
        """For a request whose cached prefix ends at `node`, followed by `tokens` (those it may take from the cache):
        (its new device page, holding the first n of them, n, the load's Pending or None) from the tail sharing
        most of them, or None. The page is the caller's."""
        if node.tails is None or not tokens:
            return None
        best, n = None, 0
        for tail in node.tails.values():
            k = _common(tail.tokens, tokens)
            if k > n and (tail.page is not None or tail.host_page is not None):
                best, n = tail, k
        if best is None or (best.page is None and self.m.hierarchy is None):
            return None
        self._pinned = best
        try:
            if not self.m.ensure_free_pages(1):
                return None
        finally:
            self._pinned = None
        dest = int(self.m.alloc_pages(1)[0])
        pending = None
        if best.page is not None:
            self.m.copy_page_prefix(best.page, dest, n)
        else:
            pending = self.m.hierarchy.mover.to_device([best.host_page], [dest])
            self._track(best, pending)
        self._touch(best)
        return dest, n, pending

    def _touch(self, tail: Tail) -> None:
        if tail in self._device:
            self._device.move_to_end(tail)
        if tail in self._host:
            self._host.move_to_end(tail)

    # ---- eviction -------------------------------------------------------------------------------------------------
    def evict_device(self, pages: int) -> int:
        """Free up to `pages` device pages of tails, least recently used first; returns how many were freed. A tail
        with a host copy stays there (without a host tier, or under write_back, it is copied there first when room
        allows)."""
        victims = []
        for tail in self._oldest(self._device, pages):
            if len(victims) >= pages:
                break
            if not tail.copies and tail is not self._pinned and tail.page is not None:
                victims.append(tail)
        if self.m.hierarchy is not None:  # copies to the host first, all queued, then waited for together
            last = None
            for tail in victims:
                if tail.host_page is None and tail.page is not None:
                    last = self._back_up(tail) or last
            if last is not None:
                last.wait()
                for tail in victims:
                    tail.copies = [p for p in tail.copies if not p.done()]
                    if not tail.copies:
                        self._busy.discard(tail)
        freed = 0
        for tail in victims:
            if tail.page is None or tail.copies:  # dropped meanwhile, or a copy still in flight
                continue
            del self._device[tail]
            self.m.free_pages([tail.page])
            tail.page = None
            freed += 1
            if tail.host_page is None:
                self._forget(tail)
        return freed

    def _oldest(self, lru: collections.OrderedDict, pages: int) -> list[Tail]:
        """Enough of the least recently used tails to free `pages` pages, with the ones eviction skips."""
        return list(itertools.islice(lru, pages + len(self._busy) + 1))

    def evict_host(self, pages: int) -> int:
        """Free up to `pages` host pages of tails, least recently used first; returns how many."""
        freed = 0
        for tail in self._oldest(self._host, pages):
            if freed >= pages:
                break
            if tail.copies or tail is self._pinned or tail.host_page is None:
                continue
            del self._host[tail]
            self.m.hierarchy._free_host(torch.tensor([tail.host_page * self.page], dtype=torch.int64))
            tail.host_page = None
            freed += 1
            if tail.page is None:
                self._forget(tail)
        return freed

    # ---- removal --------------------------------------------------------------------------------------------------
    def node_removed(self, node: TreeNode) -> None:
        """`node` left the tree: its tails go with it."""
        for tail in list((node.tails or {}).values()):
            self._drop(tail)

    def _drop(self, tail: Tail) -> None:
        """Forget a tail and free its pages (once the copies touching them are done)."""
        dev, host = [], []
        if tail.page is not None:
            self._device.pop(tail, None)
            dev.append(tail.page)
        if tail.host_page is not None:
            self._host.pop(tail, None)
            host.append(tail.host_page)
        tail.page = tail.host_page = None
        self._forget(tail)
        self._busy.discard(tail)
        if tail.copies:
            self._deferred.append((tail.copies, dev, host))
            tail.copies = []
        else:
            self._free(dev, host)

    def _forget(self, tail: Tail) -> None:
        tails = tail.node.tails
        if tails is not None and tails.get(tail.tokens) is tail:
            del tails[tail.tokens]
            if not tails:
                tail.node.tails = None

    def _free(self, dev: list[int], host: list[int]) -> None:
        if dev:
            self.m.free_pages(dev)
        if host:
            self.m.hierarchy._free_host(torch.tensor(host, dtype=torch.int64) * self.page)

    def defer(self, copies: list, dev: list[int], host: list[int] = ()) -> None:
        """Free these pages once these copies are done (`poll`)."""
        self._deferred.append((copies, list(dev), list(host)))

    # ---- per step, flush ----------------------------------------------------------------------------------------
    def poll(self) -> None:
        """Drop finished copies; free pages that waited for them."""
        for tail in list(self._busy):
            tail.copies = [p for p in tail.copies if not p.done()]
            if not tail.copies:
                self._busy.discard(tail)
        if self._deferred:
            still = []
            for copies, dev, host in self._deferred:
                if all(p.done() for p in copies):
                    self._free(dev, host)
                else:
                    still.append((copies, dev, host))
            self._deferred = still

    def clear(self) -> None:
        """Drop every tail (a flush), waiting for copies in flight."""
        for tail in {*self._device, *self._host}:
            for pending in tail.copies:
                pending.wait()
            tail.copies = []
            self._drop(tail)
        self._busy.clear()
        for copies, dev, host in self._deferred:
            for pending in copies:
                pending.wait()
            self._free(dev, host)
        self._deferred = []


def _common(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
