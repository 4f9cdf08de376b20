"""Handing scheduler outputs to asyncio callers cheaply.

The scheduler thread emits one StepOutput per request per step. Waking an event loop costs a system call, so a
`LoopMailbox` (one per loop) queues outputs and wakes its loop at most once until the loop has taken them: when the loop
lags, one wake-up delivers many outputs. Each output goes to a function called in the loop: an asyncio.Queue's
put_nowait (a task waits on the queue), or a sink that handles the output right there, without waking a task. The
scheduler hands a step's outputs over inside `together()`, which wakes each loop once, at the end. On the
receiving side `coalesce` merges the outputs of one request that arrived together into one, so a consumer that fell
behind gets one larger chunk (one detokenization, one message downstream) instead of many small ones; the concatenation
is exactly what the separate outputs carried. `deltas_until_done` streams a call's deltas to a consumer of the public
API (as SGLang's dicts) and aborts the call's requests when the consumer stops early."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import weakref
from typing import AsyncIterator, Callable, Iterator

from radixmesh.engine.outputs import RequestOutput
from radixmesh.engine.request import StepOutput

log = logging.getLogger(__name__)


class LoopMailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: list[tuple[Callable[[object], None], object]] = []
        self._lock = threading.Lock()
        self._scheduled = False

    def put(self, to: Callable[[object], None], item: object) -> None:
        """Called from any thread: `to(item)` runs in the loop (it must be quick and must not raise). Raises
        RuntimeError when the loop is closed (the caller is gone). Inside `together()` the loop is woken at the
        block's end."""
        if self.loop.is_closed():
            raise RuntimeError("Event loop is closed")
        with self._lock:
            self._items.append((to, item))
            if self._scheduled:
                return
            held = getattr(_holding, "boxes", None)
            if held is not None:
                held.add(self)
                return
            self._scheduled = True
        self._wake()

    def _flush(self) -> None:
        """Wake the loop for what was put while held (unless a wake-up is already on its way)."""
        with self._lock:
            if self._scheduled or not self._items:
                return
            self._scheduled = True
        try:
            self._wake()
        except RuntimeError:  # the loop closed meanwhile: its callers are gone, their outputs with them
            log.warning("dropping %d outputs: their event loop is closed", len(self._items))

    def _wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            with self._lock:
                self._scheduled = False
            raise

    def _deliver(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for to, item in items:
            try:
                to(item)
            except Exception:  # noqa: BLE001 - one broken consumer must not cost the others their outputs
                log.exception("an output's consumer failed")


_holding = threading.local()


@contextlib.contextmanager
def together():
    """The outputs this thread puts inside the block wake each loop once, at its end: the scheduler hands a step's
    outputs over this way, so a loop gets them in one delivery (and a server sends them in one message)."""
    if getattr(_holding, "boxes", None) is not None:  # nested: the outer block wakes
        yield
        return
    _holding.boxes = boxes = set()
    try:
        yield
    finally:
        _holding.boxes = None
        for box in boxes:
            box._flush()


_mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_mailboxes_lock = threading.Lock()


def mailbox_for(loop: asyncio.AbstractEventLoop) -> LoopMailbox:
    with _mailboxes_lock:
        box = _mailboxes.get(loop)
        if box is None:
            box = _mailboxes[loop] = LoopMailbox(loop)
        return box


def _merge(a: StepOutput, b: StepOutput) -> StepOutput:
    """a then b, of one request, as one output."""
    def cat(x, y):
        return None if x is None and y is None else (x or []) + (y or [])

    return StepOutput(rid=b.rid, new_token_ids=a.new_token_ids + b.new_token_ids,
                      new_logprobs=cat(a.new_logprobs, b.new_logprobs),
                      new_top_logprobs=cat(a.new_top_logprobs, b.new_top_logprobs),
                      new_token_ids_logprobs=cat(a.new_token_ids_logprobs, b.new_token_ids_logprobs),
                      finished=b.finished, finish_reason=b.finish_reason, prompt_tokens=b.prompt_tokens,
                      completion_tokens=b.completion_tokens, cached_tokens=b.cached_tokens,
                      input_logprobs=a.input_logprobs if a.input_logprobs is not None else b.input_logprobs,
                      queue_time_s=b.queue_time_s, spec=b.spec)


def coalesce(items: list[tuple[int, StepOutput]]) -> list[tuple[int, StepOutput]]:
    """Merge the outputs of each index (a batch call's request) in arrival order; indexes keep first-seen order."""
    merged: dict[int, StepOutput] = {}
    for i, out in items:
        merged[i] = _merge(merged[i], out) if i in merged else out
    return list(merged.items())


def deltas_until_done(deltas: Iterator[RequestOutput | None], abort: Callable[[], None]) -> Iterator[dict]:
    """A call's non-empty deltas, streamed as SGLang's dicts; a consumer that stops early (or the call's end) runs
    `abort`."""
    try:
        yield from (d.to_dict() for d in deltas if d is not None)
    finally:
        abort()  # a consumer that stops early frees its requests (a no-op for finished ones)


async def async_deltas_until_done(deltas: AsyncIterator[RequestOutput | None], abort: Callable[[], None]
                                  ) -> AsyncIterator[dict]:
    """As deltas_until_done, for an async consumer."""
    try:
        async for d in deltas:
            if d is not None:
                yield d.to_dict()
    finally:
        abort()


# A caller waiting for outputs looks at the scheduler after a second without any. The scheduler hands a request its
# last output (an abort, when a forward failed) before it stops, so "stopped" is read first and the inbox looked at
# again after: only a stopped scheduler that left nothing on the way raises. (Checking first and raising lost that
# abort when the scheduler stopped between the wait's timeout and the check.)
def next_output(inbox: queue.SimpleQueue, alive: Callable[[], bool], check: Callable[[], None]):
    """The next item of `inbox`, or None after a second without one; `check()` (it raises) once `alive()` is false
    and nothing the scheduler put is left."""
    try:
        return inbox.get(timeout=1.0)
    except queue.Empty:
        stopped = not alive()
        try:
            return inbox.get_nowait()
        except queue.Empty:
            if stopped:
                check()
            return None


async def raise_if_stopped(alive: Callable[[], bool], check: Callable[[], None], pending: Callable[[], bool]) -> None:
    """After a second without output in an event loop: `check()` (it raises) once `alive()` is false and `pending()`
    is still false after the deliveries the scheduler's mailbox queued before it stopped have run in this loop."""
    if alive():
        return
    await asyncio.sleep(0)  # callbacks queued before this (call_soon_threadsafe) run before it resumes
    if not pending():
        check()
