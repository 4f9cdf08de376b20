"""Several async streams as one: items in arrival order, each tagged with its stream's position.

Each stream runs in a task of its own, start to end, so a stream's context variables (trace spans, the request id
of the log lines) stay in one context. The first stream to fail ends the merge with its exception; leaving the merge
early, failing or not, cancels every stream still running and waits for them to finish."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

T = TypeVar("T")


async def merged(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(i, item) for each item of streams[i], as they arrive."""
    arrivals: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        closing = contextlib.aclosing(stream) if hasattr(stream, "aclose") else contextlib.nullcontext(stream)
        async with closing:
            async for item in stream:
                arrivals.put_nowait((i, item))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    for task in tasks:
        task.add_done_callback(arrivals.put_nowait)
    try:
        running = len(tasks)
        while running:
            got = await arrivals.get()
            if not isinstance(got, asyncio.Task):
                yield got
                continue
            running -= 1
            if not got.cancelled() and got.exception() is not None:
                raise got.exception()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def each(coros: list) -> list:
    """The results of `coros`, in order (asyncio.gather); one is awaited as it is: gather would wrap it in a task of
    its own, a task and a turn of the event loop per request for the common single-prompt case."""
    if len(coros) == 1:
        return [await coros[0]]
    return list(await asyncio.gather(*coros))
