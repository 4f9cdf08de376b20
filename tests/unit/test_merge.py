"""services.router.merge.merged: several async streams as one, in arrival order, failing and cancelling as one."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from radixmesh.services.router.merge import merged

where = contextvars.ContextVar("where", default=None)


async def _gen(name: str, delays: list[float], closed: list[str], fail_after: int | None = None):
    where.set(name)  # a stream's context stays its own from start to end
    try:
        for i, d in enumerate(delays):
            await asyncio.sleep(d)
            if fail_after == i:
                raise ValueError(f"{name} failed")
            yield (name, i, where.get())
    finally:
        closed.append(name)


async def test_items_arrive_in_arrival_order_tagged_by_stream():
    closed: list[str] = []
    got = [item async for item in merged([_gen("a", [0.0, 0.05, 0.05], closed), _gen("b", [0.02, 0.05], closed)])]
    assert got == [(0, ("a", 0, "a")), (1, ("b", 0, "b")), (0, ("a", 1, "a")), (1, ("b", 1, "b")),
                   (0, ("a", 2, "a"))]
    assert sorted(closed) == ["a", "b"]


async def test_the_first_failure_ends_the_merge_and_cancels_the_rest():
    closed: list[str] = []
    got = []
    with pytest.raises(ValueError, match="b failed"):
        async for item in merged([_gen("a", [0.0] + [0.05] * 100, closed), _gen("b", [0.01, 0.01], closed, 1)]):
            got.append(item)
    assert (1, ("b", 0, "b")) in got and len(got) < 10
    assert sorted(closed) == ["a", "b"]


async def test_leaving_early_closes_every_stream():
    closed: list[str] = []
    merge = merged([_gen("a", [0.0] * 100, closed), _gen("b", [0.3] * 100, closed)])
    first = await anext(merge)
    await merge.aclose()
    assert first[0] == 0 and sorted(closed) == ["a", "b"]
