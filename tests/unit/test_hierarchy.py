"""The cache manager with a host tier: demotion on device eviction, loads back with the right KV, splits of nodes
whose copies are still in flight, host eviction, KV events, and no leaked page on either tier; plus a randomized
stress run against the same checks."""

import random

import pytest
import torch

from radixmesh.engine.cache.hierarchy import CacheHierarchy
from radixmesh.engine.cache.kv_events import EventKind, KvEventLog, Tier
from radixmesh.engine.cache.kv_pool import KVPool
from radixmesh.engine.cache.manager import CacheManager
from radixmesh.engine.cache.page_keys import chain_keys
from radixmesh.engine.cache.radix_tree import RadixTree
from radixmesh.engine.cache.req_to_token import ReqToTokenPool
from tests.unit.test_cache_manager import check_kv, compute, new_req, prefill


def make(page: int, device_pages: int, host_pages: int, policy: str = "write_through") -> CacheManager:
    kv = KVPool(device_pages, page, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                device=torch.device("cpu"))
    tree = RadixTree(page, lambda parent, tokens: chain_keys(parent, tokens, page), lambda ns: b"root:" + ns.encode())
    events = KvEventLog(page)
    cm = CacheManager(kv, ReqToTokenPool(8, 64, torch.device("cpu")), tree, events)
    cm.hierarchy = CacheHierarchy(cm, host_pages, policy, events)
    return cm


def finish(cm: CacheManager, req) -> None:
    cm.release(req)
    cm.poll()


def check_no_leaks(cm: CacheManager) -> None:
    assert cm.flush()
    assert cm.pages.num_free == cm.pages.num_pages
    host = cm.hierarchy.host.allocator
    assert host.num_free == host.num_pages and len(set(host.free_pages().tolist())) == host.num_pages
    assert cm.tree.total_size == 0 and cm.tree.host_size == 0


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_evicted_prefix_comes_back_from_host_with_its_kv(policy):
    page = 2
    cm = make(page, device_pages=8, host_pages=32, policy=policy)
    a = new_req(range(1, 13), "a")
    prefill(cm, a)
    finish(cm, a)
    b = new_req(range(100, 114), "b")  # needs 7 of the 8 device pages: a's pages go to the host
    prefill(cm, b)
    finish(cm, b)
    assert cm.tree.host_size >= 10
    again = new_req(range(1, 13), "a2")
    assert cm.admit(again) and again.tree_len == 10  # the last token is left to compute
    again.kv_len = again.tree_len
    check_kv(cm, again)  # the loaded pages hold a's KV
    finish(cm, again)
    check_no_leaks(cm)


def test_split_of_a_node_whose_backup_is_in_flight():
    cm = make(2, device_pages=16, host_pages=32)
    a = new_req(range(1, 13), "a")
    prefill(cm, a)
    cm.release(a)  # write_through starts a backup of the 12-token node; its completion is taken by poll()
    b = new_req(list(range(1, 7)) + [99] * 6, "b")
    assert cm.admit(b) and b.tree_len == 6  # the match ends inside the node being backed up: it splits
    cm.poll()
    for node in cm.tree.nodes():
        assert node.on_host and len(node.host_value) == len(node.key), "both halves got their host copy"
    finish(cm, b)
    check_no_leaks(cm)


def test_host_eviction_keeps_host_pages_bounded_and_events_follow():
    cm = make(2, device_pages=6, host_pages=8)
    for i in range(6):
        r = new_req(range(10 * i + 1, 10 * i + 11), f"r{i}")
        prefill(cm, r)
        finish(cm, r)
    host = cm.hierarchy.host.allocator
    assert cm.tree.host_size <= host.num_pages * 2
    events = cm.events.since(0)
    stored_host = {k for e in events if e.kind is EventKind.STORED and e.tier is Tier.HOST for k in e.page_keys}
    removed_host = {k for e in events if e.kind is EventKind.REMOVED and e.tier is Tier.HOST for k in e.page_keys}
    live_host = {k for n in cm.tree.nodes() if n.on_host for k in n.page_keys}
    assert stored_host - removed_host == live_host, "events describe exactly the pages the host holds"
    check_no_leaks(cm)


@pytest.mark.parametrize("seed", range(4))
def test_randomized_requests_keep_both_tiers_consistent(seed):
    rng = random.Random(seed)
    page = rng.choice([1, 2, 4])
    cm = make(page, device_pages=24 // page, host_pages=40 // page, policy=rng.choice(
        ["write_through", "write_back", "write_through_selective"]))
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(2, 12))] for _ in range(4)]
    for step in range(60):
        ids = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 6))]
        r = new_req(ids, f"s{step}")
        if not cm.admit(r):
            continue
        if cm.alloc_tokens(r, r.fill_len - r.alloc_len) is None:
            cm.release(r)
            continue
        check_kv(cm, r)  # the cached prefix (device or loaded from host) holds this sequence's KV
        compute(cm, r, r.alloc_len)
        check_kv(cm, r)
        finish(cm, r)
        assert cm.tree.protected_size == 0 or cm.hierarchy.busy()
    cm.hierarchy.drain()
    check_no_leaks(cm)


