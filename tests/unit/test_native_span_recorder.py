"""The native span recorder (services/common/_spanrec.c) against the Python one: the same records for the router's
request path, OTLP bytes as trace_otlp makes them, its buffer taken whole records at a time and bounded, the pipe's
frames, and what Python code run in the middle of a write cannot break."""

from __future__ import annotations

import marshal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from radixmesh.services.common import trace_recorder
from radixmesh.services.common.trace_context import Sampler
from radixmesh.services.common.trace_pipe import SpanPipe
from radixmesh.services.common.trace_recorder import CLIENT, CURRENT, Record, Span

ROOT = Path(__file__).resolve().parents[2]


def _router_request(recorder, out: list) -> list[Record]:
    """What the router's request path records, through `recorder`: a Root with an attribute set while open, a
    routing leaf, a worker call, a failed tokenize call and a cancelled one, a Span under it, a failed leaf, a finish
    with an error description, and a call that ends after it. Returns the records (the sink's `out`), expanded."""
    import asyncio

    from radixmesh.services.common import tracing

    root = recorder.root()
    root.set_attribute("request_id", "r1")
    recorder.leaf("route", 1, 5, ("policy", "worker", "matched_tokens"), ("cache_aware", "w1", None))
    call = recorder.open_call()
    recorder.close_call(call, "worker Generate", CLIENT, ("worker", "role", "attempt"), ("w1", "colocated", 0))
    failed = recorder.open_call()
    recorder.close_call(failed, "tokenize", CLIENT, ("prompt_tokens",), (None,), ValueError("no tokenizer"))
    cancelled = recorder.open_call()
    recorder.close_call(cancelled, "tokenize", CLIENT, ("prompt_tokens",), (None,), asyncio.CancelledError())
    with tracing.span("detokenize", "client", tokens=3):
        pass
    recorder.leaf("route", 1, 6, ("policy",), ("p",), RuntimeError("no worker"))
    late = recorder.open_call()
    root.add_event("first_token", {"n": 1})
    root.finish("POST /generate", ("http.request.method", "http.response.status_code"), ("POST", 502), "HTTP 502")
    recorder.close_call(late, "worker Generate", CLIENT, ("worker",), ("w2",))
    assert CURRENT.get() is None
    return [Record(*r) for r in trace_recorder.expand(marshal.loads(trace_recorder.encode_batch(out)))]


def _normalized(spans: list[Record]) -> list[tuple]:
    """Records with ids as their order of appearance and times left out (they differ between two runs)."""
    ids: dict = {0: 0}
    number = lambda i: ids.setdefault(i, len(ids))  # noqa: E731
    out = []
    for s in spans:
        events = [(name, {k: v for k, v in attrs.items() if k != "exception.stacktrace"})
                  for name, _, attrs in s.events or ()]
        out.append((number(s.trace_id), number(s.span_id), number(s.parent_id), s.parent_remote, s.name, s.kind,
                    s.attributes, events, s.status, s.tracestate))
    return out


def test_the_native_recorder_records_what_the_python_one_does(monkeypatch):
    """The router's request path through each recorder: the same spans, attributes, events, statuses and links."""
    if trace_recorder.native is None:
        pytest.fail("the native span recorder is not built here: run `make native`")
    from radixmesh.services.common import tracing

    monkeypatch.setattr(tracing, "_pipe", object())
    monkeypatch.setattr(tracing, "_current", CURRENT)
    monkeypatch.setattr(tracing, "_Span", Span)
    got = {}
    for kind in ("python", "native"):
        with monkeypatch.context() as m:
            if kind == "python":
                m.setattr(trace_recorder, "native", None)
            rec = SimpleNamespace(**dict(zip(("root", "Root", "open_call", "close_call", "leaf", "call_traceparent"),
                                             trace_recorder.api())))
            out: list = []
            trace_recorder.configure(Sampler(), out.append)
            try:
                got[kind] = _router_request(rec, out)
            finally:
                trace_recorder.configure(Sampler(), lambda data: None)
    assert type(got["native"]) is list and len(got["native"]) == 8
    assert _normalized(got["native"]) == _normalized(got["python"])
    by_name = {s.name: s for s in got["native"]}
    assert by_name["POST /generate"].attributes == {"http.request.method": "POST", "http.response.status_code": 502,
                                                    "request_id": "r1"}
    assert all(s.start_ns <= s.end_ns for s in got["native"] if s.name != "route")


