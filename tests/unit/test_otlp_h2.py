"""The trace exporter's own HTTP/2 transport (services.common.otlp_h2) against real grpc servers: request bytes
arrive whole at any size (flow control), metadata (binary too) and compression reach the server, grpc statuses,
messages and trailing metadata come back as grpc's errors would, deadlines are kept, a server that goes away and
comes back is reconnected to, and the SDK exporter in trace_export picks this transport only for a cleartext
host:port collector."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from concurrent import futures

import grpc
import pytest
from hpack import Encoder

from radixmesh.services.common import otlp_h2
from radixmesh.services.common.trace_export import Encoded, _PrebuiltExporter

PATH = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class Server:
    """A grpc server whose one method records what it got and does what `behave` says."""

    def __init__(self, port: int = 0, behave=None):
        self.got: list[tuple[bytes, dict]] = []
        self.behave = behave
        outer = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details):
                return grpc.unary_unary_rpc_method_handler(outer.handle)

        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers((Handler(),))
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    def handle(self, request: bytes, context) -> bytes:
        self.got.append((request, dict(context.invocation_metadata())))
        if self.behave:
            return self.behave(request, context)
        return b"ok:" + request[:8]

    def stop(self, grace=None):
        self.server.stop(grace).wait()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.stop()


def test_requests_of_any_size_arrive_whole_on_one_connection(server):
    conn = otlp_h2.Connection("127.0.0.1", server.port)
    try:
        sizes = [0, 1, 70_000, 3_000_000, 200_000, 5]  # past the 64 KiB default windows, and a 16 KiB frame
        for n in sizes:
            payload = os.urandom(n)
            assert conn.unary(PATH, payload) == b"ok:" + payload[:8]
            assert server.got[-1][0] == payload
        assert conn.connects == 1
    finally:
        conn.close()


def test_a_message_in_parts_is_sent_as_their_bytes_in_order(server):
    conn = otlp_h2.Connection("127.0.0.1", server.port)
    big = os.urandom(300_000)
    try:
        for parts in ([b"head", memoryview(big)[3:], b"", b"tail"], [memoryview(big)], [b"", b""]):
            conn.unary(PATH, parts)
            assert server.got[-1][0] == b"".join(parts)
        conn.unary(PATH, [b"head", memoryview(big)], compression=grpc.Compression.Gzip)
        assert server.got[-1][0] == b"head" + big
    finally:
        conn.close()


def test_a_frame_of_spans_becomes_requests_of_at_most_the_batch_size():
    """The exporter's requests around a native frame's spans (a view of the frame, never copied) parse as the
    official message, split at `most` spans."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    from radixmesh.services.common import trace_export, trace_otlp

    spans = b"".join(trace_otlp.field(b"\x12", Span(name=f"s{i}", trace_id=bytes(16), span_id=bytes(8)).SerializeToString())
                     for i in range(1200))
    frame = memoryview(b"O\x00\x00\x00\x00" + spans)[5:]
    res = trace_export.resource("router")
    out = trace_export.requests(res, (frame, 1200), 512)
    assert [e.count for e in out] == [512, 512, 176]
    names = []
    for e in out:
        assert type(e.parts[1]) is memoryview  # the spans were not copied
        request = ExportTraceServiceRequest.FromString(e.payload)
        names += [s.name for s in request.resource_spans[0].scope_spans[0].spans]
        assert request.resource_spans[0].scope_spans[0].scope.name == trace_export.SCOPE
    assert names == [f"s{i}" for i in range(1200)]


def test_metadata_and_compression_reach_the_server(server):
    conn = otlp_h2.Connection("127.0.0.1", server.port)
    payload = b"spans " * 5000
    try:
        for compression in (grpc.Compression.Gzip, grpc.Compression.Deflate, None):
            conn.unary(PATH, payload, (("Api-Key", "s3cret"), ("trace-bin", b"\x00\xff\x10")), 5.0, compression)
            request, metadata = server.got[-1]
            assert request == payload
            assert metadata["api-key"] == "s3cret" and metadata["trace-bin"] == b"\x00\xff\x10"
    finally:
        conn.close()


def test_a_failed_call_reports_grpcs_status_message_and_trailers():
    def refuse(request, context):
        context.set_trailing_metadata((("google.rpc.retryinfo-bin", b"\x0a\x02\x08\x01"), ("why", "full")))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue 100% full: try later")

    server = Server(behave=refuse)
    conn = otlp_h2.Connection("127.0.0.1", server.port)
    try:
        for size in (100_000, 10, 0):  # after the first, through the server's header table
            with pytest.raises(grpc.RpcError) as caught:
                conn.unary(PATH, b"x" * size)
            error = caught.value
            assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error.details() == "queue 100% full: try later"
            assert dict(error.trailing_metadata()) == {"google.rpc.retryinfo-bin": b"\x0a\x02\x08\x01", "why": "full"}
    finally:
        conn.close()
        server.stop()
    assert conn.connects == 1


