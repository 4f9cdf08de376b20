"""Routing policies: round robin cycles, cache_aware follows prefixes while load is balanced and falls back to
the least loaded worker when it is not, and forgets a removed worker."""

from __future__ import annotations

from dataclasses import dataclass

from radixmesh.services.router.policies import BLOCK, CacheAware, PrefixTree, RoundRobin, block_keys
from radixmesh.services.router.policy_registry import make_policy
from radixmesh.services.router.settings import RouterSettings


@dataclass
class W:
    url: str
    in_flight: int = 0


def cache_aware(**kw) -> CacheAware:
    opts = {"cache_threshold": 0.5, "balance_abs_threshold": 32, "balance_rel_threshold": 1.0001,
            "max_tree_tokens": 1 << 20, **kw}
    return CacheAware(**opts)


def test_round_robin_cycles():
    ws = [W("a"), W("b"), W("c")]
    rr = RoundRobin()
    assert [rr.pick(ws, [1]).url for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_block_keys_chain_over_the_prefix():
    a, b = list(range(56)), list(range(32)) + [99] * 24
    ka, kb = block_keys(a), block_keys(b)
    assert len(ka) == 56 // BLOCK == 3 and ka[:2] == kb[:2] and ka[2] != kb[2]
    assert block_keys([5] * 16 + list(range(16)))[1] != block_keys([6] * 16 + list(range(16)))[1]


def test_cache_aware_sends_shared_prefixes_to_the_same_worker():
    ws = [W("a"), W("b")]
    policy = cache_aware()
    prefix = list(range(200))
    first = policy.pick(ws, prefix + [1, 2, 3])
    for tail in range(10):
        assert policy.pick(ws, prefix + [tail] * 5) is first
    other = policy.pick(ws, list(range(500, 700)))  # no match: the worker that has seen less
    assert other is not first


def test_cache_aware_balances_when_load_is_skewed():
    ws = [W("a"), W("b")]
    policy = cache_aware(balance_abs_threshold=4)
    prefix = list(range(100))
    hot = policy.pick(ws, prefix)
    hot.in_flight = 10
    assert policy.pick(ws, prefix).url != hot.url  # imbalanced: least loaded, despite the cached prefix
    assert policy.trees["b"].match(block_keys(prefix)) == len(block_keys(prefix))  # b now holds it too


def test_prefix_tree_forgets_oldest_blocks_and_removed_workers():
    tree = PrefixTree(max_tokens=4 * BLOCK)
    old, new = block_keys(list(range(4 * BLOCK))), block_keys(list(range(1000, 1000 + 2 * BLOCK)))
    tree.insert(old)
    tree.insert(new)
    assert tree.size == 4 and tree.match(new) == 2 and tree.match(old) == 0
    policy = cache_aware()
    ws = [W("a"), W("b")]
    policy.pick(ws, list(range(64)))
    policy.forget("a")
    policy.forget("b")
    assert policy.trees == {}


def test_make_policy_by_name():
    settings = RouterSettings(tokenizer_url="x:1")
    assert isinstance(make_policy("cache_aware", settings), CacheAware)
    assert isinstance(make_policy("round_robin", settings), RoundRobin)
