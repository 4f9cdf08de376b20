"""Tails (engine.cache.tails): a released request's partly filled last page is kept beside the tree, and a later
request continuing those tokens gets their KV copied into its own first page: from the device, or loaded from the
host tier. The KV every request reads is its sequence's, pages are never shared wrongly or leaked, eviction takes
tails first, and a page a queued load still writes is not handed out again."""

import random

import pytest
import torch

from radixmesh.engine.cache.kv_pool import KVPool
from radixmesh.engine.cache.manager import CacheManager
from radixmesh.engine.cache.radix_tree import RadixTree
from radixmesh.engine.cache.req_to_token import ReqToTokenPool
from tests.unit.test_cache_manager import (assert_no_leak, check_accounting, check_kv, compute, make, new_req,
                                           prefill)
from tests.unit.test_hierarchy import check_no_leaks
from tests.unit.test_hierarchy import make as make_tiers


def turn(cm: CacheManager, prompt: list[int], answer: list[int], rid: str = "r"):
    """A request of `prompt` that decodes `answer` (the last answer token's KV is never computed), then ends."""
    r = new_req(prompt, rid)
    prefill(cm, r)
    for t in answer:
        r.output_ids.append(t)
        if len(r.output_ids) < len(answer):
            assert cm.alloc_tokens(r, 1) is not None
            compute(cm, r, r.alloc_len)
    return r


def finish_and_next(cm: CacheManager, first, extra: list[int], rid: str = "next"):
    """Release `first`; admit a request of its whole sequence plus `extra`."""
    cm.release(first)
    cm.poll()
    nxt = new_req(first.fill_ids + extra, rid)
    assert cm.admit(nxt)
    return nxt


def complete(cm: CacheManager, req) -> None:
    assert cm.alloc_tokens(req, req.fill_len - req.alloc_len) is not None
    compute(cm, req, req.fill_len)


def complete_and_release(cm: CacheManager, reqs) -> None:
    """Compute the rest of each request, check the pages with them running, release them, check again."""
    for r in reqs:
        complete(cm, r)
    check_accounting(cm, reqs)
    for r in reqs:
        cm.release(r)
    check_accounting(cm, [])


def test_the_next_turn_takes_the_tail_and_reads_the_right_kv():
    cm = make(4, 20)
    a = turn(cm, list(range(1, 10)), [50, 51, 52])  # 9 + 3 tokens, KV for 11: 2 whole pages and 3 tokens
    b = finish_and_next(cm, a, [7, 8, 9, 10, 11])
    assert b.tree_len == 8 and b.kv_len == b.alloc_len == 11
    check_kv(cm, b)  # slots 8-10 hold a's KV of tokens 9, 50, 51 (copied into b's own page)
    check_accounting(cm, [b])
    page = int(cm.req_to_token.read(b.pool_idx, 8, 9)[0]) // 4
    assert page not in cm.tails.held_device_pages()  # a copy: the tail keeps its page for others
    complete_and_release(cm, [b])
    assert_no_leak(cm)


def test_a_request_takes_the_tokens_it_shares_with_a_tail():
    cm = make(4, 20)
    a = turn(cm, list(range(1, 10)), [50, 51, 52])
    cm.release(a)
    for extra, shared in (([50, 99, 98], 2), ([99, 98], 1), ([5, 98], 0)):
        prompt = list(range(1, 9)) + ([9] if shared else []) + extra
        r = new_req(prompt, "r")
        assert cm.admit(r)
        assert r.tree_len == 8 and r.kv_len == 8 + shared
        check_kv(cm, r)
        complete_and_release(cm, [r])
    assert_no_leak(cm)


def test_two_requests_share_a_tail_at_once_and_each_writes_its_own_page():
    cm = make(4, 20)
    a = turn(cm, list(range(1, 10)), [50, 51])
    cm.release(a)
    reqs = [new_req(list(range(1, 10)) + [50, 60 + i, 61], str(i)) for i in range(2)]
    for r in reqs:
        assert cm.admit(r) and r.kv_len == 10
    complete_and_release(cm, reqs)
    assert_no_leak(cm)


