"""RadixTree: matching, splitting, page alignment, lock accounting, LRU eviction, and a randomized reference check."""

import random

import pytest
import torch

from radixmesh.engine.cache.radix_tree import RadixTree


def slots(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


def check_invariants(tree: RadixTree) -> None:
    """Structural invariants: sizes add up, locks are monotone along paths, edges are page-aligned and indexed."""
    total = protected = 0
    for node in tree._nodes():
        if node is tree.root or node.parent is tree.root:  # the tree's root and the namespace roots
            continue
        assert len(node.key) > 0 and len(node.key) % tree.page == 0
        assert len(node.value) == len(node.key)
        assert node.parent.children[tuple(node.key[:tree.page])] is node
        assert node.lock_ref >= 0
        if node.lock_ref > 0 and node.parent.parent is not tree.root:
            assert node.parent.lock_ref >= node.lock_ref
        total += len(node.key)
        protected += len(node.key) if node.lock_ref > 0 else 0
    assert tree.evictable_size + tree.protected_size == total
    assert tree.protected_size == protected
    assert tree.evictable_size >= 0


@pytest.mark.parametrize("page", [1, 4])
def test_insert_then_match_returns_inserted_slots(page):
    tree = RadixTree(page)
    key = list(range(10, 22))
    assert tree.insert(key, slots(100, 12)) == 0
    assert tree.match_prefix(key).indices.tolist() == list(range(100, 112))
    assert tree.match_prefix(key + [7] * page).indices.tolist() == list(range(100, 112))
    res = tree.match_prefix([99] * 8)
    assert len(res.indices) == 0 and res.node is tree.ns_root("")
    assert len(tree.match_prefix([]).indices) == 0
    assert tree.total_size == 12 and tree.evictable_size == 12
    check_invariants(tree)


@pytest.mark.parametrize("page,query_len,expect", [(1, 5, 5), (4, 5, 4), (4, 8, 8), (2, 7, 6)])
def test_match_ending_inside_a_node_splits_it(page, query_len, expect):
    tree = RadixTree(page)
    key = list(range(12))
    tree.insert(key, slots(50, 12))
    res = tree.match_prefix(key[:query_len] + [999] * 4)
    assert res.indices.tolist() == list(range(50, 50 + expect))
    assert len(res.node.key) == expect and res.node.parent is tree.ns_root("")
    assert len(res.node.children) == 1
    assert tree.match_prefix(key).indices.tolist() == list(range(50, 62))
    assert tree.total_size == 12
    check_invariants(tree)


@pytest.mark.parametrize("page,shared,expect", [(1, 5, 5), (4, 5, 4), (4, 8, 8), (4, 3, 0)])
def test_insert_sharing_a_prefix_returns_shared_length(page, shared, expect):
    tree = RadixTree(page)
    a = list(range(12))
    b = a[:shared] + [100 + i for i in range(12 - shared)]
    tree.insert(a, slots(0, 12))
    assert tree.insert(b, slots(200, 12)) == expect
    assert tree.match_prefix(a).indices.tolist() == list(range(12))
    assert tree.match_prefix(b).indices.tolist() == list(range(expect)) + list(range(200 + expect, 212))
    assert tree.total_size == 24 - expect
    check_invariants(tree)


@pytest.mark.parametrize("page", [1, 4])
def test_reinsert_keeps_existing_slots(page):
    tree = RadixTree(page)
    key = list(range(8))
    tree.insert(key, slots(0, 8))
    assert tree.insert(key, slots(500, 8)) == 8
    assert tree.insert(key[:4], slots(600, 4)) == 4
    assert tree.match_prefix(key).indices.tolist() == list(range(8))
    assert tree.total_size == 8
    check_invariants(tree)


def test_page_alignment():
    tree = RadixTree(4)
    with pytest.raises(AssertionError):
        tree.insert(list(range(7)), slots(0, 7))
    tree.insert(list(range(8)), slots(0, 8))
    assert tree.match_prefix(list(range(7))).indices.tolist() == [0, 1, 2, 3]
    assert tree.match_prefix(list(range(3))).indices.tolist() == []
    assert tree.match_prefix([0, 1, 2, 9, 4, 5, 6, 7]).indices.tolist() == []
    check_invariants(tree)


@pytest.mark.parametrize("page", [1, 4])
def test_lock_unlock_moves_sizes_along_path_and_across_splits(page):
    tree = RadixTree(page)
    a = list(range(12))
    tree.insert(a, slots(0, 12))
    node = tree.match_prefix(a).node
    tree.lock(node)
    assert (tree.protected_size, tree.evictable_size) == (12, 0)
    b = a[:4] + [77] * 8
    assert tree.insert(b, slots(100, 12)) == 4  # splits the locked node after 4 tokens
    assert (tree.protected_size, tree.evictable_size) == (12, 8)
    check_invariants(tree)
    shared = tree.match_prefix(b[:4]).node
    assert shared is node.parent and shared.lock_ref == 1
    tree.lock(tree.match_prefix(b).node)
    assert shared.lock_ref == 2 and (tree.protected_size, tree.evictable_size) == (20, 0)
    tree.unlock(node)
    assert node.lock_ref == 0 and shared.lock_ref == 1
    assert (tree.protected_size, tree.evictable_size) == (12, 8)
    check_invariants(tree)
    tree.match_prefix(b[:8] + [5] * 4)  # splits the other locked leaf in the middle
    check_invariants(tree)
    tree.unlock(tree.match_prefix(b).node)
    assert (tree.protected_size, tree.evictable_size) == (0, 20)
    check_invariants(tree)
    with pytest.raises(AssertionError):
        tree.unlock(node)


def test_lock_of_root_is_a_noop():
    tree = RadixTree(1)
    tree.insert([1, 2], slots(0, 2))
    tree.lock(tree.root)
    tree.unlock(tree.root)
    assert (tree.protected_size, tree.evictable_size) == (0, 2)


def test_evict_lru_leaf_first():
    tree = RadixTree(1)
    tree.insert([1, 1, 1], slots(10, 3))
    tree.insert([2, 2], slots(20, 2))
    tree.insert([3, 3, 3, 3], slots(30, 4))
    tree.match_prefix([1, 1, 1])  # [2, 2] is now least recently used, then [3, 3, 3, 3]
    assert tree.evict(1).tolist() == [20, 21]
    assert tree.evict(2).tolist() == [30, 31, 32, 33]
    assert tree.total_size == 3 and tree.match_prefix([1, 1, 1]).indices.tolist() == [10, 11, 12]
    assert tree.evict(100).tolist() == [10, 11, 12]
    assert tree.total_size == 0 and len(tree.evict(5)) == 0
    check_invariants(tree)


def test_evict_touch_through_split_keeps_recent_part():
    tree = RadixTree(1)
    tree.insert([1, 2, 3, 4], slots(0, 4))
    tree.insert([9, 9], slots(90, 2))
    tree.match_prefix([1, 2])  # splits [1..4]; the upper half is now newest, the lower half keeps its old time
    assert tree.evict(3).tolist() == [2, 3, 90, 91]  # [1, 2] became a leaf but is newer than [9, 9]
    assert tree.match_prefix([1, 2, 3]).indices.tolist() == [0, 1]


@pytest.mark.parametrize("page", [1, 4])
def test_evict_never_touches_locked_nodes_and_cascades(page):
    tree = RadixTree(page)
    p = page
    base = [5] * (2 * p)
    tree.insert(base + [1] * p, slots(0, 3 * p))
    tree.insert(base + [2] * p, slots(100, 3 * p))
    tree.insert([7] * p, slots(200, p))
    locked = tree.match_prefix(base + [1] * p).node
    tree.lock(locked)
    freed = tree.evict(10_000)
    assert sorted(freed.tolist()) == list(range(100 + 2 * p, 100 + 3 * p)) + list(range(200, 200 + p))
    assert tree.match_prefix(base + [1] * p).indices.tolist() == list(range(3 * p))
    assert (tree.protected_size, tree.evictable_size) == (3 * p, 0)
    tree.unlock(locked)
    assert sorted(tree.evict(3 * p).tolist()) == list(range(3 * p))  # the leaf, then its parent, now a leaf
    assert tree.total_size == 0 and tree.root.children == {}
    check_invariants(tree)


def test_evict_stops_once_enough_is_freed():
    tree = RadixTree(1)
    tree.insert([1, 2, 3], slots(0, 3))
    tree.insert([1, 2, 4], slots(10, 3))
    freed = tree.evict(1)
    assert len(freed) == 1 and tree.total_size == 3
    assert len(tree.evict(2)) == 3 and tree.total_size == 0


@pytest.mark.parametrize("page", [1, 4])
def test_reset_returns_every_value(page):
    tree = RadixTree(page)
    rng = random.Random(1)
    expect, nxt = [], 0
    for _ in range(20):
        key = [rng.randrange(3) for _ in range(rng.randrange(1, 5) * page)]
        already = tree.insert(key, slots(nxt, len(key)))
        expect += list(range(nxt + already, nxt + len(key)))
        nxt += len(key)
    tree.lock(tree.match_prefix(key).node)
    assert sorted(tree.reset().tolist()) == sorted(expect)
    assert (tree.evictable_size, tree.protected_size) == (0, 0)
    assert len(tree.match_prefix(key).indices) == 0 and len(tree.reset()) == 0


class Reference:
    """Map from each cached page-aligned prefix (a tuple) to the slots of its last page."""

    def __init__(self, page: int):
        self.page, self.pages = page, {}

    def insert(self, key, value) -> int:
        already = None
        for end in range(self.page, len(key) + 1, self.page):
            if tuple(key[:end]) not in self.pages:
                already = end - self.page if already is None else already
                self.pages[tuple(key[:end])] = value[end - self.page:end].tolist()
        return len(key) if already is None else already

    def match(self, key) -> list[int]:
        out = []
        for end in range(self.page, len(key) + 1, self.page):
            if tuple(key[:end]) not in self.pages:
                break
            out += self.pages[tuple(key[:end])]
        return out

    def values(self) -> set[int]:
        return {s for v in self.pages.values() for s in v}


@pytest.mark.parametrize("page", [1, 2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_randomized_against_reference(page, seed):
    rng = random.Random(seed * 10 + page)
    tree, ref = RadixTree(page), Reference(page)
    bases = [[rng.randrange(4) for _ in range(24)] for _ in range(4)]
    held, nxt = [], 0

    def rand_key(aligned):
        n = rng.randrange(0, 24)
        n = n // page * page if aligned else n
        key = list(rng.choice(bases)[:n])
        for _ in range(rng.randrange(3)):
            if key:
                key[rng.randrange(len(key))] = rng.randrange(4)
        return key

    for _ in range(400):
        op = rng.random()
        if op < 0.35:
            key = rand_key(aligned=True)
            assert tree.insert(key, slots(nxt, len(key))) == ref.insert(key, slots(nxt, len(key)))
            nxt += len(key)
        elif op < 0.6:
            key = rand_key(aligned=False)
            assert tree.match_prefix(key).indices.tolist() == ref.match(key)
        elif op < 0.72:
            key = rand_key(aligned=False)
            res = tree.match_prefix(key)
            tree.lock(res.node)
            held.append((res.node, key[:len(res.indices)]))
        elif op < 0.84 and held:
            tree.unlock(held.pop(rng.randrange(len(held)))[0])
        elif op < 0.98:
            locked = {tuple(k[:e]) for _, k in held for e in range(page, len(k) + 1, page)}
            want, before = rng.randrange(1, 12), tree.evictable_size
            freed = set(tree.evict(want).tolist())
            assert len(freed) >= min(want, before) and tree.evictable_size == before - len(freed)
            gone = {p for p, v in ref.pages.items() if freed & set(v)}
            assert not gone & locked
            assert freed == {s for p in gone for s in ref.pages[p]}
            for p in gone:
                del ref.pages[p]
            assert all(p[:-page] in ref.pages for p in ref.pages if len(p) > page)
        else:
            assert set(tree.reset().tolist()) == ref.values()
            ref.pages, held = {}, []
        check_invariants(tree)
        assert tree.total_size == len(ref.pages) * page
        locked = {tuple(k[:e]) for _, k in held for e in range(page, len(k) + 1, page)}
        assert tree.protected_size == len(locked) * page
    for node, _ in held:
        tree.unlock(node)
    assert tree.protected_size == 0
    assert sorted(tree.reset().tolist()) == sorted(ref.values())


def test_evictions_within_an_epoch_walk_the_tree_once_and_keep_lru_order(monkeypatch):
    """Within an epoch (CacheManager.poll starts one per scheduler step) the eviction order is built by one walk of
    the tree and reused: many small evictions stay least-recently-used first, a parent left a leaf by an eviction
    is offered in its turn, and a leaf that was locked when the order was built (so is not in it) is still found
    once the reused order runs out."""
    tree = RadixTree(1)
    for i in range(6):
        tree.insert([i + 1] * 3, slots(10 * i, 3))
    tree.insert([1, 1, 1, 9, 9], slots(100, 5))  # [9, 9] under [1, 1, 1]: the newest leaf
    held = tree.match_prefix([6, 6, 6]).node
    tree.lock(held)
    walks = []
    real = RadixTree._nodes
    monkeypatch.setattr(RadixTree, "_nodes", lambda self: walks.append(1) or real(self))
    tree.begin_epoch()
    assert tree.evict(1).tolist() == [10, 11, 12]  # [2, 2, 2]: [1, 1, 1] has a child, so is no leaf
    assert len(walks) == 1
    got = [tree.evict(1).tolist() for _ in range(5)]
    assert got == [[20, 21, 22], [30, 31, 32], [40, 41, 42], [103, 104], [0, 1, 2]], \
        "LRU order, then [1, 1, 1] once its child [9, 9] went"
    assert len(walks) == 1, "later evictions of the epoch reused the order"
    tree.unlock(held)  # [6, 6, 6] is a leaf now, but not in the epoch's order
    assert tree.evict(1).tolist() == [50, 51, 52]
    assert len(walks) == 2, "the reused order ran out and the tree was walked again"
    assert tree.total_size == 0
    check_invariants(tree)
