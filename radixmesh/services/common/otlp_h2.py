"""The trace exporter's transport to a cleartext OTLP/gRPC collector: unary calls over one HTTP/2 connection of
its own (prior knowledge, RFC 9113), one call at a time, from the exporter's one export thread.

Why not grpc's own client: an Export call through grpcio costs ~500 us of CPU whatever it carries (the Python
call path, then the C core's event-engine threads), about half of the exporter process's CPU per 512-span request,
and the exporter shares the traced service's cores. The same call written here as frames on a socket costs
~200-300 us, and the exporter's CPU per frame fell by ~40% (benchmarks/results/NOTES.md, 2026-11-29 (afternoon)). What grpc adds that an exporter does not need (channels,
load balancing, name resolution, keepalive, many calls at once) is left out; what a collector expects is kept:
flow control both ways, SETTINGS/PING acknowledged, CONTINUATION and padding read, GOAWAY honoured (a call the
server did not take is sent again on a new connection at once), gzip/deflate message compression, a grpc-timeout
per call, the caller's metadata, and a grpc.RpcError with the status, message and trailing metadata (binary values
decoded) for any failure, so the SDK exporter's retry and back-off treat it as they treat grpc's.

Response headers are decoded with `hpack` (the collector's encoder may use Huffman codes and the dynamic table).
TLS collectors, unix sockets and named targets stay on grpc's client (services.common.trace_export decides)."""

from __future__ import annotations

import base64
import contextlib
import gzip
import select
import socket
import struct
import time
import zlib
from urllib.parse import unquote

import grpc
from hpack import Decoder

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE = 1, 2, 4, 5
DEFAULT_WINDOW = 65535
DEFAULT_FRAME = 16384
OUR_WINDOW = 1 << 24  # what this side lets the server send on a stream, and on the connection before an update
MAX_STREAM_ID = (1 << 31) - 1
_HEAD = struct.Struct(">I")  # a frame header is the low 3 bytes of a length, then type, flags, stream id
_MESSAGE = struct.Struct(">BI")  # gRPC's message prefix: compressed flag, length
_MOST_BUFFERS = 512  # buffers queued for one sendmsg (the system's limit is IOV_MAX, 1024 on Linux)

# HTTP status -> gRPC status when a response carries no grpc-status (gRPC's HTTP mapping)
_HTTP_CODES = {400: grpc.StatusCode.INTERNAL, 401: grpc.StatusCode.UNAUTHENTICATED,
               403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.UNIMPLEMENTED,
               429: grpc.StatusCode.UNAVAILABLE, 502: grpc.StatusCode.UNAVAILABLE,
               503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.UNAVAILABLE}
_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
# RST_STREAM error codes -> gRPC status (REFUSED_STREAM: the server did not start the call)
_RST_CODES = {0x7: grpc.StatusCode.UNAVAILABLE, 0x8: grpc.StatusCode.CANCELLED,
              0xb: grpc.StatusCode.RESOURCE_EXHAUSTED, 0xc: grpc.StatusCode.PERMISSION_DENIED}
_COMPRESSORS = {grpc.Compression.Gzip: ("gzip", gzip.compress), grpc.Compression.Deflate: ("deflate", zlib.compress)}