def test_cached_tokens_count_the_tail_and_a_prompt_of_whole_pages_keeps_none():
    cm = make(4, 20)
    a = turn(cm, list(range(1, 9)), [50])  # 8 tokens of KV: whole pages only
    cm.release(a)
    assert cm.tails.held_device_pages() == []
    b = turn(cm, list(range(1, 9)) + [50, 51], [60, 61])  # computes 8..10 beyond the cached 8
    cm.release(b)
    assert len(cm.tails.held_device_pages()) == 1
    c = new_req(b.fill_ids + [70], "c")
    assert cm.admit(c) and c.kv_len == 11
    cm.count_hit(c)
    assert cm.hit_counts()["device_hit_tokens"] == 11
    cm.release(c)
    assert_no_leak(cm)


def test_eviction_takes_tails_before_tree_pages_and_a_dropped_node_takes_its_tails():
    cm = make(4, 6)
    a = turn(cm, list(range(1, 10)), [50, 51])  # 2 tree pages + a tail
    cm.release(a)
    assert cm.available_tokens() == 6 * 4 and cm.pages.num_free == 3
    b = new_req(range(100, 112), "b")  # 3 pages: the free ones
    prefill(cm, b)
    assert cm.tails.held_device_pages() and cm.tree.total_size == 8
    c_ids = list(range(200, 203))
    c = new_req(c_ids, "c")
    assert cm.admit(c) and cm.alloc_tokens(c, 3) is not None  # one page: the tail's, not the tree's
    assert cm.tails.held_device_pages() == [] and cm.tree.total_size == 8
    compute(cm, c, 3)
    check_accounting(cm, [b, c])
    for r in (b, c):
        cm.release(r)
    a_again = new_req(list(range(1, 10)) + [50, 51, 52], "a2")
    assert cm.admit(a_again) and a_again.kv_len == 8  # the tail went, the tree kept its pages
    cm.release(a_again)
    # a tail whose node leaves the tree goes with it
    d = turn(cm, list(range(300, 307)), [1])
    cm.release(d)
    node_tails = [t for t in cm.tails.tails() if t.node.key[:1] == [300]]
    assert len(node_tails) == 1
    cm.tree.begin_epoch()
    assert cm.ensure_free_pages(cm.pages.num_pages)  # everything goes
    assert cm.tails.tails() == [] and cm.tree.total_size == 0
    assert_no_leak(cm)


def test_a_tail_on_the_host_is_loaded_into_the_next_turns_page():
    cm = make_tiers(4, device_pages=8, host_pages=32)
    a = turn(cm, list(range(1, 10)), [50, 51, 52])
    cm.release(a)
    cm.poll()  # write_through: the backups (the tree's pages and the tail) are issued and done on CPU
    (tail,) = cm.tails.tails()
    assert tail.host_page is not None
    filler = new_req(range(100, 129), "f")  # 8 pages: every device page, so the tail and a's pages leave it
    prefill(cm, filler)
    assert tail.page is None and tail.host_page is not None
    cm.release(filler)
    cm.poll()
    b = new_req(a.fill_ids + [7, 8], "b")
    assert cm.admit(b)
    assert b.tree_len == 8 and b.kv_len == 11 and b.host_loaded_tokens == 11
    check_kv(cm, b)  # after the forward's loads: the tree's pages and the tail's 3 tokens
    complete(cm, b)
    cm.release(b)
    cm.poll()
    check_no_leaks(cm)


def test_write_back_demotes_a_tail_when_it_is_evicted():
    cm = make_tiers(4, device_pages=8, host_pages=32, policy="write_back")
    a = turn(cm, list(range(1, 10)), [50, 51, 52])
    cm.release(a)
    (tail,) = cm.tails.tails()
    assert tail.host_page is None
    assert cm.tails.evict_device(1) == 1 and tail.page is None and tail.host_page is not None
    b = new_req(a.fill_ids + [7], "b")
    assert cm.admit(b) and b.kv_len == 11
    check_kv(cm, b)
    cm.release(b)
    check_no_leaks(cm)