def test_device_leaf_without_host_room_takes_its_l3_children_along():
    """An L3 prefetch can hang host-only pages under a node the host could not back up; evicting that node must drop
    them too (a node with no tier left cannot stay in the tree), and free every page."""
    page = 2
    cm = make(page, device_pages=6, host_pages=1, policy="write_back")
    a = new_req(range(1, 11), "a")
    prefill(cm, a)
    finish(cm, a)  # 10 tokens cached on the device; the one host page cannot back it up
    match = cm.tree.match_prefix(list(range(1, 11)))
    host = cm.hierarchy._alloc_host(1)
    child = cm.tree.insert_host(match.node, [11, 12], cm.hierarchy._slots(host))  # as a fetched L3 page would
    assert not match.node.on_host and child.on_host
    child.host_refs += 1  # an L3 write still reads the child's page: neither it nor its parent may go yet
    b = new_req(range(100, 112), "b")  # needs every device page: only evicting a's node makes room
    assert cm.admit(b)
    assert cm.alloc_tokens(b, b.fill_len) is None, "short of memory, not a broken tree"
    child.host_refs -= 1
    assert cm.alloc_tokens(b, b.fill_len) is not None
    compute(cm, b, b.alloc_len)
    finish(cm, b)
    assert len(cm.tree.match_prefix(list(range(1, 13))).indices) == 0
    check_no_leaks(cm)


def test_prefetches_are_skipped_once_fetching_is_slower_than_prefill():
    from radixmesh.engine.cache.storage import StorageOptions, open_storage

    cm = make(2, device_pages=16, host_pages=32)
    tiers = CacheHierarchy(cm, 128, "write_through", cm.events, lambda: open_storage("memory", StorageOptions()))
    cm.hierarchy = tiers
    try:
        tiers.prefill_tokens_per_s = lambda: 50_000.0
        tiers.io.fetch_tokens_per_s = 5_000.0  # as measured: ten times slower than computing the tokens
        started = 0
        for i in range(32):
            tiers.start_prefetch(new_req(range(1000 + 40 * i, 1040 + 40 * i), f"p{i}"))
            started = len(tiers.prefetches)
        assert started == 2, "one probe in 16 still goes ahead"
        tiers.skip_slow_fetches = False
        tiers.start_prefetch(new_req(range(5000, 5040), "q"))
        assert "q" in tiers.prefetches
    finally:
        tiers.drain()
        tiers.close()


def test_queued_loads_wait_for_the_forward_and_the_last_load_of_a_page_wins():
    """Loads are issued by the next forward (CacheManager.issue_loads), together: until then the device page is
    untouched and the Pending is not done; a device page that two queued loads target (freed and handed out again
    between them) ends up with the later load's bytes, as with copies issued one after the other."""
    cm = make(2, device_pages=8, host_pages=8)
    mover, host = cm.hierarchy.mover, cm.hierarchy.host
    for p in (1, 2, 3):
        host.data[p] = float(p)
    first, second = mover.to_device([1, 2], [4, 5]), mover.to_device([3], [4])
    assert not first.done() and not second.done()
    assert (cm.kv.k[0].view(-1, 2, 1, 2)[4] == 0).all(), "a queued load ran before any forward"
    assert cm.issue_loads() is None  # CPU: synchronous copies, nothing for a layer to wait for
    assert first.done() and second.done()
    pages = cm.kv.k[0].view(-1, 2, 1, 2)
    assert (pages[4] == 3).all() and (pages[5] == 2).all()
    assert first.tokens == second.tokens == 4  # the flush's tokens: both loads' pages, the repeated one once


def test_write_through_backups_go_out_together_at_the_next_poll():
    """A step's backups are queued as its requests insert their pages and issued together (one copy per layer on
    CUDA) by the next poll or forward: until then the nodes stay locked on the device, then every one has its host
    copy, and demoting a node whose backup is still queued never happens (it is locked)."""
    cm = make(2, device_pages=16, host_pages=32)
    a, b = new_req(range(1, 9), "a"), new_req(range(20, 28), "b")
    for r in (a, b):
        prefill(cm, r)
        cm.release(r)
    nodes = [n for n in cm.tree.nodes() if n.on_device]
    assert len(nodes) == 2 and not any(n.on_host for n in nodes)
    assert all(n.lock_ref for n in nodes), "a queued backup keeps its node from eviction"
    assert cm.tree.evict(100).numel() == 0
    cm.poll()
    assert all(n.on_host and n.lock_ref == 0 for n in nodes)
    again = new_req(range(1, 9), "a2")
    assert cm.admit(again) and again.tree_len == 6
    check_kv(cm, again)
    finish(cm, again)
    check_no_leaks(cm)
