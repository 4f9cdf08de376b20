"""CacheManager over a tiny KVPool: prefix sharing, page filling, eviction, flush, failure cleanup and a stress test.

Simulated "KV" for token i of a sequence is a rolling hash of tokens [0, i] plus the position, written to layer 0's K,
so a slot that is shared wrongly or reused while still in use shows up as wrong content."""

import random

import pytest
import torch

from radixmesh.engine.cache.kv_pool import KVPool
from radixmesh.engine.cache.manager import CacheManager
from radixmesh.engine.cache.radix_tree import RadixTree
from radixmesh.engine.cache.req_to_token import ReqToTokenPool
from radixmesh.engine.request import Req
from radixmesh.engine.sampling.params import SamplingParams


def make(page: int, num_pages: int, rows: int = 8, row_len: int = 64, tree: bool = True) -> CacheManager:
    kv = KVPool(num_pages, page, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                device=torch.device("cpu"))
    return CacheManager(kv, ReqToTokenPool(rows, row_len, torch.device("cpu")), RadixTree(page) if tree else None)


def new_req(ids, rid="r") -> Req:
    return Req(rid=rid, input_ids=list(ids), sampling=SamplingParams(), stop_ids=frozenset(), sink=lambda out: None)


def expected_kv(ids: list[int]) -> list[tuple[float, float]]:
    out, h = [], 0
    for i, t in enumerate(ids):
        h = (h * 31 + t + 1) % 1_000_003
        out.append((float(h), float(i)))
    return out


def compute(cm: CacheManager, req: Req, upto: int) -> None:
    """Pretend a forward computed tokens [kv_len, upto) of fill_ids: write their KV and advance kv_len. A forward
    first issues the host loads admissions queued (ModelRunner.kv_loads)."""
    assert upto <= req.alloc_len
    cm.issue_loads()
    locs = cm.req_to_token.read(req.pool_idx, req.kv_len, upto)
    kv = torch.tensor(expected_kv(req.fill_ids)[req.kv_len:upto]).reshape(-1, 1, 2)
    cm.kv.write(0, locs, kv, kv)
    req.kv_len = upto


def prefill(cm: CacheManager, req: Req) -> None:
    assert cm.admit(req)
    assert cm.alloc_tokens(req, req.fill_len - req.alloc_len) is not None
    compute(cm, req, req.alloc_len)


def check_kv(cm: CacheManager, req: Req) -> None:
    """The request's KV as a forward would read it (after issuing queued host loads) is its sequence's."""
    cm.issue_loads()
    got = cm.kv.k[0][cm.req_to_token.read(req.pool_idx, 0, req.kv_len)].reshape(-1, 2).tolist()
    assert got == [list(x) for x in expected_kv(req.fill_ids)[:req.kv_len]]


