"""Stream lanes (protos/radixmesh/v1/lane.proto): a service's long-lived stream over a plain TCP connection.

The router's hot path is two long-lived streams, GenerateStream to each worker and TokenizeStream to the tokenizer
service; over gRPC's Python client every message on them costs ~40-60 us of router CPU (a completion-queue
operation, a wake-up by gRPC's poller thread), several times what the same bytes cost over an asyncio socket
(benchmarks/transport_cost.py). A lane carries the same messages, in length-prefixed frames, over a TCP connection
the router opens with a ticket it got from the gRPC call OpenLane (so the token check and every other internal
credential still decide who may open one). The server runs the servicer's own stream handler on the lane's
messages: the same code serves the gRPC stream and the lane.

Server: `LaneServer(host, port, {"GenerateStream": (handler, request_type)})`, started and closed by GrpcService,
which also registers its OpenLane servicer. Client: `open_lane(channel, url, method, response_type, timeout_s)`
gives a LaneCall with what services.router.stream_link uses of a grpc.aio stream-stream call (write, read with
grpc.aio.EOF at the end, cancel), or None when the peer offers no lane (the caller stays on gRPC).

A broken connection ends the stream as a broken gRPC stream would: the client's read raises AioRpcError
UNAVAILABLE, the server's handler is cancelled (its requests are aborted and their KV pages freed). A peer that dies
without a word is found by TCP keepalive (~20 s) and, sooner, by the router's health probes."""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import socket
import struct
import time
from typing import Any, AsyncIterator, Callable

import grpc

from radixmesh.v1 import lane_pb2, lane_pb2_grpc
from radixmesh.services.common.errors import rpc_error

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
MAX_FRAME = 256 * 1024 * 1024  # what gRPC lets through (services.common.server.MAX_MESSAGE_BYTES)
TICKET_TTL_S = 30.0
CONNECT_TIMEOUT_S = 3.0  # a lane port that a firewall drops costs at most this much before gRPC takes over
_HIGH_WATER = 4 * 1024 * 1024  # bytes queued in the kernel's and asyncio's buffers before a writer waits


class LaneClosed(ConnectionError):
    pass


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 2)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class FrameConnection(asyncio.Protocol):
    """One end of a lane: frames in (parsed as bytes arrive, queued) and out (written at once; `drain()` waits
    while the peer reads slower than we write)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._frames: collections.deque[bytes] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._drained: asyncio.Future | None = None
        self.closed = False
        self.error: BaseException | None = None  # why the connection ended, when not by a clean close
        self.on_lost: Callable[[], None] | None = None
        self.peer = ""
        self._out: list[bytes] = []  # frames written since the last flush (see write_frame)
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- asyncio.Protocol ---------------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self._loop = asyncio.get_running_loop()
        transport.set_write_buffer_limits(high=_HIGH_WATER)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            _keepalive(sock)
        peer = transport.get_extra_info("peername")
        self.peer = f"ipv4:{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos, size = 0, len(buf)
        while size - pos >= 4:
            (n,) = _LEN.unpack_from(buf, pos)
            if n > MAX_FRAME:
                self._fail(LaneClosed(f"a frame of {n} bytes (more than {MAX_FRAME})"))
                return
            end = pos + 4 + n
            if end > size:
                break
            self._frames.append(bytes(buf[pos + 4:end]))
            pos = end
        if pos:
            del buf[:pos]
            self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if exc is not None and self.error is None:
            self.error = exc
        self._wake()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        if self.on_lost is not None:
            self.on_lost()

    def pause_writing(self) -> None:
        if self._drained is None or self._drained.done():
            self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # ---- use -----------------------------------------------------------------------------------------------------
    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        self.error = error
        if self.transport is not None:
            self.transport.abort()

    async def read_frame(self) -> bytes | None:
        """The next frame; None once the peer closed cleanly; LaneClosed when the connection broke."""
        while not self._frames:
            if self.closed:
                if self.error is not None:
                    raise LaneClosed(str(self.error) or type(self.error).__name__)
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._frames.popleft()

    def write_frame(self, data: bytes) -> bool:
        """Queues a frame; False when the connection is gone. The frames written while the event loop runs its
        current callbacks go out together, in one send, just after them (or at drain()): a router whose handlers
        submit several requests to one worker in a pass of its loop pays one syscall for them, not one each."""
        if self.closed or self.transport is None or self.transport.is_closing():
            return False
        out = self._out
        if not out:
            self._loop.call_soon(self._flush)
        out.append(_LEN.pack(len(data)))
        out.append(data)
        return True

    def _flush(self) -> None:
        out = self._out
        if out:
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(b"".join(out))
            out.clear()

    async def drain(self) -> None:
        """Sends what is queued now, then waits while the transport's buffer is over its high-water mark."""
        self._flush()
        if self._drained is not None and not self._drained.done():
            await self._drained

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self._flush()
            self.transport.close()


# ---- the server side -------------------------------------------------------------------------------------------
class _LaneContext:
    """What stream handlers use of a grpc.aio.ServicerContext, for a lane."""

    def __init__(self, peer: str):
        self._peer = peer

    def invocation_metadata(self):
        return ()

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise LaneClosed(f"{code.name}: {details}")


Handler = Callable[[AsyncIterator[Any], Any], AsyncIterator[Any]]