def test_a_deadline_is_kept_and_the_next_call_gets_a_fresh_connection():
    slow = threading.Event()

    def maybe_wait(request, context):
        if request == b"slow":
            slow.wait(5)
        return b"done"

    server = Server(behave=maybe_wait)
    conn = otlp_h2.Connection("127.0.0.1", server.port)
    try:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            conn.unary(PATH, b"slow", timeout_s=0.3)
        assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 2.0
        slow.set()
        assert conn.unary(PATH, b"fast") == b"done"  # the server ended the call itself (grpc-timeout): same connection
    finally:
        slow.set()
        conn.close()
        server.stop()


def test_a_server_that_never_answers_times_out_and_is_dropped():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)  # connections complete in the backlog; nothing reads or answers
        conn = otlp_h2.Connection("127.0.0.1", listener.getsockname()[1])
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            conn.unary(PATH, b"x" * 1000, timeout_s=0.5)
        assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0.4 < time.monotonic() - started < 2.0 and conn.sock is None
        # closed from another thread (the exporter shutting down), a waiting call ends at once
        threading.Timer(0.3, conn.close).start()
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            conn.unary(PATH, b"x", timeout_s=10.0)
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 2.0


def test_a_server_that_goes_away_is_unavailable_then_reconnected_to():
    server = Server()
    port = server.port
    conn = otlp_h2.Connection("127.0.0.1", port)
    try:
        assert conn.unary(PATH, b"one") == b"ok:one"
        server.stop(grace=0.5)  # a graceful stop: GOAWAY, then the connection closes
        with pytest.raises(grpc.RpcError) as caught:
            conn.unary(PATH, b"two", timeout_s=2.0)
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
        server = Server(port=port)
        assert conn.unary(PATH, b"three") == b"ok:three"
        assert [r for r, _ in server.got] == [b"three"]
    finally:
        conn.close()
        server.stop()


def test_nothing_listening_is_unavailable_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        conn = otlp_h2.Connection("127.0.0.1", port)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            conn.unary(PATH, b"x", timeout_s=5.0)
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE and "cannot connect" in caught.value.details()
    assert time.monotonic() - started < 2.0


def test_a_header_block_is_reused_only_until_the_table_changes():
    """A block of table references decodes to different fields once another block changed the table."""
    encoder = Encoder()
    conn = otlp_h2.Connection("127.0.0.1", 1)
    conn.decoder = otlp_h2.Decoder()
    conn.decoded = {}
    first = encoder.encode([("x-color", "red")], huffman=True)  # inserts x-color: red at index 62
    assert conn._decode(first) == [("x-color", "red")]
    reference = bytes([0x80 | 62])
    assert conn._decode(reference) == [("x-color", "red")]
    assert conn._decode(reference) == [("x-color", "red")]  # kept
    conn._decode(encoder.encode([("x-size", "big")], huffman=True))  # a new entry at 62
    assert conn._decode(reference) == [("x-size", "big")]


@pytest.mark.parametrize("endpoint, expected", [
    ("127.0.0.1:4317", ("127.0.0.1", 4317)), ("collector.obs.svc:4317", ("collector.obs.svc", 4317)),
    ("[::1]:4317", ("::1", 4317)), ("localhost", None), ("unix:///tmp/otlp.sock", None),
    ("dns:///collector:4317", None), ("::1:4317", None)])
def test_split_endpoint(endpoint, expected):
    assert otlp_h2.split_endpoint(endpoint) == expected


def test_the_exporter_uses_this_transport_for_cleartext_host_port_only(monkeypatch):
    monkeypatch.delenv(_TRANSPORT, raising=False)
    server = Server(behave=lambda request, context: b"")  # an empty ExportTraceServiceResponse
    lean = _PrebuiltExporter(endpoint=f"127.0.0.1:{server.port}", insecure=True)
    assert lean.lean is not None
    assert lean.export(Encoded(b"\x0a\x00", 1)).name == "SUCCESS" and server.got[-1][0] == b"\x0a\x00"
    lean.shutdown()
    assert lean.lean.sock is None
    assert _PrebuiltExporter(endpoint=f"https://127.0.0.1:{server.port}").lean is None  # TLS: grpc's client
    monkeypatch.setenv(_TRANSPORT, "grpc")
    plain = _PrebuiltExporter(endpoint=f"127.0.0.1:{server.port}", insecure=True)
    assert plain.lean is None
    assert plain.export(Encoded(b"\x0a\x01", 1)).name == "SUCCESS" and server.got[-1][0] == b"\x0a\x01"
    plain.shutdown()
    server.stop()