def test_the_native_buffer_holds_the_otlp_the_exporter_would_have_made():
    """Records written into the native buffer are OTLP spans (services/common/_spanrec.c encodes them itself), byte
    for byte what the exporter makes of the same Record with trace_otlp (every kind of value, ints of every size,
    non-ASCII and long strings, values OTLP has no type for as their str(), events, status, children); a Root's
    spans (its own, then its children, with a leaf given an id) parse as the official messages say."""
    import enum

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from radixmesh.services.common import trace_otlp

    native = trace_recorder.native
    if native is None:
        pytest.fail("the native span recorder is not built here: run `make native`")

    class Level(enum.IntEnum):
        HIGH = 3

    values = {"s": "é", "cjk": "漢字", "long": "x" * 300, "huge": "y" * 20_000, "t": True, "f": False, "none": None, "i": 7, "neg": -3,
              "i32": 1 << 31, "neg32": -(1 << 31) - 1, "u64": (1 << 64) - 1, "i63": -(1 << 63), "big": 1 << 70,
              "x": 2.5, "inf": float("inf"), "b": b"\x00\xff", "l": [1, "a", None, [2.5]], "tup": (1, (2, 3)),
              "d": {"k": [None]}, "o": Path("/p"), "e": Level.HIGH, "dotted.name": "kept"}
    record = ((1 << 127) | 5, (1 << 64) - 1, 9, True, "child", 3, 11, 1 << 63, values,
              [("ev", 12, {"n": 1, "gone": None}), ("bare", 13, {})], (2, "HTTP 500"), "k=v",
              [(7, "call", 3, 1, 2, (("a", "b"), (1, None)), None, None),
               (8, "more", 1, 1, 2, (("a",), ("x",), {"a": "over", "extra": 5}), None, (2, "bad"))] + [
                  (100 + i, "c", 1, 1, 2, {}, None, None) for i in range(200)])
    trace_recorder.configure(Sampler(), native.add)  # into the buffer
    native.set_buffer(1000, 512, None)
    try:
        native.add(record)
        n, data = native.take()
        assert n == 203 and native.take() == (0, b"")
        root = native.root()
        root.set_attribute("request_id", "r9")
        native.leaf("route", 1, 5, ("policy", "matched_tokens"), ("p", None))
        call = native.open_call()
        native.close_call(call, "worker Generate", CLIENT, ("worker", "attempt"), ("w1", 0))
        failed = native.open_call()  # ends with an error: through the Python close_call, into `children`
        native.close_call(failed, "tokenize", CLIENT, ("prompt_tokens",), (None,), ValueError("no tokenizer"))
        root.finish("POST /generate", ("http.response.status_code",), (200,))
        n_root, root_data = native.take()
    finally:
        native.set_buffer(0, 512, None)
        trace_recorder.configure(Sampler(), lambda data: None)
    assert data == trace_otlp.spans(trace_recorder.expand([record]))
    assert [(run_n, len(run)) for run, run_n in trace_otlp.split_spans(data, 100)] == [
        (100, len(trace_otlp.spans(trace_recorder.expand([record])[:100]))),
        (100, len(trace_otlp.spans(trace_recorder.expand([record])[100:200]))),
        (3, len(trace_otlp.spans(trace_recorder.expand([record])[200:])))]
    assert n_root == 4
    request = ExportTraceServiceRequest.FromString(trace_otlp.request_of_spans(b"", "radixmesh", root_data))
    spans = {s.name: s for s in request.resource_spans[0].scope_spans[0].spans}
    assert list(spans) == ["POST /generate", "route", "worker Generate", "tokenize"]
    top = spans["POST /generate"]
    assert top.trace_id == root.trace_id.to_bytes(16, "big") and top.span_id == root.span_id.to_bytes(8, "big")
    assert top.parent_span_id == b"" and top.kind == 2 and top.flags == 0x101 and top.start_time_unix_nano > 0
    assert {a.key: a.value for a in top.attributes} == {"radixmesh.request_id": _any("r9"),
                                                        "http.response.status_code": _any(200)}
    for child in list(spans.values())[1:]:
        assert child.trace_id == top.trace_id and child.parent_span_id == top.span_id and child.trace_state == ""
        assert top.start_time_unix_nano <= child.end_time_unix_nano <= top.end_time_unix_nano
    assert spans["route"].span_id not in (b"\0" * 8, top.span_id) and spans["route"].start_time_unix_nano == 5
    assert [a.key for a in spans["route"].attributes] == ["radixmesh.policy"]  # None left out
    assert spans["worker Generate"].span_id == call[1].to_bytes(8, "big") and spans["worker Generate"].kind == 3
    assert spans["tokenize"].status.code == 2 and spans["tokenize"].events[0].name == "exception"


