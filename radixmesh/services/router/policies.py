"""Routing policies: pick one of the healthy workers for a tokenized request. SGLang router's set: round_robin,
random, power_of_two (the less loaded of two random workers), manual (sticky: a routing key, from the
X-SMG-Routing-Key header or the OpenAI `user` field, always lands on the same worker while it is there: rendezvous
hashing, so every router process agrees without shared state; a request without a key goes by
--assignment-mode), cache_aware; and ours, kv_index (services.router.kv_index). `policy_registry.make_policy`
makes one by name.

cache_aware follows SGLang's router: when load is balanced, send the request where the longest prefix of it was
sent before (if that covers at least cache_threshold of the prompt), else to the worker that has seen the least
(the most free cache); when load is imbalanced (max - min > balance_abs_threshold and max > min *
balance_rel_threshold) send it to the least loaded worker. "Seen" is an approximate radix tree per worker of the
token ids routed there, at block granularity: a block of BLOCK tokens is keyed by a hash chained over every block
before it, so a dict of keys is a trie of blocks; the oldest blocks are forgotten past max_tree_tokens. The chain
starts from the request's prefix-cache namespace (its tenant and LoRA adapter, engine.request.cache_namespace), as
the workers' caches do: a prompt sent with one adapter says nothing of where it is cached for another."""

from __future__ import annotations

import collections
import contextvars
import hashlib
import itertools
import random
from typing import Callable, Protocol, Sequence

from radixmesh.services.router.rendezvous import rendezvous

BLOCK = 16
# The request's sticky routing key (manual policy), set by the front end that received it.
routing_key_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("routing_key", default=None)
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


class Candidate(Protocol):
    url: str
    in_flight: int


class Policy(Protocol):
    """`namespace`: the request's prefix-cache namespace (engine.request.cache_namespace of its tenant and LoRA
    adapter; "" for the shared one and the base model), for the policies that route by cached prefix. Policies may
    also define `async pick_async(workers, input_ids, tenant)`, which the router then uses instead of `pick`
    (kv_index: it asks the kvstore), and `async close()`, awaited at shutdown."""

    def pick(self, workers: Sequence[Candidate], input_ids: Sequence[int], namespace: str = "") -> Candidate: ...

    def forget(self, url: str) -> None: ...


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, workers, input_ids, namespace=""):
        return workers[next(self._counter) % len(workers)]

    def forget(self, url: str) -> None:
        pass


class Random:
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick(self, workers, input_ids, namespace=""):
        return self._rng.choice(list(workers))

    def forget(self, url: str) -> None:
        pass


