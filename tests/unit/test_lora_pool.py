"""LoRA adapters' device slots (engine.lora.pool): adapters a batch needs are placed in free slots, then over the
least recently used adapter no admitted request uses; one in use goes only when nothing else can."""

from __future__ import annotations

import pytest

from radixmesh.engine.lora.pool import SlotPool


def test_free_slots_first_then_the_least_recently_used():
    pool = SlotPool(2)
    first = pool.place([1, 2], in_use=lambda: pytest.fail("no slot had to be freed"))
    assert first.slots == {1: 0, 2: 1} and first.loads == [(1, 0), (2, 1)]
    assert pool.place([1], in_use=lambda: []).loads == []  # resident: nothing to copy; 2 is now the older
    third = pool.place([3], in_use=lambda: [])
    assert third.loads == [(3, 1)] and pool.slot_of(2) is None and pool.evictions == 1


def test_an_adapter_admitted_requests_use_stays():
    pool = SlotPool(2)
    pool.place([1, 2], in_use=list)
    pool.place([2], in_use=list)  # 1 is the least recently used, but its requests are admitted
    assert pool.place([3], in_use=lambda: [1, 1]).loads == [(3, 1)] and pool.slot_of(1) == 0


def test_an_adapter_in_use_goes_only_when_every_other_is_in_use_too():
    pool = SlotPool(2)
    pool.place([1, 2], in_use=list)
    placed = pool.place([3], in_use=lambda: [1, 2])
    assert placed.loads == [(3, 0)] and pool.slot_of(1) is None  # the least recently used of those in use


def test_a_batch_never_evicts_its_own_adapters_and_is_refused_beyond_the_slots():
    pool = SlotPool(2)
    pool.place([1, 2], in_use=list)
    placed = pool.place([2, 3], in_use=list)
    assert placed.slots == {2: 1, 3: 0}
    with pytest.raises(RuntimeError, match="3 LoRA adapters, more than the 2 device slots"):
        pool.place([1, 2, 3], in_use=list)


def test_unloading_frees_the_slot():
    pool = SlotPool(1)
    pool.place([4], in_use=list)
    pool.drop(4)
    pool.drop(4)  # not resident: nothing to do
    assert pool.place([5], in_use=lambda: pytest.fail("a slot was free")).loads == [(5, 0)]
