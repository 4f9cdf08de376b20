"""RadixAttention's prefix tree: token ids -> KV slot indices, page-aligned, with lock counts and LRU eviction.

A pure data structure: it never allocates or frees KV memory. `evict` and `reset` hand the slot indices of removed
nodes back to the caller (the cache manager), which frees them.

Invariants:
- every edge key and value has a length that is a multiple of `page_size`, so a node always owns whole pages;
- `lock_ref > 0` on a node implies `lock_ref > 0` on all its ancestors (locks are taken and dropped along the path);
- evictable_size + protected_size == total tokens stored; locked tokens are protected.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch


@dataclass(slots=True, eq=False)
class TreeNode:
    key: list[int]
    value: torch.Tensor  # [len(key)] int64 slot indices
    parent: TreeNode | None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0


class MatchResult(NamedTuple):
    indices: torch.Tensor  # [matched_len] int64 slot indices
    node: TreeNode  # deepest node of the match (the root when nothing matched)


_EMPTY = torch.empty(0, dtype=torch.int64)


def _common_len(a: list[int], b: list[int], page: int) -> int:
    """Length of the longest common prefix of a and b, rounded down to whole pages."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n // page * page
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) // page * page


class RadixTree:
    def __init__(self, page_size: int = 1):
        self.page = page_size
        self.reset()

    def reset(self) -> torch.Tensor:
        """Drop every node; returns the slot indices they held (the caller frees them)."""
        values = self._all_values() if hasattr(self, "root") else _EMPTY
        self.root = TreeNode(key=[], value=_EMPTY, parent=None, lock_ref=1)
        self.evictable_size = 0
        self.protected_size = 0
        self._clock = 0
        return values

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _edge(self, key: list[int], pos: int) -> tuple[int, ...]:
        return tuple(key[pos:pos + self.page])

    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix of `key`. Splits a node when the match ends inside it."""
        key = key[: len(key) // self.page * self.page]
        node, pos, values, now = self.root, 0, [], self._tick()
        while pos < len(key):
            child = node.children.get(self._edge(key, pos))
            if child is None:
                break
            n = _common_len(child.key, key[pos:], self.page)
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            values.append(child.value)
            node, pos = child, pos + n
        indices = torch.cat(values) if values else _EMPTY
        return MatchResult(indices, node)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Insert a page-aligned key with its slots. Returns how many leading tokens were already cached: for those,
        the tree keeps its own slots and the caller's copies in value[:returned] are duplicates it must free."""
        assert len(key) % self.page == 0 and len(key) == len(value), "insert needs page-aligned key and value"
        node, pos, now = self.root, 0, self._tick()
        while pos < len(key):
            child = node.children.get(self._edge(key, pos))
            if child is None:
                new = TreeNode(key=key[pos:], value=value[pos:].clone(), parent=node, last_access=now)
                node.children[self._edge(key, pos)] = new
                self.evictable_size += len(new.key)
                return pos
            n = _common_len(child.key, key[pos:], self.page)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, pos = child, pos + n
        return pos

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after n tokens; returns the new upper node (same lock count as child)."""
        parent = child.parent
        mid = TreeNode(key=child.key[:n], value=child.value[:n], parent=parent, lock_ref=child.lock_ref,
                       last_access=child.last_access)
        child.key, child.value, child.parent = child.key[n:], child.value[n:], mid
        mid.children[self._edge(child.key, 0)] = child
        parent.children[self._edge(mid.key, 0)] = mid
        return mid

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

    def evict(self, num_tokens: int) -> torch.Tensor:
        """Remove least-recently-used unlocked leaves until at least `num_tokens` are removed (or none are left).
        Returns the removed slot indices; the caller frees them."""
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed, removed = [], 0
        while heap and removed < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[self._edge(leaf.key, 0)]
            self.evictable_size -= len(leaf.key)
            removed += len(leaf.key)
            freed.append(leaf.value)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return torch.cat(freed) if freed else _EMPTY

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _leaves(self) -> list[TreeNode]:
        return [n for n in self._nodes() if not n.children and n is not self.root]

    def _all_values(self) -> torch.Tensor:
        values = [n.value for n in self._nodes() if n is not self.root]
        return torch.cat(values) if values else _EMPTY
