"""RadixAttention's prefix tree: token ids -> KV slot indices, page-aligned, with lock counts, LRU order and tiers.

A pure data structure: it never allocates, frees or copies KV memory. Methods that drop pages hand their slot indices
back to the caller (the cache manager), which frees them.

A node's pages live on the device (`value`: device slot indices), in the host pool (`host_value`: host slot indices),
or both. Without a hierarchical cache every node is on the device only. Sequences are kept apart by namespace (the
tenant): each namespace has its own root under the tree's root, so a match never crosses namespaces.

Invariants:
- every edge key and value has a length that is a multiple of `page_size`, so a node always owns whole pages;
- device residency is prefix-closed: a node without device pages has no descendant with device pages (eviction
  takes device leaves first, a load brings back the whole path);
- every node holds its pages on at least one tier (a node dropped from both is removed from the tree);
- `lock_ref > 0` on a node implies `lock_ref > 0` on all its ancestors, and a locked node is on the device;
- evictable_size + protected_size == device tokens stored; host_size == host tokens stored.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

import numpy as np
import torch


@dataclass(slots=True, eq=False)
class TreeNode:
    key: list[int]
    value: torch.Tensor | None  # [len(key)] int64 device slots; None: not on the device
    parent: TreeNode | None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    host_value: torch.Tensor | None = None  # [len(key)] int64 host slots; None: not in the host pool
    page_keys: list[bytes] | None = None  # chained key of each page (when the tree has a page hasher)
    hits: int = 0  # matches that reached into this node (write_through_selective backs up hot nodes)
    host_refs: int = 0  # copies reading the host copy (a load, an L3 write); > 0 keeps it from host eviction
    namespace: str = ""
    tails: dict | None = None  # partly filled pages that follow this node (engine.cache.tails), keyed by tokens

    @property
    def on_device(self) -> bool:
        return self.value is not None

    @property
    def on_host(self) -> bool:
        return self.host_value is not None


class MatchResult(NamedTuple):
    indices: torch.Tensor  # [device_len] int64 device slots of the matched prefix's device part
    node: TreeNode  # deepest device node of the match (the namespace root when none)
    host_nodes: list[TreeNode] = []  # after `node`: the matched nodes held only in the host pool, in order

    @property
    def host_len(self) -> int:
        return sum(len(n.key) for n in self.host_nodes)


# Hashes a node's pages given the key of the page before them: (parent_key, tokens) -> one key per page.
PageHasher = Callable[[bytes, list[int]], list[bytes]]

_EMPTY = torch.empty(0, dtype=torch.int64)


def _common_len(a: list[int], b: list[int], page: int) -> int:
    """Length of the longest common prefix of a and b, rounded down to whole pages."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n // page * page
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) // page * page