def check_accounting(cm: CacheManager, reqs) -> None:
    """free + request-owned + tree pages == all pages, disjointly; rows are page-contiguous; cached KV is right."""
    p = cm.page
    free = cm.pages.free_pages().tolist()
    assert len(free) == len(set(free)) and 0 not in free
    tree_slots = cm.tree.device_values().tolist() if cm.tree else []
    assert len(tree_slots) == len(set(tree_slots))
    for node in cm.tree.nodes() if cm.tree else []:
        v = node.value.tolist()
        assert all(s % p == i % p and s // p == v[i - i % p] // p for i, s in enumerate(v))
    tree_pages = {s // p for s in tree_slots}
    assert len(tree_slots) == len(tree_pages) * p
    owned = []
    for r in reqs:
        assert r.tree_len <= r.kv_len <= r.alloc_len <= r.fill_len and r.tree_len % p == 0
        row = cm.req_to_token.read(r.pool_idx, 0, r.alloc_len).tolist()
        for i, s in enumerate(row):
            assert s % p == i % p and s // p == row[i - i % p] // p
        assert set(row[:r.tree_len]) <= set(tree_slots)
        owned += sorted({s // p for s in row[r.tree_len:]})
        check_kv(cm, r)
    assert len(owned) == len(set(owned)) and not set(owned) & tree_pages
    tail_pages = cm.tails.held_device_pages() if cm.tails else []
    assert len(tail_pages) == len(set(tail_pages)) and not set(tail_pages) & (set(owned) | tree_pages)
    used = set(owned) | tree_pages | set(tail_pages)
    assert not used & set(free) and used | set(free) == set(range(1, cm.pages.num_pages + 1))
    assert cm.tree is None or cm.tree.total_size == len(tree_slots)
    check_tails(cm)


def path_tokens(node) -> list[int]:
    keys = []
    while node is not None:
        keys.append(node.key)
        node = node.parent
    return [t for key in reversed(keys) for t in key]


def check_tails(cm: CacheManager) -> None:
    """Each tail hangs off a node of the tree, and its device page holds the KV of its tokens after that node's."""
    if cm.tails is None:
        return
    for tail in cm.tails.tails():
        assert tail.node.tails[tail.tokens] is tail and 0 < len(tail.tokens) < cm.page
        node = tail.node
        while node.parent is not None and node.parent.parent is not None:  # reachable: the node is in the tree
            assert node.parent.children[cm.tree._edge(node.key, 0)] is node
            node = node.parent
        if tail.page is not None:
            ids = path_tokens(tail.node) + list(tail.tokens)
            slots = tail.page * cm.page + torch.arange(len(tail.tokens))
            got = cm.kv.k[0][slots].reshape(-1, 2).tolist()
            assert got == [list(x) for x in expected_kv(ids)[-len(tail.tokens):]]


def assert_no_leak(cm: CacheManager) -> None:
    assert cm.flush() and cm.pages.num_free == cm.pages.num_pages
    assert sorted(cm.pages.free_pages().tolist()) == list(range(1, cm.pages.num_pages + 1))
    assert cm.req_to_token.num_free == len(cm.req_to_token.host)


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("tree", [True, False])
def test_requests_with_decode_release_without_leak(page, tree):
    cm = make(page, 80, tree=tree)
    reqs = [new_req(list(range(10)) + [50 + i] * (i + 1), rid=str(i)) for i in range(4)]
    for r in reqs:
        prefill(cm, r)
        cm.cache_unfinished(r)
        check_accounting(cm, reqs[: reqs.index(r) + 1])
    for step in range(6):
        for r in reqs:
            r.output_ids.append(step)
            assert cm.alloc_tokens(r, 1) is not None
            compute(cm, r, r.alloc_len)
            if step % 2:
                cm.cache_unfinished(r)
        check_accounting(cm, reqs)
    for i, r in enumerate(reqs):
        cm.release(r)
        assert r.pool_idx is None and r.locked_node is None and r.alloc_len == 0
        check_accounting(cm, reqs[i + 1:])
    cm.release(reqs[0])  # a second release is a no-op
    assert_no_leak(cm)


@pytest.mark.parametrize("page,shared,tail,expect", [(1, 7, 5, 7), (4, 7, 5, 4), (4, 9, 5, 8), (2, 9, 5, 8),
                                                      (1, 12, 0, 11), (4, 12, 0, 8), (4, 8, 0, 4), (1, 1, 0, 0)])
def test_shared_prefix_is_reused_page_aligned_without_last_token(page, shared, tail, expect):
    cm = make(page, 40)
    a = new_req(list(range(12)))
    prefill(cm, a)
    a_slots = cm.req_to_token.read(a.pool_idx, 0, 12).tolist()
    cm.release(a)
    b = new_req(list(range(shared)) + [100] * tail)
    assert cm.match_len(b.fill_ids) == expect
    assert cm.admit(b) and b.tree_len == b.kv_len == b.alloc_len == expect
    assert cm.req_to_token.read(b.pool_idx, 0, expect).tolist() == a_slots[:expect]
    assert cm.alloc_tokens(b, b.fill_len - expect) is not None
    compute(cm, b, b.fill_len)
    check_accounting(cm, [b])
    cm.release(b)
    assert_no_leak(cm)


def test_alloc_fills_partial_last_page_first():
    cm = make(4, 10)
    r = new_req(range(20))
    assert cm.admit(r)
    first = cm.alloc_tokens(r, 5).tolist()
    assert cm.pages.num_free == 8
    p, q = first[0] // 4, first[4] // 4
    assert first == [4 * p, 4 * p + 1, 4 * p + 2, 4 * p + 3, 4 * q] and p != q
    assert cm.alloc_tokens(r, 2).tolist() == [4 * q + 1, 4 * q + 2] and cm.pages.num_free == 8
    nxt = cm.alloc_tokens(r, 2).tolist()
    assert nxt[0] == 4 * q + 3 and nxt[1] % 4 == 0 and cm.pages.num_free == 7 and r.alloc_len == 9
    compute(cm, r, 9)
    check_accounting(cm, [r])
    cm.release(r)
    # two whole pages go to the tree; the third, holding token 8 only, stays as a tail of them
    assert cm.tree.total_size == 8 and cm.pages.num_free == 7 and cm.tails.held_device_pages() == [nxt[1] // 4]
    check_accounting(cm, [])
    assert_no_leak(cm)


@pytest.mark.parametrize("page", [1, 4])
def test_eviction_and_failed_alloc(page):
    cm = make(page, 4)
    old, new = new_req([1] * page), new_req([5] * page)
    for r in (old, new):
        prefill(cm, r)
        cm.release(r)
    assert cm.tree.total_size == 2 * page and cm.pages.num_free == 2
    b = new_req([2] * (2 * page + 1))
    assert cm.admit(b) and b.tree_len == 0
    assert cm.alloc_tokens(b, 2 * page + 1) is not None  # one page must come from the tree: the LRU one
    assert cm.pages.num_free == 0 and cm.tree.total_size == page
    assert [len(cm.tree.match_prefix(r.input_ids).indices) for r in (old, new)] == [0, page]
    compute(cm, b, 2 * page + 1)
    check_accounting(cm, [b])
    c = new_req([3] * (2 * page + 1))
    assert cm.admit(c) and cm.available_tokens() == page
    before = cm.req_to_token.read(c.pool_idx, 0, 8).clone()
    assert cm.alloc_tokens(c, page + 1) is None
    assert c.alloc_len == 0 and torch.equal(cm.req_to_token.read(c.pool_idx, 0, 8), before)
    assert cm.pages.num_free == 1 and cm.tree.total_size == 0
    check_accounting(cm, [b, c])
    assert cm.alloc_tokens(c, page) is not None and cm.pages.num_free == 0
    assert cm.alloc_tokens(b, page) is None and b.alloc_len == 2 * page + 1
    cm.release(c)
    cm.release(b)
    assert_no_leak(cm)


@pytest.mark.parametrize("page", [1, 4])
def test_flush_refused_while_a_lock_is_held(page):
    cm = make(page, 20)
    a = new_req(range(3 * page))
    prefill(cm, a)
    cm.cache_unfinished(a)
    assert a.tree_len == 3 * page and not cm.flush() and cm.tree.total_size == 3 * page
    cm.release(a)
    b, c = new_req(range(3 * page + 1)), new_req([9] * (2 * page + 1))
    assert cm.admit(b) and b.tree_len == 3 * page and not cm.flush()
    cm.release(b)
    assert cm.admit(c) and c.tree_len == 0 and cm.alloc_tokens(c, 2 * page + 1) is not None
    assert cm.flush() and cm.tree.total_size == 0  # c matched nothing, so it holds no lock in the tree
    compute(cm, c, 2 * page + 1)
    cm.release(c)
    assert cm.tree.total_size == (2 * page + 1) // page * page
    assert_no_leak(cm)


@pytest.mark.parametrize("page", [1, 2])
def test_single_token_prompt_is_cached_while_decoding(page):
    cm = make(page, 20)
    r = new_req([5])
    prefill(cm, r)
    for step in range(3):
        r.output_ids.append(6 + step)
        cm.cache_unfinished(r)
        assert r.tree_len == r.kv_len // page * page and cm.tree.protected_size == r.tree_len
        assert cm.alloc_tokens(r, 1) is not None
        compute(cm, r, r.alloc_len)
        check_accounting(cm, [r])
    cm.release(r)
    assert cm.tree.total_size == 4
    assert_no_leak(cm)


@pytest.mark.parametrize("page,chunk,computed,cached", [(4, 0, 6, 4), (4, 0, 0, 0), (1, 0, 6, 6), (4, 0, 9, 8),
                                                        (4, 8, 11, 8), (1, 5, 5, 5)])
def test_release_after_failed_forward_frees_uncomputed(page, chunk, computed, cached):
    cm = make(page, 20)
    r = new_req(range(20))
    assert cm.admit(r)
    if chunk:  # an earlier chunk was computed and cached, then the next forward failed
        assert cm.alloc_tokens(r, chunk) is not None
        compute(cm, r, chunk)
        cm.cache_unfinished(r)
        assert r.tree_len == chunk and cm.tree.protected_size == chunk
    assert cm.alloc_tokens(r, 16 - r.alloc_len) is not None
    compute(cm, r, computed)
    check_accounting(cm, [r])
    cm.release(r)
    assert cm.tree.total_size == cached and cm.tree.protected_size == 0
    tail = 1 if computed % page else 0  # computed tokens past the last whole page stay as a tail
    assert cm.pages.num_free == 20 - cached // page - tail and len(cm.tails.held_device_pages() if cm.tails else []) == tail
    assert cm.match_len(list(range(20))) == cached
    check_accounting(cm, [])
    assert_no_leak(cm)


@pytest.mark.parametrize("page", [1, 4])
def test_duplicate_prefixes_are_freed(page):
    cm = make(page, 30)
    n = 4 * page
    a, b = new_req(list(range(n)) + [7], "a"), new_req(list(range(n)) + [8, 9], "b")
    for r in (a, b):
        prefill(cm, r)
    assert a.tree_len == b.tree_len == 0
    cm.cache_unfinished(a)
    cm.cache_unfinished(b)
    a_len, b_len = a.kv_len // page * page, b.kv_len // page * page
    assert (a.tree_len, b.tree_len) == (a_len, b_len)
    assert cm.req_to_token.read(b.pool_idx, 0, n).tolist() == cm.req_to_token.read(a.pool_idx, 0, n).tolist()
    check_accounting(cm, [a, b])
    cm.release(a)
    cm.release(b)
    assert cm.tree.total_size == n + (a_len - n) + (b_len - n)
    assert_no_leak(cm)


@pytest.mark.parametrize("page", [1, 2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_randomized_stress(page, seed):
    rng = random.Random(seed * 7 + page)
    cm = make(page, 24, rows=6, row_len=128)
    bases = [[rng.randrange(50) for _ in range(30)] for _ in range(3)]
    active: list[Req] = []
    for step in range(500):
        op = rng.random()
        if op < 0.3 and cm.req_to_token.num_free:
            ids = rng.choice(bases)[: rng.randrange(1, 30)] + [rng.randrange(50) for _ in range(rng.randrange(4))]
            r = new_req(ids, rid=str(step))
            assert cm.admit(r)
            assert r.tree_len == cm.match_len(r.fill_ids) and r.tree_len < r.fill_len
            active.append(r)
        elif op < 0.85 and active:
            r = rng.choice(active)
            left = r.fill_len - r.kv_len
            if left == 0:
                r.output_ids.append(rng.randrange(50))
                left = 1
            n = rng.randrange(1, left + 1)
            alloc_before = r.alloc_len
            if cm.alloc_tokens(r, n) is None:
                assert cm.tree.evictable_size == 0 and cm.pages.num_free < cm.pages_for(r.alloc_len, n)
                assert r.alloc_len == alloc_before
                check_accounting(cm, active)
                cm.release(r)
                active.remove(r)
            elif rng.random() < 0.1:
                cm.release(r)  # the forward failed: nothing of this chunk was computed
                active.remove(r)
            else:
                compute(cm, r, r.alloc_len)
                if rng.random() < 0.5:
                    cm.cache_unfinished(r)
        elif active:
            r = active.pop(rng.randrange(len(active)))
            ids, aligned = r.fill_ids, r.kv_len // page * page
            cm.release(r)
            assert len(cm.tree.match_prefix(ids[:aligned]).indices) == aligned
        check_accounting(cm, active)
        if step % 50 == 49:
            locked = cm.tree.protected_size > 0
            assert cm.flush() != locked and (locked or cm.tree.total_size == 0)
            check_accounting(cm, active)
    for r in active:
        cm.release(r)
    assert_no_leak(cm)


@pytest.mark.parametrize("page", [1, 4])
def test_alloc_decode_matches_one_by_one_allocation(page):
    """The vectorized decode allocation hands out the same slots as per-request alloc_tokens(req, 1)."""
    layouts = []
    for vectorized in (True, False):
        cm = make(page, num_pages=64)
        reqs = [new_req(range(10 * i + 1, 10 * i + 1 + n), rid=str(i)) for i, n in enumerate([3, 4, 5, 8])]
        for r in reqs:
            prefill(cm, r)
        for _ in range(6):
            if vectorized:
                assert cm.alloc_decode(reqs) is not None
            else:
                for r in reqs:
                    assert cm.alloc_tokens(r, 1) is not None
        layouts.append([cm.req_to_token.read(r.pool_idx, 0, r.alloc_len).tolist() for r in reqs])
        for r in reqs:
            cm.release(r)
        assert cm.flush() and cm.pages.num_free == cm.pages.num_pages
    assert layouts[0] == layouts[1]


def test_alloc_decode_fails_cleanly_when_pages_run_out():
    cm = make(2, num_pages=4, tree=False)
    reqs = [new_req([1, 2], rid="a"), new_req([3, 4], rid="b")]
    for r in reqs:
        prefill(cm, r)
    assert cm.alloc_decode(reqs) is not None  # pages 3 and 4
    free_before, lens = cm.pages.num_free, [r.alloc_len for r in reqs]
    assert cm.alloc_decode(reqs) is not None  # fills the second slot of those pages
    assert cm.alloc_decode(reqs) is None  # two fresh pages needed, none left
    assert cm.pages.num_free == free_before == 0 and [r.alloc_len for r in reqs] == [n + 1 for n in lens]


@pytest.mark.parametrize("page", [1, 4])
def test_alloc_spans_gives_each_request_what_alloc_tokens_would(page):
    """One vectorized allocation of several requests' drafts (counts 0 included) lays out slots as request-by-request
    alloc_tokens does (continuing each last page, then fresh pages), writes the table, and refuses, allocating
    nothing, when the pool is short; trimmed drafts come back in one free."""
    import random

    rng = random.Random(page)
    twins = [make(page, 64, rows=6), make(page, 64, rows=6)]
    groups = []
    for cm in twins:
        reqs = [new_req([1 + i] * (3 + 2 * i), rid=f"r{i}") for i in range(5)]
        for r in reqs:
            prefill(cm, r)
        groups.append(reqs)
    counts = [rng.randrange(0, 7) for _ in range(5)]
    counts[2] = 0
    spans = twins[0].alloc_spans(groups[0], counts).tolist()
    one_by_one = [twins[1].alloc_tokens(r, c).tolist() if c else [] for r, c in zip(groups[1], counts)]
    assert spans == [s for part in one_by_one for s in part]
    assert [r.alloc_len for r in groups[0]] == [r.alloc_len for r in groups[1]]
    assert torch.equal(twins[0].req_to_token.host, twins[1].req_to_token.host)
    assert twins[0].pages.num_free == twins[1].pages.num_free
    free_before = twins[0].pages.num_free
    assert twins[0].alloc_spans(groups[0], [64 * page] * 5) is None and twins[0].pages.num_free == free_before
    freed: list[torch.Tensor] = []
    for r in groups[0]:
        twins[0].trim(r, r.kv_len, freed)
    twins[0].free_trimmed(freed)
    for r in groups[1]:
        twins[1].trim(r, r.kv_len)
    assert twins[0].pages.num_free == twins[1].pages.num_free
    for cm, reqs in zip(twins, groups):
        for r in reqs:
            cm.release(r)
        assert_no_leak(cm)