def test_a_page_a_queued_tail_load_writes_is_not_handed_out_before_the_load_runs():
    cm = make_tiers(4, device_pages=8, host_pages=32)
    a = turn(cm, list(range(1, 10)), [50, 51, 52])
    cm.release(a)
    cm.poll()
    cm.tails.evict_device(1)
    b = new_req(a.fill_ids + [7], "b")
    assert cm.admit(b) and b.kv_len == 11  # the tail's load is queued for the next forward
    page = int(cm.req_to_token.read(b.pool_idx, 8, 9)[0]) // 4
    cm.release(b)  # released before any forward (the planner's budget said no)
    assert page not in cm.pages.free_pages().tolist(), "a page a queued load writes was freed"
    cm.issue_loads()  # the next forward issues it
    cm.poll()
    assert page in cm.pages.free_pages().tolist()
    check_no_leaks(cm)


def test_the_tail_copy_is_journaled_for_tensor_parallel_followers():
    cm = make(4, 20)
    journal = []
    cm.req_to_token.journal = journal
    a = turn(cm, list(range(1, 10)), [50, 51, 52])
    b = finish_and_next(cm, a, [7])
    copies = [op for op in journal if op[0] == "copy_pages"]
    (tail,) = cm.tails.tails()
    page = int(cm.req_to_token.read(b.pool_idx, 8, 9)[0]) // 4
    assert copies == [("copy_pages", tail.page, page, 3)]


def test_copy_page_prefix_copies_every_layer():
    kv = KVPool(4, 4, num_layers=3, num_kv_heads=2, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))
    for i, t in enumerate(kv.buffers()):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view_as(t) + 1000 * i)
    before = [t.clone() for t in kv.buffers()]
    kv.copy_page_prefix(1, 3, 3)
    for t, old in zip(kv.buffers(), before):
        assert torch.equal(t[12:15], old[4:7]) and torch.equal(t[15], old[15])
        assert torch.equal(t[:12], old[:12])


def test_no_tails_with_one_token_pages_or_without_a_tree():
    assert make(1, 20).tails is None and make(4, 20, tree=False).tails is None
    kv = KVPool(8, 1, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))
    assert CacheManager(kv, ReqToTokenPool(4, 16, torch.device("cpu")), RadixTree(1)).tails is None


@pytest.mark.parametrize("tiers", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_randomized_conversations_keep_every_page_accounted_for(tiers, seed):
    """Conversations that continue (whole or cut) earlier sequences, decode a few tokens, and sometimes are released
    before their forward, under a pool small enough to evict all the time: every request reads its own sequence's KV,
    and no page of either tier leaks or is shared wrongly."""
    rng = random.Random(seed)
    page = rng.choice([2, 4])
    if tiers:
        cm = make_tiers(page, device_pages=64 // page, host_pages=128 // page,
                        policy=rng.choice(["write_through", "write_back", "write_through_selective"]))
    else:
        cm = make(page, 64 // page, row_len=128)
    done = [[rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))] for _ in range(3)]
    took = 0
    for step in range(120):
        base = rng.choice(done[-4:])  # a recent turn, mostly
        if rng.random() < 0.3:
            base = base[:rng.randrange(1, len(base) + 1)]
        ids = base + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 5))]
        if len(ids) > 48:
            ids = ids[-rng.randrange(4, 12):]
        r = new_req(ids, f"s{step}")
        if not cm.admit(r):
            continue
        took += r.kv_len > r.tree_len
        if rng.random() < 0.15 or cm.alloc_tokens(r, r.fill_len - r.alloc_len) is None:
            cm.release(r)  # before its forward: a queued tail load must not lose its page meanwhile
            cm.poll()
            continue
        check_kv(cm, r)
        compute(cm, r, r.alloc_len)
        for _ in range(rng.randrange(0, 4)):  # a short answer
            r.output_ids.append(rng.randrange(1, 50))
            if cm.alloc_tokens(r, 1) is None:
                break
            compute(cm, r, r.alloc_len)
        r.output_ids.append(rng.randrange(1, 50))  # its last token, never computed
        check_kv(cm, r)
        if not tiers:
            check_accounting(cm, [r])
        cm.release(r)
        cm.poll()
        done.append(r.fill_ids)
        if not tiers:
            check_accounting(cm, [])
    assert took >= 10, f"the workload continued a tail {took} times"
    if tiers:
        cm.hierarchy.drain()
        check_no_leaks(cm)
    else:
        assert_no_leak(cm)
