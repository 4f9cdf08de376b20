"""The router side of WorkerService.GenerateStream: one stream per worker carries every request the router sends
it, and each message back carries all the outputs the worker had ready together (a scheduler step's tokens for
every running request), so the router pays one gRPC read, one wake-up of its event loop by gRPC's I/O thread, per
step per worker instead of one per token per request.

`WorkerMux.start(request, timeout)` gives a MuxCall, which Router._call drives exactly like the unary-stream call
it replaces: async iteration of the request's GenerateResponse messages, grpc.aio.AioRpcError with the status the
worker ended it with, asyncio.CancelledError after cancel() (which sends the worker an abort: its KV pages are
freed), DEADLINE_EXCEEDED past the timeout. A worker without GenerateStream (UNIMPLEMENTED at the handshake) is
served with a call per request from then on; when the stream breaks, its open requests fail with its status and
the next request opens a new one."""

from __future__ import annotations

import asyncio
import collections
import functools
import logging

import grpc

from radixmesh.v1 import worker_pb2
from radixmesh.services.common import stream_lane
from radixmesh.services.common.errors import rpc_error
from radixmesh.services.router.cork import mine as cork_of_handler
from radixmesh.services.router.stream_link import StreamLink

log = logging.getLogger(__name__)
_DONE = object()


class MuxCall:
    def __init__(self, mux: "WorkerMux", request_id: str, timeout_s: float | None):
        self._mux, self.request_id = mux, request_id
        self.begun = False  # a message of the answer has arrived
        self._items: collections.deque = collections.deque()
        self._end: object | None = None  # _DONE or the exception the consumer gets
        self._waiter: asyncio.Future | None = None
        # the Cork of the handler that reads this call: the call is made in the task that iterates it (the handler's
        # own, or a merged stream's task, which has none)
        self._cork = cork_of_handler()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(timeout_s, self._expire) if timeout_s else None

    def __aiter__(self) -> "MuxCall":
        return self

    async def __anext__(self) -> worker_pb2.GenerateResponse:
        cork = self._cork
        while not self._items:
            if self._end is _DONE:
                raise StopAsyncIteration
            if self._end is not None:
                raise self._end  # type: ignore[misc]
            if cork is not None and cork.more:  # nothing more queued: what the handler holds goes out first
                cork.more = False
                await cork.flush()
                continue
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if cork is not None:
            cork.more = len(self._items) > 1
        return self._items.popleft()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def push(self, msg: worker_pb2.GenerateResponse) -> None:
        self.begun = True
        self._items.append(msg)
        self._wake()

    def finish(self, end: object) -> None:
        """Ends the call: _DONE, or the exception its consumer gets after the messages already pushed."""
        if self._end is None:
            self._end = end
            if self._timer is not None:
                self._timer.cancel()
            self._wake()

    def _expire(self) -> None:
        if self._end is None:
            self._mux.abort(self.request_id)
            self.finish(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def done(self) -> bool:
        return self._end is not None

    def cancel(self) -> bool:
        """Stops the request on the worker (frees its KV pages); the consumer gets CancelledError. False when it
        had ended already."""
        if self._end is not None:
            return False
        self._mux.abort(self.request_id)
        self._items.clear()
        self.finish(asyncio.CancelledError())
        return True


class WorkerMux:
    def __init__(self, stub, url: str, handshake_timeout_s: float, lane_channel: grpc.aio.Channel | None = None):
        """`lane_channel`: the worker's channel, to open a stream lane over (services.common.stream_lane); None:
        gRPC only."""
        self.url = url
        self.calls: dict[str, MuxCall] = {}
        lane = None if lane_channel is None else functools.partial(
            stream_lane.open_lane, lane_channel, url, "GenerateStream", worker_pb2.GenerateStreamResponse,
            handshake_timeout_s)
        self.link = StreamLink(url, "GenerateStream", stub.GenerateStream, worker_pb2.GenerateStreamRequest(),
                               handshake_timeout_s, lambda why: rpc_error(grpc.StatusCode.UNAVAILABLE, why),
                               self._read, lane)

    async def open(self) -> bool:
        """True when the stream is up (opened now if needed); False when this request goes as a call of its own (the
        worker does not speak GenerateStream, or its handshake just failed: stream_link.StreamLink). AioRpcError
        (UNAVAILABLE) when the handshake timed out."""
        return await self.link.open()

    def start(self, request: worker_pb2.GenerateRequest, timeout_s: float | None) -> MuxCall:
        """Submits `request` on the open stream (call open() first)."""
        call = MuxCall(self, request.request_id, timeout_s)
        self.calls[request.request_id] = call
        if not self.link.send(worker_pb2.GenerateStreamRequest(submit=request)):
            self.calls.pop(request.request_id, None)
            call.finish(rpc_error(grpc.StatusCode.UNAVAILABLE, "the GenerateStream broke"))
        return call

    def open_streams(self) -> int:
        """Calls whose answer has begun and not ended: what the worker's failure would break mid-answer."""
        return sum(c.begun for c in self.calls.values())

    def abort(self, request_id: str) -> None:
        if self.calls.pop(request_id, None) is not None:
            self.link.send(worker_pb2.GenerateStreamRequest(abort=request_id))

    async def _read(self, call) -> None:
        error = None
        try:
            while True:
                batch = await call.read()
                if batch is grpc.aio.EOF:
                    break
                # (a repeated field is copied through a slice: iterating it directly ends with an IndexError raised
                # inside upb, ~2k instructions a loop; most batches end no request, so `ended` is checked first)
                for msg in batch.responses[:]:
                    c = self.calls.get(msg.request_id)
                    if c is not None:
                        c.push(msg)
                for end in batch.ended[:] if batch.ended else ():
                    c = self.calls.pop(end.request_id, None)
                    if c is not None:
                        c.finish(_DONE if end.code == 0 else rpc_error(_CODES.get(end.code, grpc.StatusCode.UNKNOWN),
                                                                       end.message))
        except grpc.aio.AioRpcError as e:
            # The link itself broke (a request's own status comes in `ended`). grpc's Python client may report a
            # dead peer as INTERNAL ("Internal error from Core": a send on the dying transport failed) instead of
            # UNAVAILABLE; either way the worker is gone, and its requests may move to another one.
            error = e if e.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) else rpc_error(
                grpc.StatusCode.UNAVAILABLE, f"the GenerateStream broke ({e.code().name}: {e.details()})")
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the router closed GenerateStream")
            raise
        finally:
            self.link.ended(call)
            error = error or rpc_error(grpc.StatusCode.UNAVAILABLE, "the worker ended GenerateStream")
            if self.calls:
                log.warning("GenerateStream to %s ended (%s: %s); failing its %d open requests", self.url,
                            error.code().name, error.details(), len(self.calls))
            calls, self.calls = self.calls, {}
            for c in calls.values():
                c.finish(error)

    async def close(self) -> None:
        await self.link.close()


_CODES = {code.value[0]: code for code in grpc.StatusCode}