class PowerOfTwo:
    """Two distinct workers at random; the one with fewer requests in flight (SGLang router's power_of_two)."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick(self, workers, input_ids, namespace=""):
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(range(len(workers)), 2)
        return workers[a] if workers[a].in_flight <= workers[b].in_flight else workers[b]

    def forget(self, url: str) -> None:
        pass


class Manual:
    """Sticky routing by key: the highest rendezvous score of (key, worker url) wins, so a key stays on its worker
    as long as that worker is healthy and moves (alone) when it goes. Keyless requests: `assignment_mode` random or
    min_load. Counts sticky and keyless picks for metrics."""

    def __init__(self, assignment_mode: str = "random", seed: int | None = None) -> None:
        self.assignment_mode = assignment_mode
        self._rng = random.Random(seed)
        self.counts = {"routing_key": 0, "no_key": 0}
        self.last_reason = ""

    def pick(self, workers, input_ids, namespace=""):
        key = routing_key_var.get()
        if key:
            self.counts["routing_key"] += 1
            self.last_reason = "routing_key"
            return rendezvous(workers, hashlib.blake2b(key.encode(), digest_size=16).digest())
        self.counts["no_key"] += 1
        self.last_reason = "no_key"
        if self.assignment_mode == "min_load":
            return min(workers, key=lambda w: (w.in_flight, w.url))
        return self._rng.choice(list(workers))

    def forget(self, url: str) -> None:
        pass


def block_keys(input_ids: Sequence[int], namespace: str = "") -> list[int]:
    """Chained hashes of the full BLOCK-token blocks of a sequence in a prefix-cache namespace (a partial last
    block is not remembered). The same in every process (sibling routers share keys): no str hash, whose seed is
    per process."""
    keys, prev = [], _namespace_seed(namespace) if namespace else 0
    for start in range(0, len(input_ids) - BLOCK + 1, BLOCK):
        prev = hash((prev, tuple(input_ids[start:start + BLOCK])))
        keys.append(prev)
    return keys


def _namespace_seed(namespace: str) -> int:
    return int.from_bytes(hashlib.blake2b(namespace.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


class PrefixTree:
    """One worker's remembered blocks, oldest first (an LRU over block keys)."""

    def __init__(self, max_tokens: int):
        self.max_blocks = max(max_tokens // BLOCK, 1)
        self.blocks: collections.OrderedDict[int, None] = collections.OrderedDict()

    def match(self, keys: list[int]) -> int:
        """Number of leading blocks present."""
        n = 0
        for key in keys:
            if key not in self.blocks:
                break
            n += 1
        return n

    def insert(self, keys: list[int]) -> None:
        for key in keys:
            self.blocks[key] = None
            self.blocks.move_to_end(key)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)

    @property
    def size(self) -> int:
        return len(self.blocks)


class CacheAware:
    def __init__(self, cache_threshold: float, balance_abs_threshold: int, balance_rel_threshold: float,
                 max_tree_tokens: int):
        self.cache_threshold = cache_threshold
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold
        self.max_tree_tokens = max_tree_tokens
        self.trees: dict[str, PrefixTree] = {}
        # how picks went, for metrics: a prefix match, no good match (least seen), or imbalance (least loaded)
        self.counts = {"cache_hits": 0, "cache_misses": 0, "balance": 0}
        # the last pick, for its trace span: prompt tokens the chosen worker's tree matched, and why it was chosen
        self.last_matched_tokens = 0
        self.last_reason = ""
        # called with (worker url, block keys) after each pick: sibling router processes learn the route
        # (--router-workers; services/router/peers.py), so each one's trees know what every process sent where
        self.on_insert: Callable[[str, list[int]], None] | None = None

    def _tree(self, url: str) -> PrefixTree:
        if url not in self.trees:
            self.trees[url] = PrefixTree(self.max_tree_tokens)
        return self.trees[url]

    def pick(self, workers, input_ids, namespace=""):
        keys = block_keys(input_ids, namespace)
        loads = [w.in_flight for w in workers]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.abs_threshold and hi > lo * self.rel_threshold:
            chosen = workers[loads.index(lo)]
            self.counts["balance"] += 1
            self.last_reason = "balance"
        else:
            matches = [self._tree(w.url).match(keys) for w in workers]
            best = max(range(len(workers)), key=lambda i: (matches[i], -loads[i]))
            if keys and matches[best] * BLOCK >= self.cache_threshold * len(input_ids):
                chosen = workers[best]
                self.counts["cache_hits"] += 1
                self.last_reason = "cache_hit"
            else:
                chosen = min(workers, key=lambda w: (self._tree(w.url).size, w.in_flight))
                self.counts["cache_misses"] += 1
                self.last_reason = "cache_miss"
        self.last_matched_tokens = self._tree(chosen.url).match(keys) * BLOCK
        self._tree(chosen.url).insert(keys)
        if self.on_insert is not None and keys:
            self.on_insert(chosen.url, keys)
        return chosen

    def learn(self, url: str, keys: list[int]) -> None:
        """A route another router process took: `url` has now seen these blocks."""
        self._tree(url).insert(keys)

    def forget(self, url: str) -> None:
        self.trees.pop(url, None)
