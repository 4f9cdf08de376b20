"""Outputs handed from the scheduler thread to an event loop: one wake-up delivers everything queued, a closed loop
is reported to the scheduler, and coalesced outputs carry exactly what the separate ones did."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.delivery import coalesce, mailbox_for
from engine.request import FinishKind, FinishReason, StepOutput


def out(ids, finished=False, logprobs=None, input_logprobs=None) -> StepOutput:
    return StepOutput(rid="r", new_token_ids=ids, new_logprobs=logprobs, new_top_logprobs=None,
                      new_token_ids_logprobs=None, finished=finished,
                      finish_reason=FinishReason(FinishKind.LENGTH, length=4) if finished else None,
                      prompt_tokens=3, completion_tokens=len(ids), cached_tokens=0, input_logprobs=input_logprobs)


def test_coalesce_concatenates_per_index_in_order():
    items = [(0, out([1], logprobs=[-0.1], input_logprobs=([-1.0], [], []))), (1, out([7])),
             (0, out([2, 3], logprobs=[-0.2, -0.3])), (0, out([4], finished=True, logprobs=[-0.4]))]
    merged = dict(coalesce(items))
    assert list(dict(coalesce(items))) == [0, 1]
    assert merged[0].new_token_ids == [1, 2, 3, 4] and merged[0].new_logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert merged[0].finished and merged[0].finish_reason.length == 4
    assert merged[0].input_logprobs == ([-1.0], [], []) and merged[0].new_top_logprobs is None
    assert merged[1].new_token_ids == [7]


def test_mailbox_delivers_from_another_thread_with_few_wakeups():
    async def main():
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        box = mailbox_for(loop)
        assert mailbox_for(loop) is box
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counting(cb, *args):
            nonlocal wakeups
            wakeups += 1
            return real(cb, *args)

        loop.call_soon_threadsafe = counting
        writer = threading.Thread(target=lambda: [box.put(queue, n) for n in range(500)])
        writer.start()
        await loop.run_in_executor(None, writer.join)
        got = [await queue.get() for _ in range(500)]
        return got, wakeups

    got, wakeups = asyncio.run(main())
    assert got == list(range(500))
    assert 1 <= wakeups < 500


def test_mailbox_of_a_closed_loop_raises():
    loop = asyncio.new_event_loop()
    box = mailbox_for(loop)
    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        box.put(asyncio.Queue(), 1)