class CallError(grpc.RpcError):
    """A failed call, shaped like grpc's own errors (code(), details(), trailing_metadata())."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers: tuple = ()):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details, self._trailers = code, details, trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._trailers


class _Unsent(Exception):
    """The server closed or refused the connection before taking this call: safe to send again elsewhere."""


def frame(kind: int, flags: int, stream: int, body: bytes = b"") -> bytes:
    return _HEAD.pack(len(body))[1:] + bytes((kind, flags)) + _HEAD.pack(stream) + body


def _literal(name: bytes, value: bytes) -> bytes:
    """A header field as an HPACK literal without indexing and with a literal name, no Huffman coding."""
    return b"\x00" + _length(name) + name + _length(value) + value


def _length(s: bytes) -> bytes:
    n = len(s)
    if n < 127:
        return bytes((n,))
    out, n = bytearray((127,)), n - 127
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def split_endpoint(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of a `host:port` / `[v6]:port` endpoint, None for anything else (unix:, dns:///, no port)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not host or "/" in host:
        return None
    if host.startswith("["):
        if not host.endswith("]"):
            return None
        host = host[1:-1]
    elif ":" in host:
        return None
    return host, int(port)


class Connection:
    """One HTTP/2 connection to `host:port`, opened on first use and again after it closes."""

    def __init__(self, host: str, port: int, connect_timeout_s: float = 5.0):
        self.host, self.port, self.connect_timeout_s = host, port, connect_timeout_s
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        # :method POST, :scheme http (static table entries 3 and 6), then the fields every call shares
        self._fixed = (b"\x83\x86" + _literal(b":authority", authority.encode()) +
                       _literal(b"content-type", b"application/grpc") + _literal(b"te", b"trailers") +
                       _literal(b"user-agent", b"radixmesh-otlp"))
        self.sock: socket.socket | None = None
        self.deadline = 0.0  # the running call's (time.monotonic())
        self.connects = 0  # connections opened (tests and logs)

    # -- connection state -------------------------------------------------------------------------------------
    def _open(self, deadline: float) -> None:
        self.close()
        try:
            sock = socket.create_connection((self.host, self.port), timeout=max(min(self.connect_timeout_s,
                                                                                       deadline - time.monotonic()),
                                                                                   0.001))
        except OSError as e:
            raise CallError(grpc.StatusCode.UNAVAILABLE, f"cannot connect to {self.host}:{self.port}: {e}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.connects = sock, self.connects + 1
        self.buf = bytearray()
        self.next_stream = 1
        self.send_window = DEFAULT_WINDOW  # the connection's, as the server grants it
        self.peer_initial = DEFAULT_WINDOW  # a new stream's send window
        self.peer_frame = DEFAULT_FRAME
        self.received = 0  # DATA bytes read since this side last widened the connection window
        self.goaway: int | None = None  # the last stream id the server said it would process
        self.decoder = Decoder()
        self.decoded: dict[bytes, list] = {}  # header blocks that left the decoder's table as it was
        self.other_block = bytearray()  # a header block of no call of ours, until its END_HEADERS
        settings = struct.pack(">HIHI", S_ENABLE_PUSH, 0, S_INITIAL_WINDOW_SIZE, OUR_WINDOW)
        self._send(PREFACE + frame(SETTINGS, 0, 0, settings) +
                   frame(WINDOW_UPDATE, 0, 0, _HEAD.pack(OUR_WINDOW - DEFAULT_WINDOW)))

    def close(self) -> None:
        """Close the connection (from any thread: a call waiting on it in another ends at once, UNAVAILABLE)."""
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _send(self, data) -> None:
        """Write `data` (bytes, or a list of buffers written in one system call where the socket takes them)."""
        try:
            if (sock := self.sock) is None:
                raise ConnectionResetError("the connection was closed")
            sock.settimeout(max(self.deadline - time.monotonic(), 0.001))
            if isinstance(data, list):
                sent = sock.sendmsg(data)
                if sent < sum(map(len, data)):
                    sock.sendall(b"".join(data)[sent:])
            else:
                sock.sendall(data)
        except OSError as e:
            self.close()
            raise CallError(grpc.StatusCode.UNAVAILABLE, f"connection to {self.host}:{self.port} failed: {e}") from None

    def _usable(self) -> bool:
        """Read what the server sent while this side was idle (settings, pings, a GOAWAY, the end of the
        connection) without waiting; False if the connection can take no new call."""
        if self.sock is None or self.goaway is not None or self.next_stream > MAX_STREAM_ID:
            return False
        try:
            while select.select([self.sock], [], [], 0)[0]:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    return False
                self.buf += chunk
                while (f := self._parse()) is not None:
                    if f[0] == DATA:
                        self._consumed(len(f[3]))
                    else:
                        self._control(*f)
        except (OSError, ValueError, CallError):  # closed meanwhile, or an acknowledgement could not be sent
            return False
        return self.goaway is None

    # -- frames -----------------------------------------------------------------------------------------------
    def _parse(self) -> tuple[int, int, int, bytes] | None:
        buf = self.buf
        if len(buf) < 9:
            return None
        length = int.from_bytes(buf[:3], "big")
        if len(buf) < 9 + length:
            return None
        kind, flags, stream = buf[3], buf[4], int.from_bytes(buf[5:9], "big") & MAX_STREAM_ID
        body = bytes(buf[9:9 + length])
        del buf[:9 + length]
        return kind, flags, stream, body

    def _read_frame(self, deadline: float) -> tuple[int, int, int, bytes]:
        while (f := self._parse()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout
            if (sock := self.sock) is None:
                raise ConnectionResetError("the connection was closed")
            sock.settimeout(left)
            chunk = sock.recv(1 << 16)
            if not chunk:
                raise ConnectionResetError("the server closed the connection")
            self.buf += chunk
        return f

    def _control(self, kind: int, flags: int, stream: int, body: bytes, *, stream_window: list | None = None) -> None:
        """Connection-level frames, and WINDOW_UPDATEs for the open stream (`stream`, its window in a list)."""
        if kind == SETTINGS and not flags & ACK:
            for i in range(0, len(body) - 5, 6):
                key, value = struct.unpack_from(">HI", body, i)
                if key == S_INITIAL_WINDOW_SIZE:
                    if stream_window is not None:
                        stream_window[0] += value - self.peer_initial
                    self.peer_initial = value
                elif key == S_MAX_FRAME_SIZE:
                    self.peer_frame = value
                # HEADER_TABLE_SIZE (the server's decoder table) needs nothing: this side never indexes a field
            self._send(frame(SETTINGS, ACK, 0))
        elif kind == WINDOW_UPDATE:
            grant = int.from_bytes(body[:4], "big") & MAX_STREAM_ID
            if stream_id := stream:
                if stream_window is not None and stream_id == stream_window[1]:
                    stream_window[0] += grant
            else:
                self.send_window += grant
        elif kind == PING and not flags & ACK:
            self._send(frame(PING, ACK, 0, body))
        elif kind == GOAWAY:
            self.goaway = int.from_bytes(body[:4], "big") & MAX_STREAM_ID
        elif kind in (HEADERS, CONTINUATION, PUSH_PROMISE):
            # a header block of no call of ours still has to go through the decoder to keep its table in step
            self.other_block += _unpad(kind, flags, body)
            if flags & END_HEADERS:
                block, self.other_block = bytes(self.other_block), bytearray()
                self._decode(block)

    def _decode(self, block: bytes) -> list:
        """A header block's fields. A server's responses repeat the same few blocks, which after the first ones only
        refer to table entries: a block whose decoding changed nothing in the table decodes the same way again until
        a block that does change it, so it is kept until then."""
        if (fields := self.decoded.get(block)) is not None:
            return fields
        table = self.decoder.header_table
        entries, size = table.dynamic_entries, table.maxsize
        count, first = len(entries), entries[0] if entries else None
        fields = self.decoder.decode(block)
        if table.maxsize == size and len(entries) == count and (entries[0] if entries else None) is first:
            self.decoded[block] = fields
        else:
            self.decoded.clear()
        return fields

    # -- a call -----------------------------------------------------------------------------------------------
    def unary(self, path: str, message, metadata=(), timeout_s: float = 10.0,
              compression: grpc.Compression | None = None) -> bytes:
        """Send one gRPC request message to `path` and return the response message's bytes, or raise CallError.
        `message`: its bytes, or a list of buffers that make it up (sent from where they lie, not joined)."""
        self.deadline = deadline = time.monotonic() + timeout_s
        flag, encoding = 0, None
        parts = [message] if isinstance(message, (bytes, bytearray, memoryview)) else list(message)
        if compression in _COMPRESSORS:
            encoding, compress = _COMPRESSORS[compression]
            parts, flag = [compress(b"".join(parts))], 1
        for _ in range(3):
            try:
                if not self._usable():
                    self._open(deadline)
                return self._call(path, flag, parts, encoding, metadata, deadline)
            except _Unsent as e:
                self.close()
                reason = str(e)
            except socket.timeout:
                self.close()  # the stream's state is unknown: a new connection for the next call
                raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no response in {timeout_s:.1f} s") from None
            except OSError as e:
                self.close()
                raise CallError(grpc.StatusCode.UNAVAILABLE, f"connection to {self.host}:{self.port} lost: {e}") from None
            except CallError:
                raise
            except Exception as e:  # noqa: BLE001 - a response this side cannot read (HPACK, a status, a message)
                self.close()
                raise CallError(grpc.StatusCode.INTERNAL, f"unreadable response from {self.host}:{self.port}: "
                                f"{type(e).__name__}: {e}") from None
        raise CallError(grpc.StatusCode.UNAVAILABLE, f"the server took no call: {reason}")

    def _call(self, path: str, flag: int, parts: list, encoding: str | None, metadata, deadline: float) -> bytes:
        stream = self.next_stream
        self.next_stream += 2
        block = [self._fixed, _literal(b":path", path.encode()),
                 _literal(b"grpc-timeout", b"%dm" % max(int((deadline - time.monotonic()) * 1000), 1))]
        if encoding:
            block.append(_literal(b"grpc-encoding", encoding.encode()))
        for key, value in metadata:
            key = key.lower()
            if key.endswith("-bin"):  # binary metadata travels base64-coded, unpadded
                value = base64.b64encode(value if isinstance(value, bytes) else value.encode()).rstrip(b"=")
            block.append(_literal(key.encode(), value if isinstance(value, bytes) else str(value).encode()))
        block = b"".join(block)
        if len(block) > self.peer_frame:
            raise CallError(grpc.StatusCode.INTERNAL, f"request headers of {len(block)} bytes are too large")
        out = [frame(HEADERS, END_HEADERS, stream, block)]
        body = _Body([_MESSAGE.pack(flag, sum(map(len, parts))), *parts])
        window = [self.peer_initial, stream]
        done = _Response()
        while body.left:
            n = min(body.left, window[0], self.send_window, self.peer_frame)
            if n <= 0 or len(out) > _MOST_BUFFERS:  # out of window (or of buffers for one system call): hand
                if out:  # over what is queued, then, out of window, wait for the server to grant more
                    self._send(out)
                    out = []
                if n > 0:
                    continue
                self._dispatch(self._read_frame(deadline), stream, window, done)
                if done.closed:  # the server answered (an error, surely) before taking the whole request
                    return done.result(self)
                continue
            out.append(_HEAD.pack(n)[1:] + bytes((DATA, END_STREAM if n == body.left else 0)) + _HEAD.pack(stream))
            body.take(n, out)
            window[0] -= n
            self.send_window -= n
        self._send(out)
        while not done.closed:
            self._dispatch(self._read_frame(deadline), stream, window, done)
        return done.result(self)

    def _dispatch(self, f: tuple[int, int, int, bytes], stream: int, window: list, done: "_Response") -> None:
        kind, flags, sid, body = f
        if sid != stream or kind in (WINDOW_UPDATE, PING, SETTINGS, GOAWAY, PRIORITY):
            if kind == GOAWAY:
                self._control(kind, flags, sid, body)
                if stream > self.goaway:
                    raise _Unsent(f"GOAWAY (last stream {self.goaway}, code {int.from_bytes(body[4:8], 'big')})")
            elif kind == DATA:
                self._consumed(len(body))
            else:
                self._control(kind, flags, sid, body, stream_window=window)
            return
        if kind == DATA:
            self._consumed(len(body))
            done.data += _unpad(kind, flags, body)
        elif kind in (HEADERS, CONTINUATION):
            done.block += _unpad(kind, flags, body)
            if kind == HEADERS:
                done.ending = bool(flags & END_STREAM)
            if flags & END_HEADERS:
                fields = self._decode(bytes(done.block))
                done.block = bytearray()
                if done.headers is None:
                    done.headers = fields
                else:
                    done.trailers = fields
                done.closed = done.ending
        elif kind == RST_STREAM:
            code = int.from_bytes(body[:4], "big")
            if code == 0x7:  # REFUSED_STREAM: not processed
                raise _Unsent("the server refused the stream")
            done.reset = code
            done.closed = True
        if flags & END_STREAM and kind == DATA:
            done.closed = True

    def _consumed(self, n: int) -> None:
        """Give the server its connection window back once half of it is used."""
        self.received += n
        if self.received >= OUR_WINDOW // 2:
            self._send(frame(WINDOW_UPDATE, 0, 0, _HEAD.pack(self.received)))
            self.received = 0


class _Body:
    """A request's bytes in the buffers that hold them, handed out in frames' worth as slices (no copy)."""

    __slots__ = ("parts", "index", "at", "left")

    def __init__(self, parts: list):
        self.parts = [memoryview(p) for p in parts if len(p)]
        self.index = self.at = 0
        self.left = sum(map(len, self.parts))

    def take(self, n: int, out: list) -> None:
        """Append the next `n` bytes to `out`, as slices of the parts."""
        self.left -= n
        while n:
            part = self.parts[self.index]
            k = min(len(part) - self.at, n)
            out.append(part[self.at:self.at + k])
            n -= k
            self.at += k
            if self.at == len(part):
                self.index, self.at = self.index + 1, 0


class _Response:
    __slots__ = ("headers", "trailers", "data", "block", "ending", "closed", "reset")

    def __init__(self):
        self.headers = self.trailers = None
        self.data, self.block = bytearray(), bytearray()
        self.ending = self.closed = False
        self.reset: int | None = None

    def result(self, conn: Connection) -> bytes:
        if self.reset is not None:
            raise CallError(_RST_CODES.get(self.reset, grpc.StatusCode.INTERNAL),
                            f"the server reset the stream (HTTP/2 error {self.reset:#x})")
        head = dict(self.headers or ())
        status = head.get(":status", "")
        fields = self.trailers if self.trailers is not None else self.headers or []
        grpc_fields = dict(fields)
        if "grpc-status" not in grpc_fields:
            code = grpc.StatusCode.UNKNOWN if status == "200" else _HTTP_CODES.get(int(status or 0),
                                                                                   grpc.StatusCode.UNKNOWN)
            raise CallError(code, f"no grpc-status in the response (HTTP status {status or 'none'})")
        code = _BY_VALUE.get(int(grpc_fields["grpc-status"]), grpc.StatusCode.UNKNOWN)
        if code is not grpc.StatusCode.OK:
            raise CallError(code, unquote(grpc_fields.get("grpc-message", "")), _metadata(fields))
        data = self.data
        if len(data) < 5:
            return b""
        compressed, length = _MESSAGE.unpack_from(data)
        message = bytes(data[5:5 + length])
        if compressed:
            encoding = head.get("grpc-encoding", "identity")
            message = gzip.decompress(message) if encoding == "gzip" else zlib.decompress(message)
        return message


def _unpad(kind: int, flags: int, body: bytes) -> bytes:
    start, end = 0, len(body)
    if flags & PADDED and kind in (DATA, HEADERS, PUSH_PROMISE):
        start, end = 1, len(body) - body[0]
    if kind == HEADERS and flags & PRIORITY_FLAG:
        start += 5
    if kind == PUSH_PROMISE:
        start += 4
    return body[start:end]


def _metadata(fields) -> tuple:
    """Trailing metadata as grpc gives it: reserved fields left out, `-bin` values base64-decoded."""
    out = []
    for key, value in fields:
        if key.startswith(":") or key in ("grpc-status", "grpc-message", "content-type"):
            continue
        if key.endswith("-bin"):
            value = base64.b64decode(value + "=" * (-len(value) % 4))
        out.append((key, value))
    return tuple(out)
