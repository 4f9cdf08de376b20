"""Counts of the kv_index policy's routing decisions, per worker and per reason, for metrics and /get_server_info.

Reasons: "index" (one worker had the lowest expected time to first token), "tie" (several were within the tie
margin; rendezvous hashing chose), "fallback" (the kvstore's index could not be asked; least loaded, then
rendezvous)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

REASONS = ("index", "tie", "fallback")


@dataclass(slots=True)
class RoutingDecisions:
    by_reason: collections.Counter = field(default_factory=collections.Counter)  # reason -> picks
    by_worker: dict[str, collections.Counter] = field(default_factory=dict)  # url -> reason -> picks

    def record(self, url: str, reason: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown routing reason {reason!r}; known: {', '.join(REASONS)}")
        self.by_reason[reason] += 1
        self.by_worker.setdefault(url, collections.Counter())[reason] += 1

    def picks(self, url: str) -> int:
        return sum(self.by_worker.get(url, {}).values())

    def snapshot(self) -> dict:
        """Plain dicts (JSON-ready): {"by_reason": {reason: n}, "by_worker": {url: {reason: n}}}; every reason is
        listed, with 0 when it never happened."""
        return {"by_reason": {r: self.by_reason[r] for r in REASONS},
                "by_worker": {url: {r: c[r] for r in REASONS} for url, c in sorted(self.by_worker.items())}}
