"""Which loaded adapter sits in which device slot (--max-loras-per-batch of them); least recently used eviction.

A batch's adapters are placed before its forward: those in a slot stay, the others are copied in, each into a free
slot or else over the least recently used adapter that no admitted request uses (an adapter of a running request is
evicted only when every other one is in use too, which the planner's limit of adapters running at once prevents:
then it is copied back in for its next forward). Pure bookkeeping: the copies are the caller's.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable, Collection, NamedTuple

log = logging.getLogger(__name__)


class Placement(NamedTuple):
    slots: dict[int, int]  # adapter id -> its slot, for every adapter the batch needs
    loads: list[tuple[int, int]]  # (adapter id, slot) to copy in before the forward


class SlotPool:
    def __init__(self, size: int):
        self.size = size
        self.resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.free = list(range(size - 1, -1, -1))  # popped from the end: slot 0 first
        self.loads = 0  # adapters copied in so far
        self.evictions = 0

    def place(self, needed: Collection[int], in_use: Callable[[], Collection[int]]) -> Placement:
        """Slots for the adapters `needed` (distinct ids) by one forward. `in_use()`: the adapters of admitted
        requests, asked only when a slot must be freed. RuntimeError when more are needed than there are slots."""
        if len(needed) > self.size:
            raise RuntimeError(f"a forward needs {len(needed)} LoRA adapters, more than the {self.size} device slots "
                               "(--max-loras-per-batch)")
        for a in needed:
            if a in self.resident:
                self.resident.move_to_end(a)
        loads, busy = [], None
        for a in needed:
            if a in self.resident:
                continue
            if not self.free:
                busy = set(in_use()) if busy is None else busy
                self._evict(needed, busy)
            slot = self.free.pop()
            self.resident[a] = slot
            loads.append((a, slot))
        self.loads += len(loads)
        return Placement({a: self.resident[a] for a in needed}, loads)

    def _evict(self, needed: Collection[int], busy: set[int]) -> None:
        candidates = [a for a in self.resident if a not in needed]  # least recently used first
        victim = next((a for a in candidates if a not in busy), None)
        if victim is None:
            victim = candidates[0]
            log.warning("LoRA adapter %d is evicted from its device slot while requests use it (more adapters "
                        "running than --max-loras-per-batch): it is copied back for their next forward", victim)
        self.free.append(self.resident.pop(victim))
        self.evictions += 1

    def drop(self, adapter: int) -> None:
        """Forget `adapter` (unloaded): its slot is free."""
        slot = self.resident.pop(adapter, None)
        if slot is not None:
            self.free.append(slot)

    def slot_of(self, adapter: int) -> int | None:
        return self.resident.get(adapter)