def test_the_sdk_retries_an_unavailable_collector_through_this_transport(monkeypatch):
    monkeypatch.delenv(_TRANSPORT, raising=False)
    calls = []

    def flaky(request, context):
        calls.append(request)
        if len(calls) == 1:
            context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
        return b""

    server = Server(behave=flaky)
    exporter = _PrebuiltExporter(endpoint=f"127.0.0.1:{server.port}", insecure=True, timeout=10)
    try:
        assert exporter.export(Encoded(b"\x0a\x00", 1)).name == "SUCCESS"  # after the SDK's ~1 s back-off
        assert calls == [b"\x0a\x00", b"\x0a\x00"]
    finally:
        exporter.shutdown()
        server.stop()


_TRANSPORT = "RADIXMESH_OTLP_TRANSPORT"


class ScriptedServer:
    """A raw HTTP/2 server answering as other gRPC servers may: Huffman-coded, indexed header fields (as Go's
    encoder writes them), a header block split over CONTINUATION frames, padding, a PING and a SETTINGS change in
    the middle of a call, a small flow-control window granted piece by piece; with `goaway_first`, the first
    connection is sent away (GOAWAY naming no stream as taken) as soon as a call begins."""

    def __init__(self, goaway_first: bool = False):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.goaway_first, self.connections, self.received = goaway_first, 0, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._connection, args=(sock, self.connections), daemon=True).start()

    @staticmethod
    def _read(sock, buf: bytearray, n: int) -> bytes:
        while len(buf) < n:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError
            buf += chunk
        out = bytes(buf[:n])
        del buf[:n]
        return out

    def _connection(self, sock, number: int):
        f, encoder, buf = otlp_h2.frame, Encoder(), bytearray()
        try:
            assert self._read(sock, buf, len(otlp_h2.PREFACE)) == otlp_h2.PREFACE
            sock.sendall(f(otlp_h2.SETTINGS, 0, 0, struct.pack(">HI", otlp_h2.S_INITIAL_WINDOW_SIZE, 1000)))
            body = bytearray()
            while True:
                head = self._read(sock, buf, 9)
                length, kind, flags = int.from_bytes(head[:3], "big"), head[3], head[4]
                stream = int.from_bytes(head[5:9], "big")
                payload = self._read(sock, buf, length)
                if kind == otlp_h2.HEADERS and self.goaway_first and number == 1:
                    sock.sendall(f(otlp_h2.GOAWAY, 0, 0, struct.pack(">II", 0, 0)))
                    return
                if kind != otlp_h2.DATA:
                    continue
                body += payload
                # take the bytes, then grant them again (stream and connection), with a PING and a wider
                # window for new streams in between
                sock.sendall(f(otlp_h2.PING, 0, 0, b"12345678") +
                             f(otlp_h2.SETTINGS, 0, 0, struct.pack(">HI", otlp_h2.S_INITIAL_WINDOW_SIZE, 1500)) +
                             f(otlp_h2.WINDOW_UPDATE, 0, stream, struct.pack(">I", len(payload) or 1)) +
                             f(otlp_h2.WINDOW_UPDATE, 0, 0, struct.pack(">I", len(payload) or 1)))
                if not flags & otlp_h2.END_STREAM:
                    continue
                self.received.append(bytes(body[5:]))
                block = encoder.encode([(":status", "200"), ("content-type", "application/grpc"),
                                        ("x-served-by", "scripted-collector-" + "z" * 40)], huffman=True)
                half = len(block) // 2
                message = b"\x00" + struct.pack(">I", 3) + b"ack"
                trailers = encoder.encode([("grpc-status", "0"), ("grpc-message", "")], huffman=True)
                sock.sendall(f(otlp_h2.HEADERS, otlp_h2.PADDED, stream, b"\x02" + block[:half] + b"\x00\x00") +
                             f(otlp_h2.CONTINUATION, otlp_h2.END_HEADERS, stream, block[half:]) +
                             f(otlp_h2.DATA, otlp_h2.PADDED, stream, b"\x03" + message + b"\x00" * 3) +
                             f(otlp_h2.HEADERS, otlp_h2.END_HEADERS | otlp_h2.END_STREAM, stream, trailers))
                body = bytearray()
        except (ConnectionError, OSError, AssertionError):
            pass
        finally:
            sock.close()

    def close(self):
        self.listener.close()


def test_continuation_padding_pings_and_piecemeal_windows_are_handled():
    server = ScriptedServer()
    conn = otlp_h2.Connection("127.0.0.1", server.port)
    try:
        payloads = [os.urandom(5000), b"small", os.urandom(20_000)]
        for payload in payloads:  # after the first, the server's fields come as references to its table
            assert conn.unary(PATH, payload, timeout_s=5.0) == b"ack"
        assert server.received == payloads and conn.connects == 1
    finally:
        conn.close()
        server.close()


def test_a_call_the_server_sent_away_goes_again_on_a_new_connection():
    server = ScriptedServer(goaway_first=True)
    conn = otlp_h2.Connection("127.0.0.1", server.port)
    try:
        assert conn.unary(PATH, b"spans", timeout_s=5.0) == b"ack"
        assert server.received == [b"spans"] and conn.connects == 2
    finally:
        conn.close()
        server.close()
