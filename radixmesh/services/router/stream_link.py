"""A long-lived bidirectional gRPC stream from the router to a peer (GenerateStream to a worker, TokenizeStream to
the tokenizer service), the plumbing WorkerMux (mux.py) and TokenizeBatcher (tokenize_batch.py) share:

- `open()` starts the stream with a handshake (an empty message, answered with an empty one). The callers that wait
  for it resume together. A peer without the method (UNIMPLEMENTED) makes it return False from then on: the owner
  goes back to a call per request. A handshake that times out raises `unavailable(reason)` (a hung peer). Any other
  failed handshake (INTERNAL, UNAVAILABLE, ...) costs no request: open() returns False, so each waiter makes a call
  of its own, which meets the peer's real state (answered, or failed with the peer's own status), and the stream is
  tried again after a short pause (_REOPEN_AFTER_S).
- `send(msg)` queues a message; one task writes them in order (writes never overlap on a gRPC stream); on a stream
  lane (services.common.stream_lane: the same messages over a plain TCP connection, tried first when the owner
  gives `lane`) it is written at once.
- the owner's `read(call)` coroutine runs for the stream's life; when it returns, `ended(call)` forgets the stream
  and the next `open()` starts another."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Awaitable, Callable

import grpc

log = logging.getLogger(__name__)
_HANDSHAKE_ATTEMPTS = 4  # asks of a gRPC handshake that ended INTERNAL (see StreamLink._open)
_STATUS_WAIT_S = 1.0  # how long a failed handshake waits for the call's own status
_REOPEN_AFTER_S = 2.0  # after a failed handshake, requests go as calls this long before the stream is tried again


async def _final_code(call, raised: grpc.StatusCode) -> grpc.StatusCode:
    """The status the peer ended the call with, where the error a handshake's write raised hides it: grpc's Python
    client reports a write that lost the race with the peer's status as INTERNAL ("Internal error from Core"), while
    the call itself then holds the real one (UNIMPLEMENTED from a peer without the method, say). A CI run met that
    race four times in a row on one handshake."""
    if raised != grpc.StatusCode.INTERNAL:
        return raised
    try:
        code = await asyncio.wait_for(call.code(), _STATUS_WAIT_S)
    except (asyncio.TimeoutError, grpc.aio.AioRpcError):
        return raised
    return code if code not in (None, grpc.StatusCode.OK) else raised


class _HandshakeFailed(Exception):
    """A handshake failed otherwise than by time (the reason is its message): see StreamLink._failed."""


class StreamLink:
    def __init__(self, url: str, method: str, start: Callable[[], object], hello, timeout_s: float,
                 unavailable: Callable[[str], Exception], read: Callable[[object], Awaitable[None]],
                 lane: Callable[[], Awaitable[object | None]] | None = None):
        """`lane()`: a stream lane to the peer (services.common.stream_lane.open_lane), None when it offers none;
        tried first at each open, and the gRPC stream (`start()`) when there is none or its handshake fails."""
        self.url, self.method, self.timeout_s = url, method, timeout_s
        self._start, self._hello, self._unavailable, self._read = start, hello, unavailable, read
        self._lane = lane
        self.on_lane = False  # whether the open stream is a lane (for tests and logs)
        self.supported: bool | None = None  # unknown until the first handshake
        self.call = None
        self._opening: asyncio.Future | None = None
        self._calls_until = 0.0  # loop time until which open() answers False (a handshake failed)
        self._outbox: collections.deque = collections.deque()
        self._writer: asyncio.Task | None = None
        self._reader: asyncio.Task | None = None

    async def open(self) -> bool:
        if self.call is not None:
            return True
        if self.supported is False or asyncio.get_running_loop().time() < self._calls_until:
            return False
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
            self._opening.add_done_callback(self._opened)
        return await asyncio.shield(self._opening)

    def _opened(self, fut: asyncio.Future) -> None:
        self._opening = None
        if not fut.cancelled():
            fut.exception()  # retrieved: its waiters got it

    async def _open(self) -> bool:
        if self._lane is not None:
            try:
                lane = await self._open_lane()
            except _HandshakeFailed as e:
                return self._failed(str(e))
            if lane is not None:
                return self._up(lane, True)
        for attempt in range(1, _HANDSHAKE_ATTEMPTS + 1):
            if attempt > 1:
                await asyncio.sleep(0.05 * attempt)
            call = self._start()
            try:
                await call.write(self._hello)
                first = await asyncio.wait_for(call.read(), self.timeout_s)
            except grpc.aio.AioRpcError as e:
                code = await _final_code(call, e.code())
                call.cancel()
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("%s has no %s: a call per request", self.url, self.method)
                    self.supported = False
                    return False
                if code == grpc.StatusCode.INTERNAL and attempt < _HANDSHAKE_ATTEMPTS:
                    # grpc's Python client reports a status that arrives while the handshake's write is still in
                    # flight as INTERNAL ("Internal error from Core"), hiding the real one (UNIMPLEMENTED from a
                    # peer without the method, say); asked again, the peer's status comes through (on a loaded
                    # machine a second ask met the same race once: a CI run, so a few, a little apart)
                    log.info("%s to %s: %s at the handshake; asking again", self.method, self.url, e.details())
                    continue
                return self._failed(f"{code.name} {e.details()}")
            except asyncio.TimeoutError:
                call.cancel()
                raise self._unavailable(f"no {self.method} handshake in {self.timeout_s:.0f} s") from None
            if first is grpc.aio.EOF:
                raise self._unavailable(f"{self.method} closed at once")
            return self._up(call, False)
        raise AssertionError("unreachable")

    def _failed(self, why: str) -> bool:
        """A handshake that failed otherwise than by time: False (each waiter makes a call of its own, whose own
        status says whether the peer is fine), and calls for _REOPEN_AFTER_S before the next handshake. Raising
        `unavailable` here instead once had the router mark a healthy worker failed and answer 503: grpc's client can
        report a handshake's lost race as INTERNAL however often it is asked (CI, a worker without GenerateStream)."""
        log.warning("%s to %s failed at its handshake (%s): calls for %.0f s, then the stream again", self.method,
                    self.url, why, _REOPEN_AFTER_S)
        self._calls_until = asyncio.get_running_loop().time() + _REOPEN_AFTER_S
        return False

    async def _open_lane(self):
        """The stream over a lane, handshake done; None when there is none (the peer offers none, or it failed its
        handshake: the reason is logged)."""
        try:
            lane = await self._lane()
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # a hung peer, as a gRPC handshake's timeout
                raise self._unavailable(f"{self.method}: {e.code().name} {e.details()}") from None
            raise _HandshakeFailed(f"{e.code().name} {e.details()}") from None
        if lane is None:
            return None
        try:
            await lane.write(self._hello)
            first = await asyncio.wait_for(lane.read(), self.timeout_s)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as e:
            why = e.details() if isinstance(e, grpc.aio.AioRpcError) else "timed out"
        else:
            if first is not grpc.aio.EOF:
                return lane
            why = "closed at once"
        lane.cancel()
        log.warning("%s lane to %s: no handshake (%s); opening it over gRPC", self.method, self.url, why)
        return None

    def _up(self, call, lane: bool) -> bool:
        log.info("%s to %s is open (%s)", self.method, self.url, "a stream lane" if lane else "gRPC")
        self.supported, self.call, self.on_lane = True, call, lane
        self._reader = asyncio.create_task(self._run_reader(call))
        return True

    async def _run_reader(self, call) -> None:
        try:
            await self._read(call)
        finally:
            self.ended(call)

    def ended(self, call) -> None:
        if self.call is call:
            self.call = None
            self._outbox.clear()

    def send(self, msg) -> bool:
        """Queues `msg`; False when the stream is gone (its reader fails what waited on it)."""
        if self.call is None:
            return False
        if self.on_lane:  # a lane writes at once: no writer task, no await
            return self.call.write_nowait(msg)
        self._outbox.append(msg)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write(self.call))
        return True

    async def _write(self, call) -> None:
        try:
            while self._outbox and call is self.call:
                await call.write(self._outbox.popleft())
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            log.info("%s to %s: write failed (%s); the stream is closed", self.method, self.url, e)
            call.cancel()

    async def close(self) -> None:
        call, self.call = self.call, None
        if call is not None:
            call.cancel()
        for task in (self._reader, self._writer):
            if task is not None:
                task.cancel()