class RadixTree:
    def __init__(self, page_size: int = 1, page_hasher: PageHasher | None = None,
                 namespace_root_key: Callable[[str], bytes] | None = None):
        self.page = page_size
        self.hasher = page_hasher
        self.root_key = namespace_root_key
        self._epochs = False  # begin_epoch was called: eviction order is reused within a step
        self.on_remove: Callable[[TreeNode], None] | None = None  # told of each node that leaves the tree
        self.reset()

    def reset(self) -> torch.Tensor:
        """Drop every node; returns the device slots they held (the caller frees them and the host pool)."""
        values = self.device_values() if hasattr(self, "root") else _EMPTY
        self.root = TreeNode(key=[], value=_EMPTY, parent=None, lock_ref=1)
        self.namespaces: dict[str, TreeNode] = {}
        self.evictable_size = 0
        self.protected_size = 0
        self.host_size = 0
        self._clock = 0
        self.added: list[TreeNode] = []  # nodes that gained a device copy by insert, until take_added()
        self._heaps: dict[str, list] = {}  # eviction order per tier, reused within an epoch (begin_epoch)
        self._parents: dict[str, TreeNode] = {}  # per tier: the parent of the node a walk yielded last
        return values

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _edge(self, key: list[int], pos: int) -> tuple[int, ...]:
        return tuple(key[pos:pos + self.page])

    def ns_root(self, namespace: str) -> TreeNode:
        """The permanent (locked) root of a namespace; created on first use."""
        node = self.namespaces.get(namespace)
        if node is None:
            node = TreeNode(key=[], value=_EMPTY, parent=self.root, lock_ref=1, namespace=namespace)
            if self.root_key is not None:
                node.page_keys = [self.root_key(namespace)]
            self.namespaces[namespace] = node
        return node

    def last_key(self, node: TreeNode) -> bytes:
        """The chained key of the last page of `node` (a namespace root: the namespace's root key)."""
        return node.page_keys[-1]

    # ---- lookups ----------------------------------------------------------------------------------------------
    def match_prefix(self, key: list[int], namespace: str = "", touch: bool = True) -> MatchResult:
        """Longest cached page-aligned prefix of `key`: its device part, then the host-only nodes after it. Splits a
        node when the match ends inside it. `touch`: the match is a use (LRU order and hit counts move); a lookup
        that only measures (load reports, queue ordering, prefetch planning) passes False."""
        key = key[: len(key) // self.page * self.page]
        node, pos, values, now = self.ns_root(namespace), 0, [], self._tick()
        device_node, host_nodes = node, []
        while pos < len(key):
            child = node.children.get(self._edge(key, pos))
            if child is None:
                break
            n = _common_len(child.key, key[pos:], self.page)
            if n < len(child.key):
                child = self._split(child, n)
            if touch:
                child.last_access = now
                child.hits += 1
            if child.on_device:
                values.append(child.value)
                device_node = child
            else:
                host_nodes.append(child)
            node, pos = child, pos + n
        indices = torch.cat(values) if values else _EMPTY
        return MatchResult(indices, device_node, host_nodes)

    # ---- inserts ----------------------------------------------------------------------------------------------
    def insert(self, key: list[int], value: torch.Tensor, namespace: str = "") -> int:
        """Insert a page-aligned key with its device slots. Returns how many leading tokens the device already
        cached: for those the tree keeps its own slots, and the caller's copies in value[:returned] are duplicates it
        must free. Everything after them becomes the tree's: nodes held only in the host pool along the way take
        the caller's slots as their device copy."""
        assert len(key) % self.page == 0 and len(key) == len(value), "insert needs page-aligned key and value"
        node, pos, now, cached = self.ns_root(namespace), 0, self._tick(), None
        while pos < len(key):
            child = node.children.get(self._edge(key, pos))
            if child is None:
                self._add_child(node, key[pos:], value[pos:].clone(), None, now)
                return pos if cached is None else cached
            n = _common_len(child.key, key[pos:], self.page)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            if not child.on_device:
                cached = pos if cached is None else cached
                child.value = value[pos:pos + n].clone()
                self.evictable_size += n
                self.added.append(child)
            node, pos = child, pos + n
        return pos if cached is None else cached

    def insert_host(self, parent: TreeNode, key: list[int], host_value: torch.Tensor,
                    page_keys: list[bytes] | None = None) -> TreeNode:
        """Add pages held only in the host pool (fetched from L3) as a new child of `parent`, which must have no
        child starting with key's first page."""
        assert self._edge(key, 0) not in parent.children, "insert_host over an existing edge"
        return self._add_child(parent, key, None, host_value, self._tick(), page_keys)

    def _add_child(self, parent: TreeNode, key: list[int], value: torch.Tensor | None,
                   host_value: torch.Tensor | None, now: int, page_keys: list[bytes] | None = None) -> TreeNode:
        new = TreeNode(key=key, value=value, parent=parent, last_access=now, host_value=host_value,
                       namespace=parent.namespace)
        if self.hasher is not None:
            new.page_keys = page_keys or self.hasher(self.last_key(parent), key)
        parent.children[self._edge(key, 0)] = new
        if value is not None:
            self.evictable_size += len(key)
            self.added.append(new)
        if host_value is not None:
            self.host_size += len(key)
        return new

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after n tokens; returns the new upper node (same lock count, copy references and tiers
        as child). The `child` object keeps the lower part, so whoever holds it can find the upper part with
        `pieces`."""
        parent, pages = child.parent, n // self.page
        mid = TreeNode(key=child.key[:n], value=None if child.value is None else child.value[:n], parent=parent,
                       lock_ref=child.lock_ref, last_access=child.last_access, hits=child.hits,
                       host_value=None if child.host_value is None else child.host_value[:n],
                       page_keys=None if child.page_keys is None else child.page_keys[:pages],
                       namespace=child.namespace, host_refs=child.host_refs)
        child.key, child.parent = child.key[n:], mid
        if child.value is not None:
            child.value = child.value[n:]
        if child.host_value is not None:
            child.host_value = child.host_value[n:]
        if child.page_keys is not None:
            child.page_keys = child.page_keys[pages:]
        mid.children[self._edge(child.key, 0)] = child
        parent.children[self._edge(mid.key, 0)] = mid
        return mid

    @staticmethod
    def pieces(node: TreeNode, length: int) -> list[TreeNode]:
        """The nodes that now hold the `length` tokens that ended at `node` when it was referenced (splits since
        then put the earlier tokens in new ancestors), top-down."""
        out, total = [], 0
        while total < length:
            out.append(node)
            total += len(node.key)
            node = node.parent
        assert total == length, "pieces do not add up to the referenced length"
        return out[::-1]

    def take_added(self) -> list[TreeNode]:
        """Nodes that gained a device copy through insert since the last call (for KV events and backups)."""
        added, self.added = self.added, []
        return added

    # ---- locks ------------------------------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node.parent is not None:
            assert node.lock_ref > 0, "unlock of an unlocked node"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.parent

    # ---- tiers ------------------------------------------------------------------------------------------------
    def set_device(self, node: TreeNode, value: torch.Tensor) -> None:
        """Give a host-only node its device copy (a load finished or was issued)."""
        assert node.value is None and len(value) == len(node.key)
        node.value = value
        self.evictable_size += len(node.key)

    def set_host(self, node: TreeNode, host_value: torch.Tensor) -> None:
        """Record a node's host copy (a backup was written)."""
        assert node.host_value is None and len(host_value) == len(node.key)
        node.host_value = host_value
        self.host_size += len(node.key)

    def drop_device(self, node: TreeNode) -> torch.Tensor:
        """Forget an unlocked device leaf's device copy; returns its device slots. A node with no host copy is
        removed from the tree."""
        assert node.lock_ref == 0 and node.on_device and not any(c.on_device for c in node.children.values())
        slots, node.value = node.value, None
        self.evictable_size -= len(node.key)
        if not node.on_host:
            self._remove(node)
        return slots

    def drop_host(self, node: TreeNode) -> torch.Tensor:
        """Forget a node's host copy (it must have no child with one); returns its host slots. A node with no
        device copy is removed from the tree."""
        assert node.on_host and not any(c.on_host for c in node.children.values())
        slots, node.host_value = node.host_value, None
        self.host_size -= len(node.key)
        if not node.on_device:
            self._remove(node)
        return slots

    def _remove(self, node: TreeNode) -> None:
        assert not node.children, "only a leaf leaves the tree"
        del node.parent.children[self._edge(node.key, 0)]
        if node.tails is not None and self.on_remove is not None:
            self.on_remove(node)

    def begin_epoch(self) -> None:
        """Start an epoch (the cache manager does, once per scheduler step): within one, the eviction walks below
        order the candidates once and later walks reuse that order. Recency changes made during the epoch are then
        not seen (each yielded node is still checked to be an unlocked leaf of its tier, and a walk that runs out
        orders the tree afresh before it gives up), and a step's many short allocations cost one walk of the tree,
        not one each. Without epochs every walk orders the whole tree."""
        self._epochs = True
        self._heaps.clear()
        self._parents.clear()

    def device_leaves(self) -> Iterator[TreeNode]:
        """Unlocked device leaves, least recently used first. The caller drops each yielded node's device copy (or
        stops); parents that become device leaves are yielded in their turn. Pull the next one only to drop it:
        within an epoch a node yielded and kept is not offered again until the order is rebuilt."""
        return self._leaves(self._is_device_leaf, "device")

    def host_leaves(self) -> Iterator[TreeNode]:
        """Nodes with a host copy and no child holding one, least recently used first; same protocol as
        device_leaves (the caller drops each yielded node's host copy, or stops)."""
        return self._leaves(self._is_host_leaf, "host")

    def _leaves(self, is_leaf: Callable[[TreeNode], bool], tier: str) -> Iterator[TreeNode]:
        heap = self._heaps.get(tier)
        fresh = heap is None
        if fresh:
            heap = self._leaf_heap(is_leaf, tier)
        else:
            self._push_parent(heap, is_leaf, tier)  # the last walk stopped after dropping a node
        while True:
            while heap:
                _, _, node = heapq.heappop(heap)
                if not is_leaf(node):
                    continue
                self._parents[tier] = node.parent
                yield node
                self._push_parent(heap, is_leaf, tier)  # a leaf now that its child went
            if fresh:
                return
            heap, fresh = self._leaf_heap(is_leaf, tier), True  # reused order ran out: the whole tree again

    def _push_parent(self, heap: list, is_leaf: Callable[[TreeNode], bool], tier: str) -> None:
        parent = self._parents.pop(tier, None)
        if parent is not None and is_leaf(parent):
            heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def _leaf_heap(self, is_leaf: Callable[[TreeNode], bool], tier: str) -> list:
        heap = [(n.last_access, id(n), n) for n in self._nodes() if is_leaf(n)]
        heapq.heapify(heap)
        if self._epochs:
            self._heaps[tier] = heap
        return heap

    def _is_device_leaf(self, n: TreeNode) -> bool:
        return (n.parent is not None and n.parent.parent is not None and n.on_device and n.lock_ref == 0
                and not any(c.on_device for c in n.children.values()))

    def _is_host_leaf(self, n: TreeNode) -> bool:
        return (n.parent is not None and n.parent.parent is not None and n.on_host and n.host_refs == 0
                and not any(c.on_host for c in n.children.values()))

    def evict(self, num_tokens: int) -> torch.Tensor:
        """Drop the device copies of least-recently-used unlocked leaves until at least `num_tokens` are dropped
        (or none are left). Returns the dropped device slots; the caller frees them. (A hierarchical cache manager
        walks device_leaves itself, to back pages up before they go.)"""
        freed, removed, leaves = [], 0, self.device_leaves()
        while removed < num_tokens and (leaf := next(leaves, None)) is not None:
            removed += len(leaf.key)
            freed.append(self.drop_device(leaf))
        return torch.cat(freed) if freed else _EMPTY

    # ---- walks ------------------------------------------------------------------------------------------------
    def _nodes(self) -> list[TreeNode]:
        """The root, the namespace roots and every node below them."""
        out, stack = [self.root], list(self.namespaces.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def nodes(self) -> list[TreeNode]:
        """Every node below the namespace roots, parents before children."""
        out, stack = [], list(self.namespaces.values())
        while stack:
            node = stack.pop()
            if node.parent is not self.root:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def device_values(self) -> torch.Tensor:
        values = [n.value for n in self.nodes() if n.on_device]
        return torch.cat(values) if values else _EMPTY

    def host_values(self) -> torch.Tensor:
        values = [n.host_value for n in self.nodes() if n.on_host]
        return torch.cat(values) if values else _EMPTY
