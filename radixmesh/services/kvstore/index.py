"""The global prefix index: per registered worker, which pages (chained page keys) its prefix cache holds and in
which tier (device L1, host L2), kept from the worker's KV events. Pure data, used from the event loop only.

A match of a prompt derives the prompt's page keys once per distinct layout (keys bind the layout and the tenant,
so a tenant never matches another tenant's pages), then walks each worker's pages: the leading run on device, then
the following run on host. Work is O(pages of the prompt) per worker; no per-token Python loop.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Sequence

from radixmesh.engine.cache.page_keys import prompt_keys
from radixmesh.engine.cache.storage import KvLayout


class Tier(enum.IntFlag):
    DEVICE = 1  # the worker's device pool (L1)
    HOST = 2  # its host-memory pool (L2)


@dataclass(slots=True)
class IndexedWorker:
    """One worker's pages. `pages` maps a page key to the tiers holding it; `tier_pages` counts pages per tier."""

    url: str
    layout: KvLayout
    uses_storage: bool
    pages: dict[bytes, Tier] = field(default_factory=dict)
    tier_pages: dict[Tier, int] = field(default_factory=lambda: {Tier.DEVICE: 0, Tier.HOST: 0})

    def store(self, keys: Iterable[bytes], tier: Tier) -> None:
        pages, added = self.pages, 0
        for key in keys:
            old = pages.get(key, Tier(0))
            if not old & tier:
                pages[key] = old | tier
                added += 1
        self.tier_pages[tier] += added

    def remove(self, keys: Iterable[bytes], tier: Tier) -> None:
        pages, removed = self.pages, 0
        for key in keys:
            old = pages.get(key)
            if old is not None and old & tier:
                rest = old & ~tier
                if rest:
                    pages[key] = rest
                else:
                    del pages[key]
                removed += 1
        self.tier_pages[tier] -= removed

    def clear(self) -> None:
        self.pages.clear()
        self.tier_pages = {Tier.DEVICE: 0, Tier.HOST: 0}

    def leading(self, keys: Sequence[bytes], start: int, tier: Tier) -> int:
        """How many of keys[start:], from the first, this worker holds in `tier`."""
        pages, n = self.pages, 0
        for i in range(start, len(keys)):
            if not pages.get(keys[i], 0) & tier:
                break
            n += 1
        return n


class WorkerMatch(NamedTuple):
    """How many leading tokens of a prompt a worker holds: on device, then on host, then (after those) in the L3
    store, if the worker uses it."""

    worker_url: str
    device_tokens: int
    host_tokens: int
    storage_tokens: int = 0

    @property
    def matched_tokens(self) -> int:
        return self.device_tokens + self.host_tokens


class PartialMatch(NamedTuple):
    """A worker's own match, and the keys after it that the store may hold (empty when it does not use the store)."""

    worker: IndexedWorker
    device_pages: int
    host_pages: int
    rest: Sequence[bytes]


class PrefixIndex:
    def __init__(self) -> None:
        self.workers: dict[str, IndexedWorker] = {}

    def add(self, url: str, layout: KvLayout, uses_storage: bool) -> IndexedWorker:
        """A worker with no pages (replacing any entry under the same url); its events then go to the entry."""
        entry = IndexedWorker(url, layout, uses_storage)
        self.workers[url] = entry
        return entry

    def drop(self, entry: IndexedWorker) -> None:
        """Removes the worker, unless its url was re-added since (then the newer entry stays)."""
        if self.workers.get(entry.url) is entry:
            del self.workers[entry.url]

    def page_count(self) -> int:
        """Pages over every worker, summed over tiers."""
        return sum(sum(w.tier_pages.values()) for w in self.workers.values())

    def layouts(self) -> set[KvLayout]:
        return {w.layout for w in self.workers.values()}

    def partial_matches(self, keys_by_layout: dict[KvLayout, list[bytes]], token_ids: Sequence[int],
                        tenant: str) -> list[PartialMatch]:
        """Every worker's device and host runs; keys of a layout missing from `keys_by_layout` are derived here
        (and added to it)."""
        out = []
        for worker in list(self.workers.values()):
            keys = keys_by_layout.get(worker.layout)
            if keys is None:
                keys = keys_by_layout[worker.layout] = prompt_keys(worker.layout, tenant, token_ids)
            device = worker.leading(keys, 0, Tier.DEVICE)
            host = worker.leading(keys, device, Tier.HOST)
            rest = keys[device + host:] if worker.uses_storage else ()
            out.append(PartialMatch(worker, device, host, rest))
        return out


def prompt_keys_by_layout(layouts: Iterable[KvLayout], tenant: str, token_ids: Sequence[int]) -> dict:
    """The prompt's page keys under each layout (pure: runs off the event loop)."""
    return {layout: prompt_keys(layout, tenant, token_ids) for layout in layouts}


def finish(partials: Sequence[PartialMatch], stored_pages: Sequence[int]) -> list[WorkerMatch]:
    """Matches in tokens, best first (own + store tokens, then device tokens, then url); `stored_pages[i]` is how
    many of partials[i].rest the store holds."""
    out = []
    for p, stored in zip(partials, stored_pages):
        size = p.worker.layout.page_size
        out.append(WorkerMatch(p.worker.url, p.device_pages * size, p.host_pages * size, stored * size))
    out.sort(key=lambda m: (-(m.matched_tokens + m.storage_tokens), -m.device_tokens, m.worker_url))
    return out
