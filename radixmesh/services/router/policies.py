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
the workers' caches do: a prompt sent with one adapter says nothing of where it is cached for another.

A prompt the router does not tokenize (a text-only request, Router.routes_text) is matched on its text, as SGLang's
router matches characters: blocks of TEXT_BLOCK bytes of its UTF-8, about as many tokens as BLOCK, in a key space of
their own (a prompt sent once as text and once as ids is two prompts to the trees). Every policy but kv_index routes
text (`routes_text`); lengths and thresholds are then in bytes."""

from __future__ import annotations

import collections
import contextvars
import hashlib
import itertools
import random
from typing import Callable, Protocol, Sequence

from radixmesh.services.router.rendezvous import rendezvous

BLOCK = 16
TEXT_BLOCK = 64  # bytes of a text prompt's UTF-8 per block (~16 tokens of English)
_TEXT_SEED = 0x7E47  # starts a text prompt's chain, apart from a token prompt's
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
    (kv_index: it asks the kvstore), and `async close()`, awaited at shutdown. `prompt` is the request's token ids,
    or its text for a policy with `routes_text = True` (Router.routes_text: the worker tokenizes it)."""

    def pick(self, workers: Sequence[Candidate], prompt: Sequence[int] | str, namespace: str = "") -> Candidate: ...

    def forget(self, url: str) -> None: ...


class RoundRobin:
    routes_text = True  # needs no token ids (Router.routes_text)

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, workers, input_ids, namespace=""):
        return workers[next(self._counter) % len(workers)]

    def forget(self, url: str) -> None:
        pass


class Random:
    routes_text = True  # needs no token ids (Router.routes_text)

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick(self, workers, input_ids, namespace=""):
        return self._rng.choice(list(workers))

    def forget(self, url: str) -> None:
        pass


class PowerOfTwo:
    """Two distinct workers at random; the one with fewer requests in flight (SGLang router's power_of_two)."""

    routes_text = True  # needs no token ids (Router.routes_text)

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

    routes_text = True

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


def block_keys(prompt: Sequence[int] | str, namespace: str = "") -> list[int]:
    """Chained hashes of the full blocks of a prompt in a prefix-cache namespace: BLOCK tokens of token ids, or
    TEXT_BLOCK bytes of a text's UTF-8 (a partial last block is not remembered). The same in every process (sibling
    routers share keys): no str or bytes hash, whose seed is per process (an int's hash has none)."""
    if isinstance(prompt, str):
        return _text_block_keys(prompt.encode("utf-8", "surrogatepass"), namespace)
    input_ids = prompt
    keys, prev = [], _namespace_seed(namespace) if namespace else 0
    for start in range(0, len(input_ids) - BLOCK + 1, BLOCK):
        prev = hash((prev, tuple(input_ids[start:start + BLOCK])))
        keys.append(prev)
    return keys


def chat_routing_text(chat) -> str:
    """What cache_aware matches a chat prompt on when the worker renders it (radixmesh.v1 ChatInput): the tools, then
    each message's role and content, in order. Like the rendering, it grows at its end as a conversation goes on, so
    a conversation's next turn matches its earlier ones' blocks."""
    parts = [chat.tools_json, "\x00"]
    for m in chat.messages:
        parts += (m.role, "\x00", m.content, "\x00", m.tool_calls_json, "\x00")
    return "".join(parts)


def _keyed(prompt: Sequence[int] | str, namespace: str) -> tuple[list[int], int, int]:
    """(block keys, the prompt's length, a block's length): in tokens for ids, in UTF-8 bytes for a text."""
    if isinstance(prompt, str):
        data = prompt.encode("utf-8", "surrogatepass")
        return _text_block_keys(data, namespace), len(data), TEXT_BLOCK
    return block_keys(prompt, namespace), len(prompt), BLOCK


def _text_block_keys(data: bytes, namespace: str) -> list[int]:
    # a block's bytes as one int, whose hash is its value mod 2**61 - 1: blocks differ in that unless their 61-bit
    # pieces sum alike, which text does not by chance (a collision would only misroute, never mis-serve)
    keys, prev = [], (_namespace_seed(namespace) if namespace else 0) ^ _TEXT_SEED
    for start in range(0, len(data) - TEXT_BLOCK + 1, TEXT_BLOCK):
        prev = hash((prev, int.from_bytes(data[start:start + TEXT_BLOCK], "little")))
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
    routes_text = True  # needs no token ids (Router.routes_text)

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

    def pick(self, workers, prompt, namespace=""):
        keys, size, unit = _keyed(prompt, namespace)
        loads = [w.in_flight for w in workers]
        trees = [self._tree(w.url) for w in workers]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.abs_threshold and hi > lo * self.rel_threshold:
            i = loads.index(lo)
            matched = trees[i].match(keys)
            self.counts["balance"] += 1
            self.last_reason = "balance"
        else:
            matches = [t.match(keys) for t in trees]
            i = max(range(len(workers)), key=lambda j: (matches[j], -loads[j]))
            if keys and matches[i] * unit >= self.cache_threshold * size:
                self.counts["cache_hits"] += 1
                self.last_reason = "cache_hit"
            else:
                i = min(range(len(workers)), key=lambda j: (trees[j].size, loads[j]))
                self.counts["cache_misses"] += 1
                self.last_reason = "cache_miss"
            matched = matches[i]
        chosen = workers[i]
        self.last_matched_tokens = matched * unit  # bytes for a text prompt
        trees[i].insert(keys)
        if self.on_insert is not None and keys:
            self.on_insert(chosen.url, keys)
        return chosen

    def learn(self, url: str, keys: list[int]) -> None:
        """A route another router process took: `url` has now seen these blocks."""
        self._tree(url).insert(keys)

    def forget(self, url: str) -> None:
        self.trees.pop(url, None)
