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
import logging

import grpc

from radixmesh.v1 import worker_pb2

log = logging.getLogger(__name__)
_DONE = object()


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class MuxCall:
    def __init__(self, mux: "WorkerMux", request_id: str, timeout_s: float | None):
        self._mux, self.request_id = mux, request_id
        self._items: collections.deque = collections.deque()
        self._end: object | None = None  # _DONE or the exception the consumer gets
        self._waiter: asyncio.Future | None = None
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(timeout_s, self._expire) if timeout_s else None

    def __aiter__(self) -> "MuxCall":
        return self

    async def __anext__(self) -> worker_pb2.GenerateResponse:
        while not self._items:
            if self._end is _DONE:
                raise StopAsyncIteration
            if self._end is not None:
                raise self._end  # type: ignore[misc]
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def push(self, msg: worker_pb2.GenerateResponse) -> None:
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
    def __init__(self, stub, url: str, handshake_timeout_s: float):
        self.stub, self.url, self.handshake_timeout_s = stub, url, handshake_timeout_s
        self.supported: bool | None = None  # unknown until the first handshake
        self.calls: dict[str, MuxCall] = {}
        self._call = None
        self._open_lock = asyncio.Lock()
        self._outbox: collections.deque = collections.deque()
        self._writer: asyncio.Task | None = None
        self._reader: asyncio.Task | None = None

    async def open(self) -> bool:
        """True when the stream is up (opened now if needed); False when the worker does not speak GenerateStream.
        AioRpcError when it cannot be reached."""
        if self._call is not None:
            return True
        if self.supported is False:
            return False
        async with self._open_lock:
            if self._call is not None or self.supported is False:
                return self._call is not None
            call = self.stub.GenerateStream()
            try:
                await call.write(worker_pb2.GenerateStreamRequest())
                first = await asyncio.wait_for(call.read(), self.handshake_timeout_s)
            except grpc.aio.AioRpcError as e:
                call.cancel()
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("worker %s has no GenerateStream; it gets a call per request", self.url)
                    self.supported = False
                    return False
                raise
            except asyncio.TimeoutError:
                call.cancel()
                raise rpc_error(grpc.StatusCode.UNAVAILABLE,
                                f"GenerateStream handshake took over {self.handshake_timeout_s:.0f} s") from None
            if first is grpc.aio.EOF:
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, "the worker closed GenerateStream at once")
            self.supported, self._call = True, call
            self._reader = asyncio.create_task(self._read(call))
            return True

    def start(self, request: worker_pb2.GenerateRequest, timeout_s: float | None) -> MuxCall:
        """Submits `request` on the open stream (call open() first)."""
        call = MuxCall(self, request.request_id, timeout_s)
        self.calls[request.request_id] = call
        self._send(worker_pb2.GenerateStreamRequest(submit=request))
        return call

    def abort(self, request_id: str) -> None:
        if self.calls.pop(request_id, None) is not None and self._call is not None:
            self._send(worker_pb2.GenerateStreamRequest(abort=request_id))

    def _send(self, msg: worker_pb2.GenerateStreamRequest) -> None:
        if self._call is None:  # the stream is gone; its reader failed the requests on it
            return
        self._outbox.append(msg)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write(self._call))

    async def _write(self, call) -> None:
        """Writes never overlap on a gRPC stream: one task drains the queue."""
        try:
            while self._outbox and call is self._call:
                await call.write(self._outbox.popleft())
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            log.info("GenerateStream to %s: write failed (%s); the reader fails its requests", self.url, e)
            call.cancel()

    async def _read(self, call) -> None:
        error = None
        try:
            while True:
                batch = await call.read()
                if batch is grpc.aio.EOF:
                    break
                for msg in batch.responses:
                    c = self.calls.get(msg.request_id)
                    if c is not None:
                        c.push(msg)
                for end in batch.ended:
                    c = self.calls.pop(end.request_id, None)
                    if c is not None:
                        c.finish(_DONE if end.code == 0 else rpc_error(_CODES.get(end.code, grpc.StatusCode.UNKNOWN),
                                                                       end.message))
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the router closed GenerateStream")
            raise
        finally:
            if self._call is call:
                self._call = None
            self._outbox.clear()
            error = error or rpc_error(grpc.StatusCode.UNAVAILABLE, "the worker ended GenerateStream")
            if self.calls:
                log.warning("GenerateStream to %s ended (%s: %s); failing its %d open requests", self.url,
                            error.code().name, error.details(), len(self.calls))
            calls, self.calls = self.calls, {}
            for c in calls.values():
                c.finish(error)

    async def close(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        for task in (self._reader, self._writer):
            if task is not None:
                task.cancel()


_CODES = {code.value[0]: code for code in grpc.StatusCode}
