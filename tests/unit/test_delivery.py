"""Outputs handed from the scheduler thread to an event loop: one wake-up delivers everything queued, a step's
outputs put inside `together()` wake each loop once, a closed loop is reported to the scheduler, and coalesced
outputs carry exactly what the separate ones did."""

from __future__ import annotations

import asyncio
import threading

import pytest

from radixmesh.engine.delivery import coalesce, mailbox_for, together
from radixmesh.engine.request import FinishKind, FinishReason, StepOutput


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
        writer = threading.Thread(target=lambda: [box.put(queue.put_nowait, n) for n in range(500)])
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
        box.put(asyncio.Queue().put_nowait, 1)


def test_outputs_put_together_wake_each_loop_once_at_the_end():
    async def main():
        loops = [asyncio.get_running_loop()]
        other = asyncio.new_event_loop()  # a second caller's loop, run on its own thread
        runner = threading.Thread(target=other.run_forever)
        runner.start()
        loops.append(other)
        got: list[list] = [[], []]
        wakeups = [0, 0]
        for k, loop in enumerate(loops):
            real = loop.call_soon_threadsafe

            def counting(cb, *args, k=k, real=real):
                wakeups[k] += getattr(cb, "__name__", "") == "_deliver"  # the mailbox's, not the executor's
                return real(cb, *args)

            loop.call_soon_threadsafe = counting
        boxes = [mailbox_for(loop) for loop in loops]
        woken_inside = []

        def step():  # the scheduler thread: one step's outputs for callers on both loops
            with together():
                for n in range(100):
                    boxes[n % 2].put(got[n % 2].append, n)
                woken_inside.append(list(wakeups))

        writer = threading.Thread(target=step)
        writer.start()
        await asyncio.get_running_loop().run_in_executor(None, writer.join)
        await asyncio.sleep(0.05)
        other.call_soon_threadsafe(other.stop)
        runner.join()
        other.close()
        return got, wakeups, woken_inside

    got, wakeups, woken_inside = asyncio.run(main())
    assert woken_inside == [[0, 0]]  # nothing woke while the step was still handing outputs over
    assert wakeups == [1, 1]
    assert got == [list(range(0, 100, 2)), list(range(1, 100, 2))]


class _Scheduler:
    """A scheduler's liveness as a waiting caller sees it; `check` raises as Engine._check_alive does."""

    def __init__(self) -> None:
        self.running = True

    def alive(self) -> bool:
        return self.running

    def check(self) -> None:
        if not self.running:
            raise RuntimeError("engine scheduler crashed")


def test_an_output_put_just_before_the_scheduler_stopped_is_received_not_lost():
    """The hung-rank race (2026-11-29): the caller's wait times out, the scheduler puts the request's abort and
    stops, then the caller looks. It gets the abort; only a stopped scheduler with nothing left raises."""
    import queue

    from radixmesh.engine import delivery

    sched, inbox = _Scheduler(), queue.SimpleQueue()

    class LateQueue:  # the wait times out; the put and the stop land before the caller looks again
        def get(self, timeout):
            inbox.put((0, "abort"))
            sched.running = False
            raise queue.Empty

        def get_nowait(self):
            return inbox.get_nowait()

    assert delivery.next_output(LateQueue(), sched.alive, sched.check) == (0, "abort")
    with pytest.raises(RuntimeError, match="crashed"):
        delivery.next_output(inbox, sched.alive, sched.check)
    sched.running = True
    assert delivery.next_output(inbox, sched.alive, sched.check) is None  # a second without output: wait again


def test_a_delivery_queued_before_the_scheduler_stopped_reaches_the_loop_first():
    """In an event loop: the mailbox delivery the scheduler queued before stopping runs before the check, so the
    caller finds the output pending instead of raising; with nothing pending it raises."""
    async def main():
        loop = asyncio.get_running_loop()
        sched, inbox = _Scheduler(), asyncio.Queue()
        box = mailbox_for(loop)
        done = threading.Event()

        def scheduler():
            box.put(inbox.put_nowait, (0, "abort"))
            sched.running = False
            done.set()

        threading.Thread(target=scheduler).start()
        await loop.run_in_executor(None, done.wait)
        await delivery.raise_if_stopped(sched.alive, sched.check, lambda: not inbox.empty())  # no raise
        assert inbox.get_nowait() == (0, "abort")
        with pytest.raises(RuntimeError, match="crashed"):
            await delivery.raise_if_stopped(sched.alive, sched.check, lambda: not inbox.empty())

    from radixmesh.engine import delivery
    asyncio.run(main())
