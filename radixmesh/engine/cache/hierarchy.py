"""The host (L2) and storage (L3) tiers of the prefix cache: the cache manager's collaborator for everything below
the device pool. It owns the host pool's allocations and frees; the device pool stays with the manager.

- Backups: device pages are copied to the host pool (asynchronously on CUDA; the node stays locked until the copy
  is done). write_through backs up every inserted node at once, write_through_selective a node once it was matched
  twice, write_back only when the device evicts it. Every policy demotes an unbacked node on device eviction when
  the host pool has room (a synchronous copy), so device eviction moves pages down instead of dropping them.
- Loads: a match that continues into host-only nodes gets device pages for them and a copy, queued until the next
  forward issues it (CacheManager.issue_loads): that forward's layers each wait for their own part, so the copy
  overlaps the forward; the host copies stay referenced until the copy is done.
- L3: host copies are written to the store from the storage thread (write_through: as soon as the host has them;
  write_through_selective: hot ones at once; every policy: a copy of each page leaving the host pool, so L3 is
  also the host pool's victim store); a request's pages beyond the device and host
  match are prefetched from the store into host pages when it arrives, and inserted as host-only nodes when they
  land. Prefetch policies: best_effort (never wait), wait_complete (the request waits for its prefetch), timeout
  (waits at most prefetch_timeout_s). Once fetching has been measured slower than prefilling the same tokens, most
  prefetches are skipped: the pages are recomputed instead.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from radixmesh.engine.cache.host_pool import HostKVPool, KVMover, Pending
from radixmesh.engine.cache.kv_events import KvEventLog, Tier
from radixmesh.engine.cache.radix_tree import MatchResult, TreeNode
from radixmesh.engine.cache.storage import PageStorage
from radixmesh.engine.cache.storage_io import JobKind, StorageIO, StorageJob

if TYPE_CHECKING:
    from radixmesh.engine.cache.manager import CacheManager
    from radixmesh.engine.request import Req

log = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
SELECTIVE_HITS = 2
KNOWN_KEYS = 1 << 16  # L3 keys remembered as written, so a page is not sent twice
# Host pages waiting to be written to L3 stay pinned in the host pool; past this backlog new write-backs are skipped
# (those pages are simply not in L3), so a slow store cannot starve the host tier.
MAX_WRITE_BACKLOG_BYTES = 512 << 20
PROBE_EVERY = 16
# The longest a wait_complete prefetch waits for host room that copies and storage writes in flight hold; past it, or
# once nothing is in flight, the request recomputes.
ROOM_WAIT_S = 5.0


@dataclass(slots=True)
class Prefetch:
    rid: str
    namespace: str
    tokens: list[int]  # the prefix up to the last fetched page
    start: int  # tokens the device and host held when the fetch started
    submitted: float
    done: bool = False
    orphan: bool = False  # its request left before the fetch completed


class CacheHierarchy:
    def __init__(self, manager: CacheManager, host_pages: int, write_policy: str, events: KvEventLog | None,
                 storage: Callable[[], PageStorage] | None = None, prefetch_policy: str = "best_effort",
                 prefetch_timeout_s: float = 2.0, skip_slow_fetches: bool = True, host_ranks: int = 1,
                 io_backend: str | None = None, host_replicated: bool = False):
        """`host_ranks`: tensor-parallel ranks whose host pages the store keeps together (this is rank 0's tier);
        `host_replicated`: they keep one copy every rank maps (host_pool.HostKVPool's `replicated`); `io_backend`:
        how loads reach the device (host_pool.KVMover)."""
        assert write_policy in WRITE_POLICIES and prefetch_policy in PREFETCH_POLICIES
        self.m, self.tree, self.page = manager, manager.tree, manager.page
        self.events = events
        self.host = HostKVPool(host_pages, manager.kv, 0, host_ranks, replicated=host_replicated)
        self.mover = KVMover(manager.kv, self.host, io_backend)
        self.write_policy, self.prefetch_policy = write_policy, prefetch_policy
        self.prefetch_timeout_s = prefetch_timeout_s
        self.skip_slow_fetches = skip_slow_fetches
        self.io = StorageIO(storage, self.host) if storage is not None else None
        self._backing: dict[int, tuple[Pending, TreeNode, torch.Tensor]] = {}
        self._loading: list[tuple[Pending, list[tuple[TreeNode, int]]]] = []
        self._known: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.prefetches: dict[str, Prefetch] = {}
        # requests whose prefetch found the host pool full while copies or writes in flight held pages, with the
        # time they stop waiting for room (retried each poll)
        self._roomless: dict[str, tuple[Req, float]] = {}
        self.host_load_tokens_per_s = 0.0
        self.prefill_tokens_per_s: Callable[[], float] = lambda: 0.0  # the scheduler's measurement (set by the engine)
        self._probe = 0
        self.hit_tokens = {"host": 0, "storage": 0}
        # Under tensor parallelism with a store: returns once every rank's copies to the host are done, before the
        # store reads host pages or a host page is freed (a late copy would land in a reused page); the engine sets it.
        self.sync_host: Callable[[], None] = lambda: None

    # ---- host pages -------------------------------------------------------------------------------------------
    def _alloc_host(self, n: int) -> torch.Tensor | None:
        """n host pages, evicting least recently used host copies if needed; None when that is not enough (at once,
        evicting nothing, when the whole pool is smaller than n)."""
        if n > self.host.allocator.num_pages:
            return None
        short = n - self.host.allocator.num_free
        if short > 0 and self.m.tails is not None:
            self.m.tails.evict_host(short)  # tails first: at most a page of tokens each
            short = n - self.host.allocator.num_free
        if short > 0:
            self.sync_host()
            leaves = self.tree.host_leaves()
            while short > 0 and (node := next(leaves, None)) is not None:
                self._write_l3(node, snapshot=True)  # write-back from L2: the store gets what the host drops
                keys = node.page_keys
                slots = self.tree.drop_host(node)
                short -= len(slots) // self.page
                self._free_host(slots)
                if self.events is not None and keys:
                    self.events.removed(Tier.HOST, keys)
        return self.host.allocator.alloc(n)

    def _free_host(self, slots: torch.Tensor) -> None:
        if len(slots):
            self.sync_host()
            self.host.allocator.free(slots[slots % self.page == 0] // self.page)

    def _slots(self, pages: torch.Tensor) -> torch.Tensor:
        return (pages[:, None] * self.page + torch.arange(self.page)).reshape(-1)

    def _pages(self, slots: torch.Tensor) -> list[int]:
        return (slots[::self.page] // self.page).tolist()

    # ---- device -> host -----------------------------------------------------------------------------------------
    def after_insert(self, nodes: list[TreeNode]) -> None:
        for node in nodes:
            self._stored(node, Tier.DEVICE)
            if self.write_policy == "write_through":
                self.backup(node)

    def on_match(self, match: MatchResult) -> None:
        if self.write_policy != "write_through_selective":
            return
        node = match.node
        while node.parent is not None and node.parent.parent is not None:
            if node.hits >= SELECTIVE_HITS and not node.on_host:
                self.backup(node)
            node = node.parent

    def backup(self, node: TreeNode) -> bool:
        """Start copying a device node to the host pool (it stays locked until done). False when no room."""
        if node.on_host or id(node) in self._backing or not node.on_device:
            return node.on_host or id(node) in self._backing
        pages = self._alloc_host(len(node.key) // self.page)
        if pages is None:
            return False
        pending = self.mover.to_host(self._pages(node.value), pages.tolist())
        self.tree.lock(node)
        self._backing[id(node)] = (pending, node, self._slots(pages))
        return True

    def demote(self, node: TreeNode) -> None:
        """Before the device drops `node`: make sure the host holds it, when there is room (synchronous)."""
        if node.on_host:
            return
        pages = self._alloc_host(len(node.key) // self.page)
        if pages is None:
            return
        self.mover.to_host(self._pages(node.value), pages.tolist()).wait()
        self._backed_up(node, self._slots(pages))

    def _backed_up(self, node: TreeNode, host_slots: torch.Tensor) -> None:
        self.tree.set_host(node, host_slots)
        self._stored(node, Tier.HOST)
        if self.write_policy == "write_through" or (self.write_policy == "write_through_selective"
                                                    and node.hits >= SELECTIVE_HITS):
            self._write_l3(node)

    def drop_host_subtree(self, node: TreeNode) -> bool:
        """Drop the host copies of every node below `node` (all host-only: node is a device leaf). False, dropping
        nothing, when a copy still reads one of them."""
        below, stack = [], list(node.children.values())
        while stack:
            n = stack.pop()
            below.append(n)
            stack.extend(n.children.values())
        if any(n.host_refs for n in below):
            return False
        for n in reversed(below):  # children before parents
            keys = n.page_keys
            self._free_host(self.tree.drop_host(n))
            if self.events is not None and keys:
                self.events.removed(Tier.HOST, keys)
        return True

    def _stored(self, node: TreeNode, tier: Tier) -> None:
        if self.events is not None and node.page_keys:
            self.events.stored(tier, node.page_keys, self.tree.last_key(node.parent), node.key)

    # ---- host -> device -----------------------------------------------------------------------------------------
    def load_back(self, match: MatchResult) -> tuple[torch.Tensor, TreeNode] | None:
        """Give the match's host-only nodes device pages and start copying them there. Returns their device slots
        and the new deepest device node, or None (nothing loaded) when the device has no room. The caller holds a
        lock on match.node."""
        nodes = match.host_nodes
        refs = [(n, len(n.key)) for n in nodes]
        for n in nodes:
            n.host_refs += 1
        need = match.host_len // self.page
        if not self.m.ensure_free_pages(need):
            self._unref(refs)
            return None
        dev = self.m.pages.alloc(need)
        host_pages = [p for n in nodes for p in self._pages(n.host_value)]
        pending = self.mover.to_device(host_pages, dev.tolist())
        slots, at = self._slots(dev), 0
        for n in nodes:
            self.tree.set_device(n, slots[at:at + len(n.key)])
            at += len(n.key)
            self._stored(n, Tier.DEVICE)
        self._loading.append((pending, refs))
        self.hit_tokens["host"] += match.host_len
        return slots, nodes[-1]

    # ---- per step -------------------------------------------------------------------------------------------------
    def poll(self) -> None:
        """Finish copies that are done and take the storage thread's completions (scheduler thread). Loads queued
        without a forward after them (an admission whose launch failed) are issued here."""
        self.mover.flush()
        for key, (pending, node, slots) in list(self._backing.items()):
            if pending.done():
                del self._backing[key]
                self.tree.unlock(node)
                at = 0
                for piece in self.tree.pieces(node, len(slots)):  # the node may have been split meanwhile
                    part = slots[at:at + len(piece.key)]
                    at += len(piece.key)
                    if piece.on_host:
                        self._free_host(part)
                    else:
                        self._backed_up(piece, part)
        still = []
        for pending, nodes in self._loading:
            if not pending.done():
                still.append((pending, nodes))
                continue
            self._unref(nodes)
            rate = pending.tokens / max(pending.elapsed_s(), 1e-6)
            self.host_load_tokens_per_s = rate if not self.host_load_tokens_per_s else \
                0.8 * self.host_load_tokens_per_s + 0.2 * rate
        self._loading = still
        if self.io is not None:
            for job in self.io.poll():
                self._storage_done(job)
            if self._roomless:
                self._retry_roomless()

    def _unref(self, refs: list[tuple[TreeNode, int]]) -> None:
        """Drop the copy references taken on (node, its length then) pairs, over every piece of each."""
        for node, length in refs:
            for piece in self.tree.pieces(node, length):
                piece.host_refs -= 1

    def busy(self) -> bool:
        return bool(self._backing or self._loading or (self.io is not None and self.io.pending))

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait for every copy and storage job to finish and take their results."""
        for pending, _, _ in self._backing.values():
            pending.wait()
        for pending, _ in self._loading:
            pending.wait()
        if self.io is not None:
            self.io.wait_idle(timeout_s)
        self.poll()

    # ---- L3 -------------------------------------------------------------------------------------------------------
    def _write_l3(self, node: TreeNode, snapshot: bool = False) -> None:
        """Send the node's host pages the store does not have yet. The storage thread reads them from the host pool
        (the node is referenced until then), or, with `snapshot` (the host copy is about to go), from a copy."""
        if self.io is None or not node.page_keys:
            return
        self.sync_host()
        todo = [(k, p) for k, p in zip(node.page_keys, self._pages(node.host_value)) if k not in self._known]
        if not todo:
            return
        if (self.io.write_backlog_pages + len(todo)) * self.host.page_bytes > MAX_WRITE_BACKLOG_BYTES:
            self.io.stats["skipped_write_pages"] += len(todo)  # the store is slower than the writes: skip, as a miss
            return
        keys, pages = [k for k, _ in todo], [p for _, p in todo]
        if snapshot:
            self.io.submit(StorageJob(JobKind.WRITE, [], keys, pages, data=[self.host.read_page(p) for p in pages]))
            return
        node.host_refs += 1
        self.io.submit(StorageJob(JobKind.WRITE, [(node, len(node.key))], keys, pages))

    def start_prefetch(self, req: Req) -> None:
        """Ask the store for the request's pages beyond what the device and host hold (when it arrives). When the
        host pool has no room for them while copies or storage writes in flight hold host pages, wait_complete keeps
        the request waiting for that room, retried at each poll, up to ROOM_WAIT_S; best_effort and timeout (which
        bound the wait for the cache) recompute at once."""
        if self.io is None or req.rid in self.prefetches or req.rid in self._roomless \
                or self._l3_slower_than_prefill():
            return
        if not self._prefetch(req) and self.prefetch_policy == "wait_complete" and self.busy():
            self._roomless[req.rid] = (req, time.monotonic() + ROOM_WAIT_S)

    def _prefetch(self, req: Req) -> bool:
        """Submit the fetch of the request's missing pages into newly allocated host pages; False when the host
        pool had no room for them (True when there was nothing to fetch, or too much to ever fit)."""
        limit = (req.fill_len - 1) // self.page * self.page
        match = self.tree.match_prefix(req.tokens(0, limit), req.tenant, touch=False)
        have = len(match.indices) + match.host_len
        if limit - have < self.page:
            return True
        deepest = match.host_nodes[-1] if match.host_nodes else match.node
        tokens = req.tokens(0, limit)
        keys = self.tree.hasher(self.tree.last_key(deepest), tokens[have:])
        if len(keys) > self.host.allocator.num_pages:
            return True  # more than the whole host pool holds: recompute, without waiting for room
        pages = self._alloc_host(len(keys))
        if pages is None:
            return False
        fetch = Prefetch(req.rid, req.tenant, tokens, have, time.monotonic())
        self.prefetches[req.rid] = fetch
        self.io.submit(StorageJob(JobKind.FETCH, fetch, keys, pages.tolist()))
        return True

    def _retry_roomless(self) -> None:
        """Retry the prefetches that found no host room; give up on those past their wait or with nothing left in
        flight to free room."""
        now = time.monotonic()
        for rid, (req, until) in list(self._roomless.items()):
            if self._prefetch(req) or now >= until or not self.busy():
                del self._roomless[rid]

    def _l3_slower_than_prefill(self) -> bool:
        """Whether fetching from the store has been measured slower than computing the same tokens; then only one
        prefetch in PROBE_EVERY goes ahead (to keep measuring), the rest recompute."""
        fetch, prefill = self.io.fetch_tokens_per_s, self.prefill_tokens_per_s()
        if not self.skip_slow_fetches or not fetch or not prefill or fetch >= prefill:
            return False
        self._probe = (self._probe + 1) % PROBE_EVERY
        if self._probe:
            self.io.stats["skipped_fetches"] += 1
        return self._probe != 0

    def prefetch_ready(self, req: Req) -> bool:
        """Whether the planner may admit `req` now, under the prefetch policy."""
        if req.rid in self._roomless:
            return False  # waiting for host room to fetch into (start_prefetch)
        fetch = self.prefetches.get(req.rid)
        if fetch is None or fetch.done or self.prefetch_policy == "best_effort":
            return True
        if self.prefetch_policy == "timeout":
            return time.monotonic() - fetch.submitted >= self.prefetch_timeout_s
        return False

    def forget(self, req: Req) -> None:
        """The request was admitted or left: its prefetch entry goes (once the fetch completed)."""
        self._roomless.pop(req.rid, None)
        fetch = self.prefetches.get(req.rid)
        if fetch is None:
            return
        if fetch.done:
            del self.prefetches[req.rid]
        else:
            fetch.orphan = True

    def _storage_done(self, job: StorageJob) -> None:
        if job.kind is JobKind.WRITE:
            self._unref(job.token)
            if job.error is None:
                for k in job.keys:
                    self._known[k] = None
                while len(self._known) > KNOWN_KEYS:
                    self._known.popitem(last=False)
            return
        fetch: Prefetch = job.token
        fetch.done = True
        if fetch.orphan:
            self.prefetches.pop(fetch.rid, None)
        pages = torch.tensor(job.host_pages, dtype=torch.int64)
        used = self._insert_fetched(fetch, pages[:job.loaded])
        self._free_host(self._slots(pages[used:]) if used < len(pages) else torch.empty(0, dtype=torch.int64))

    def _insert_fetched(self, fetch: Prefetch, pages: torch.Tensor) -> int:
        """Insert fetched pages after whatever the tree holds now; returns how many leading entries of `pages` the
        tree took (the caller frees the rest). Pages the tree meanwhile got by other means are freed; a gap (the
        tree lost pages before the fetched ones) drops them all."""
        if not len(pages):
            return 0
        end = fetch.start + len(pages) * self.page
        match = self.tree.match_prefix(fetch.tokens[:end], fetch.namespace, touch=False)
        have = len(match.indices) + match.host_len
        if have < fetch.start or have >= end:
            return 0
        skip = (have - fetch.start) // self.page
        if skip:  # pages the tree got meanwhile: free those first, keep the rest in order
            self._free_host(self._slots(pages[:skip]))
            pages = pages[skip:]
        parent = match.host_nodes[-1] if match.host_nodes else match.node
        node = self.tree.insert_host(parent, fetch.tokens[have:end], self._slots(pages))
        self._stored(node, Tier.HOST)
        self.hit_tokens["storage"] += end - have
        for k in node.page_keys or ():
            self._known[k] = None
        return skip + len(pages)

    # ---- flush ------------------------------------------------------------------------------------------------------
    def release_all(self) -> None:
        """Free every host copy (the tree is about to be reset). The caller made sure nothing is in flight."""
        self._free_host(self.tree.host_values())
        self.prefetches.clear()
        self._roomless.clear()

    def close(self) -> None:
        if self.io is not None:
            self.io.close()