def test_a_roots_request_id_is_an_attribute_like_any_other():
    """The Root keeps a lone request_id outside a dict (every request sets it); what is encoded, and what Python code
    reads as `attributes`, is what a dict would give: after the call's names, a name of the call overridden in place,
    one attribute with others set later, none after `attributes` is replaced."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from radixmesh.services.common import trace_otlp

    native = trace_recorder.native
    if native is None:
        pytest.fail("the native span recorder is not built here: run `make native`")
    names, values = ("http.request.method", "http.response.status_code"), ("POST", 200)

    def encoded(setup, names=names, values=values) -> list[tuple[str, object]]:
        trace_recorder.configure(Sampler(), native.add)
        native.set_buffer(1000, 512, None)
        try:
            root = native.root()
            setup(root)
            root.finish("POST /generate", names, values)
            n, data = native.take()
        finally:
            native.set_buffer(0, 512, None)
            trace_recorder.configure(Sampler(), lambda data: None)
        (span,) = ExportTraceServiceRequest.FromString(
            trace_otlp.request_of_spans(b"", "radixmesh", data)).resource_spans[0].scope_spans[0].spans
        expected = trace_otlp.spans(trace_recorder.expand([(
            int.from_bytes(span.trace_id, "big"), int.from_bytes(span.span_id, "big"), 0, False, "POST /generate", 2,
            span.start_time_unix_nano, span.end_time_unix_nano,
            (names, values) if root.attributes is None else (names, values, root.attributes), None, None, "", None)]))
        assert data == expected  # byte for byte what the Python encoder makes of the dict
        return [(a.key, a.value.string_value or a.value.int_value) for a in span.attributes]

    assert encoded(lambda r: r.set_attribute("request_id", "r1")) == [
        ("http.request.method", "POST"), ("http.response.status_code", 200), ("radixmesh.request_id", "r1")]

    def then_more(r):
        r.set_attribute("request_id", "r2")
        r.set_attribute("request_id", "r3")
        r.set_attribute("tenant", "t")
        assert r.attributes == {"request_id": "r3", "tenant": "t"}
    assert encoded(then_more)[2:] == [("radixmesh.request_id", "r3"), ("radixmesh.tenant", "t")]

    def read(r):
        r.set_attribute("request_id", "r4")
        assert r.attributes == {"request_id": "r4"}
    assert encoded(read)[2:] == [("radixmesh.request_id", "r4")]

    def replaced(r):
        r.set_attribute("request_id", "r5")
        r.attributes = {"x": 1}
    assert encoded(replaced)[2:] == [("radixmesh.x", 1)]
    assert encoded(lambda r: r.set_attribute("request_id", "r6"), ("request_id", "m"), ("old", "m1")) == [
        ("radixmesh.request_id", "r6"), ("radixmesh.m", "m1")]


def _any(v):
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

    return AnyValue(string_value=v) if isinstance(v, str) else AnyValue(int_value=v)


def test_the_native_buffer_is_taken_whole_records_at_a_time():
    """take(most): the oldest records whose spans add up to at most `most` (so an export request stays within
    OTEL_BSP_MAX_EXPORT_BATCH_SIZE without being cut), at least one record however large; the rest stays, in order."""
    from radixmesh.services.common import trace_otlp

    native = trace_recorder.native
    if native is None:
        pytest.fail("the native span recorder is not built here: run `make native`")

    def record(i: int, children: int) -> tuple:
        return (i, i, 0, False, f"r{i}", 1, 1, 2, {}, None, None, "",
                [(1000 * i + c, "c", 1, 1, 2, {}, None, None) for c in range(children)])

    records = [record(1, 2), record(2, 2), record(3, 0), record(4, 5)]
    trace_recorder.configure(Sampler(), native.add)
    native.set_buffer(1000, 512, None)
    try:
        for r in records:
            native.add(r)
        assert native.waiting() == 3 + 3 + 1 + 6
        got = [native.take(5), native.take(7), native.take(2), native.take(), native.take(5)]
    finally:
        native.set_buffer(0, 512, None)
        trace_recorder.configure(Sampler(), lambda data: None)
    spans = [trace_otlp.spans(trace_recorder.expand([r])) for r in records]
    assert got == [(3, spans[0]), (4, spans[1] + spans[2]), (6, spans[3]), (0, b""), (0, b"")]


def test_a_full_batch_goes_alone_and_the_rest_waits_for_the_schedule(tmp_path):
    """Woken by a full batch (OTEL_BSP_MAX_EXPORT_BATCH_SIZE spans), the writer sends full frames only; what is left
    goes at the schedule or at the end, so an export request is neither cut nor sent nearly empty."""
    native = trace_recorder.native
    if native is None:
        pytest.fail("the native span recorder is not built here: run `make native`")
    out = tmp_path / "frames"
    reader = [sys.executable, "-c", textwrap.dedent(f"""
        import struct, sys
        with open({str(out)!r}, "w") as out:
            while head := sys.stdin.buffer.read(4):
                body = sys.stdin.buffer.read(struct.unpack("<I", head)[0])
                out.write(f"{{body[:1].decode()}} {{struct.unpack_from('<i', body, 1)[0]}}\\n")
                out.flush()
    """)]
    trace_recorder.configure(Sampler(), native.add)
    pipe = SpanPipe(reader, max_queue=100, batch=4, delay_s=60.0, native=native)
    try:
        for i in range(10):
            native.add((i + 1, i + 1, 0, False, "s", 1, 1, 2, {}, None, None, ""))
        deadline = time.monotonic() + 10
        while native.waiting() > 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert native.waiting() == 2  # not a full batch: it waits
    finally:
        pipe.close(timeout_s=10)
        trace_recorder.configure(Sampler(), lambda data: None)
    assert out.read_text().split("\n") == ["O 4", "O 4", "O 2", ""] and pipe.sent == 10 and pipe.dropped == 0


def test_the_native_traceparent_is_w3cs():
    if trace_recorder.native is None:
        pytest.fail("the native span recorder is not built here: run `make native`")
    from radixmesh.services.common import trace_context

    for trace_id, span_id, sampled in ((1, 1, True), ((1 << 128) - 1, (1 << 64) - 1, False),
                                       (0x0af7651916cd43dd8448eb211c80319c, 0xb7ad6b7169203331, True)):
        assert trace_recorder.native.traceparent(trace_id, span_id, sampled) == trace_context.traceparent(
            trace_id, span_id, sampled)


def test_the_native_buffer_drops_and_counts_when_the_exporter_does_not_read():
    native = trace_recorder.native
    if native is None:
        pytest.fail("the native span recorder is not built here: run `make native`")
    reader = [sys.executable, "-c", "import time; time.sleep(60)"]  # never reads its stdin
    trace_recorder.configure(Sampler(), native.add)  # records into the buffer, as tracing.setup_tracing does
    pipe = SpanPipe(reader, max_queue=100, batch=10_000, delay_s=60.0, native=native)
    try:
        try:
            for i in range(250):
                native.add((i + 1, i + 1, 0, False, "s", 1, 1, 2, {}, None, None, ""))
            assert pipe.dropped == 150 and native.waiting() == 100
            native.add((1,))  # not a Record: dropped and counted, nothing written
            assert pipe.dropped == 151 and native.waiting() == 100
        finally:
            started = time.monotonic()
            pipe.close(timeout_s=2.0)
        assert time.monotonic() - started < 10 and pipe.proc.poll() is not None
        assert pipe.sent == 100 and pipe.dropped == 151  # the 100 buffered went into the pipe; the reader was killed
        root = native.root()
        root.finish("late", (), ())
        assert pipe.dropped == 152 and native.waiting() == 0
    finally:
        trace_recorder.configure(Sampler(), lambda data: None)


def test_python_code_run_by_a_native_write_cannot_corrupt_the_buffer():
    """A value's str() is Python code, run while a record is half written: it may take from the buffer (the pipe's
    writer thread), record spans, or change the containers being written. Such spans are dropped and counted, take()
    gives nothing until the write is done, and the record comes out whole (found under AddressSanitizer)."""
    from radixmesh.services.common import trace_otlp

    native = trace_recorder.native
    if native is None:
        pytest.fail("the native span recorder is not built here: run `make native`")
    inside = []
    shrinking = [1, 2, 3]

    class Meddler:
        def __str__(self):
            inside.append(native.take())  # what the writer thread would do
            native.add((9, 9, 0, False, "nested", 1, 1, 2, {}, None, None, ""))
            root = native.root()
            native.leaf("nested leaf", 1, 1, ("a",), ("b",))
            root.finish("nested root", (), ())
            return "meddled"

    class Shrinker:
        def __str__(self):
            shrinking.clear()
            return "shrunk"

    shrinking.append(Shrinker())
    record = (1, 1, 0, False, "outer", 1, 1, 2, {"m": Meddler(), "l": shrinking}, None, None, "")
    trace_recorder.configure(Sampler(), native.add)
    native.set_buffer(1000, 512, None)
    dropped = native.dropped()
    try:
        native.add(record)
        n, data = native.take()
    finally:
        native.set_buffer(0, 512, None)
        trace_recorder.configure(Sampler(), lambda data: None)
    assert inside == [(0, b"")] and n == 1 and native.dropped() - dropped == 3  # the add, the root and its leaf
    assert data == trace_otlp.spans([(1, 1, 0, False, "outer", 1, 1, 2, {"m": "meddled", "l": [1, 2, 3, "shrunk"]},
                                      None, None, "")])


def test_a_failing_value_loses_its_span_not_the_request():
    """close_call and leaf never raise into the request path: a value whose str() fails loses its span (counted)."""
    native = trace_recorder.native
    if native is None:
        pytest.fail("the native span recorder is not built here: run `make native`")

    class Broken:
        def __str__(self):
            raise RuntimeError("no str")

    trace_recorder.configure(Sampler(), native.add)
    native.set_buffer(1000, 512, None)
    dropped = native.dropped()
    try:
        root = native.root()
        call = native.open_call()
        native.close_call(call, "worker Generate", CLIENT, ("worker",), (Broken(),))
        native.leaf("route", 1, 1, ("policy",), (Broken(),))
        root.finish("POST /generate", (), ())
        n, _ = native.take()
    finally:
        native.set_buffer(0, 512, None)
        trace_recorder.configure(Sampler(), lambda data: None)
    assert n == 1 and native.dropped() - dropped == 2


def test_the_native_encoding_follows_trace_otlp_on_odd_input():
    """Where a record is not what the router makes (str subclasses, repeated names, lists for tuples, a tuple of
    children, deep lists), the bytes are still trace_otlp's of the expanded record."""
    import enum

    from radixmesh.services.common import trace_otlp

    native = trace_recorder.native
    if native is None:
        pytest.fail("the native span recorder is not built here: run `make native`")

    class Color(str, enum.Enum):
        RED = "r"

    deep: list = [1]
    for _ in range(40):
        deep = [deep]
    records = [(1, 1, 0, False, "a", 1, 1, 2, {"c": Color.RED}, None, None, "", None),
               (2, 2, 0, False, "b", 1, 1, 2, (("x", "x", "y"), (1, 2, None)), None, None, "", None),
               (3, 3, 0, False, "c", 1, 1, 2, (["x", "y"], [1, 2], {"y": 3, "z": 4}), None, None, "", None),
               (4, 4, 0, False, "d", 1, 1, 2, {}, None, None, "", ((5, "e", 1, 1, 2, {"k": 1}, None, None),)),
               (6, 6, 0, False, "f", 1, 1, 2, {"deep": deep}, None, None, "", None)]
    trace_recorder.configure(Sampler(), native.add)
    native.set_buffer(1000, 512, None)
    try:
        for r in records:
            native.add(r)
        n, data = native.take()
    finally:
        native.set_buffer(0, 512, None)
        trace_recorder.configure(Sampler(), lambda data: None)
    assert n == 6 and data == trace_otlp.spans(trace_recorder.expand(records))


def test_the_native_recorder_refuses_to_run_unconfigured():
    code = """
        from radixmesh.services.common import _spanrec
        for call in (_spanrec.root, _spanrec.open_call, lambda: _spanrec.leaf("x", 1, 1, (), ())):
            try:
                call()
            except RuntimeError as e:
                assert "not configured" in str(e)
            else:
                raise AssertionError("no error")
        print("ok")
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