class LaneServer:
    """The TCP listener of a service's lanes; `handlers`: method name -> (its stream handler, the request type)."""

    def __init__(self, host: str, port: int, handlers: dict[str, tuple[Handler, type]], advertised_host: str = ""):
        """`advertised_host`: what clients dial (empty: the host they dialled for gRPC)."""
        self.host, self.port, self.handlers, self.advertised_host = host, port, handlers, advertised_host
        self._tickets: dict[bytes, tuple[str, float]] = {}
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self.accepting = False
        self.unusable: str | None = None  # why it could not start listening (then OpenLane says so)

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._connection, self.host, self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        self.accepting = True
        return self.port

    def ticket(self, method: str) -> bytes:
        now = time.monotonic()
        for t in [t for t, (_, expires) in self._tickets.items() if expires < now]:
            del self._tickets[t]
        t = secrets.token_bytes(32)
        self._tickets[t] = (method, now + TICKET_TTL_S)
        return t

    def _redeem(self, ticket: bytes) -> str | None:
        method, expires = self._tickets.pop(ticket, (None, 0.0))
        return method if expires >= time.monotonic() else None

    def _connection(self) -> FrameConnection:
        conn = FrameConnection()
        task = asyncio.get_running_loop().create_task(self._serve(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        conn.on_lost = task.cancel  # the client went away: the handler's requests are cancelled with it
        return conn

    async def _serve(self, conn: FrameConnection) -> None:
        try:
            ticket = await asyncio.wait_for(conn.read_frame(), TICKET_TTL_S)
            method = self._redeem(ticket) if ticket is not None and self.accepting else None
            if method is None:
                log.warning("refused a stream lane from %s: %s", conn.peer,
                            "shutting down" if not self.accepting else "no valid ticket")
                return
            handler, request_type = self.handlers[method]

            async def requests() -> AsyncIterator[Any]:
                while True:
                    try:
                        frame = await conn.read_frame()
                    except LaneClosed:
                        return  # the connection broke: the handler is cancelled with it (on_lost)
                    if frame is None:
                        return
                    yield request_type.FromString(frame)

            async for msg in handler(requests(), _LaneContext(conn.peer)):
                if not conn.write_frame(msg.SerializeToString()):
                    return
                await conn.drain()
        except (asyncio.TimeoutError, LaneClosed) as e:
            log.info("stream lane from %s ended: %s", conn.peer, e or type(e).__name__)
        except asyncio.CancelledError:
            pass
        except Exception:  # noqa: BLE001 - a handler's bug ends its lane, not the server
            log.exception("stream lane from %s failed", conn.peer)
        finally:
            conn.close()

    def stop_accepting(self) -> None:
        """New lanes are refused (draining); open ones end when their handler does."""
        self.accepting = False
        self._tickets.clear()
        if self._server is not None:
            self._server.close()

    async def idle(self) -> None:
        """Returns once no lane is open."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    async def close(self) -> None:
        """Closes every lane (after the drain: handlers still running are cancelled)."""
        self.stop_accepting()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


class LaneServicer(lane_pb2_grpc.StreamLaneServiceServicer):
    def __init__(self, server: LaneServer | None, why_not: str = ""):
        self.server, self.why_not = server, why_not

    async def OpenLane(self, request: lane_pb2.OpenLaneRequest, context: grpc.aio.ServicerContext):
        if self.server is None or self.server.unusable:
            why = self.why_not if self.server is None else self.server.unusable
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no stream lanes here: {why}")
        if request.method not in self.server.handlers:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no stream lane for {request.method!r}")
        if not self.server.accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "shutting down")
        return lane_pb2.OpenLaneResponse(port=self.server.port, ticket=self.server.ticket(request.method),
                                         host=self.server.advertised_host)


# ---- the client side -------------------------------------------------------------------------------------------
class LaneCall:
    """A lane as services.router.stream_link drives a grpc.aio stream-stream call."""

    def __init__(self, conn: FrameConnection, response_type: type, method: str):
        self._conn, self._response_type, self.method = conn, response_type, method

    def write_nowait(self, msg) -> bool:
        """Sends at once (no task, no await); False when the lane is gone."""
        return self._conn.write_frame(msg.SerializeToString())

    async def write(self, msg) -> None:
        if not self.write_nowait(msg):
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"the {self.method} lane is closed")
        await self._conn.drain()

    async def read(self):
        try:
            frame = await self._conn.read_frame()
        except LaneClosed as e:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"the {self.method} lane broke ({e})") from None
        if frame is None:
            return grpc.aio.EOF
        return self._response_type.FromString(frame)

    def cancel(self) -> bool:
        self._conn.close()
        return True


def host_of(url: str) -> str:
    host = url.rpartition(":")[0] or url
    return host[1:-1] if host.startswith("[") else host


async def open_lane(channel: grpc.aio.Channel, url: str, method: str, response_type: type,
                    timeout_s: float) -> LaneCall | None:
    """A lane for `method`'s stream to the service at `url` (host:port, as dialled over `channel`), or None when it
    offers none or its lane port cannot be reached (the caller stays on gRPC; the reason is logged). The gRPC
    call's own failure (UNAVAILABLE, DEADLINE_EXCEEDED, UNAUTHENTICATED, ...) is raised as it is."""
    try:
        grant = await lane_pb2_grpc.StreamLaneServiceStub(channel).OpenLane(
            lane_pb2.OpenLaneRequest(method=method), timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        if e.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION):
            log.info("%s offers no %s lane (%s): gRPC carries the stream", url, method, e.details())
            return None
        raise
    loop = asyncio.get_running_loop()
    host = grant.host or host_of(url)
    try:
        _, conn = await asyncio.wait_for(loop.create_connection(FrameConnection, host, grant.port),
                                         min(timeout_s, CONNECT_TIMEOUT_S))
    except (OSError, asyncio.TimeoutError) as e:
        log.warning("cannot reach %s's %s lane at %s:%d (%s): gRPC carries the stream", url, method, host,
                    grant.port, e or type(e).__name__)
        return None
    conn.write_frame(grant.ticket)
    return LaneCall(conn, response_type, method)
