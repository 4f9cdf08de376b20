"""The bounded span buffer and the exporter process (services.common.trace_pipe, trace_export, trace_otlp): spans
dropped (and counted) when the exporter does not read, spans reaching a real OTLP/gRPC endpoint through either
recorder, the exporter ending on shutdown and when its service dies, and the OTLP encoding against the official
messages."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from radixmesh.services.common.trace_pipe import SpanPipe
from tests.otlp_receiver import OtlpReceiver

ROOT = Path(__file__).resolve().parents[2]


def test_the_buffer_drops_and_counts_when_the_exporter_does_not_read():
    reader = [sys.executable, "-c", "import time; time.sleep(60)"]  # never reads its stdin
    pipe = SpanPipe(reader, max_queue=100, batch=10_000, delay_s=60.0)  # the writer does not wake by itself
    try:
        for i in range(250):
            pipe.add((i,))
        assert pipe.dropped == 150 and len(pipe._queue) == 100
    finally:
        started = time.monotonic()
        pipe.close(timeout_s=2.0)
    assert time.monotonic() - started < 10 and pipe.proc.poll() is not None
    assert pipe.sent == 100 and pipe.dropped == 150  # the 100 queued went into the pipe; the reader was killed
    pipe.add(("late",))
    assert pipe.dropped == 151


def _traced(code: str, endpoint: str, **env) -> subprocess.Popen:
    """A process that sets up tracing for role "router" towards `endpoint` and runs `code`."""
    prologue = f"""
        import os, sys, time
        from radixmesh.services.common import tracing
        assert tracing.setup_tracing(tracing.TraceSettings(otlp_traces_endpoint="{endpoint}"), "router")
        print(tracing.tracer().proc.pid, flush=True)
    """
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(prologue) + textwrap.dedent(code)], cwd=ROOT,
                            env={**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "100", **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("recorder_kind", ["native", "python"])
def test_spans_reach_the_collector_and_the_exporter_ends_with_the_process(recorder_kind):
    receiver = OtlpReceiver()
    try:
        proc = _traced("""
            root = tracing.server_span({})  # the router's request span: a Root of the recorder in use
            tracing.leaf("route", tracing.INTERNAL, tracing.clock(), ("policy", "matched_tokens"), ("p", None))
            call = tracing.open_call()
            tracing.close_call(call, "worker Generate", tracing.CLIENT, ("worker",), ("w",))
            root.finish("POST /generate", ("http.response.status_code",), (200,))
            print(root.trace_id_hex, tracing.trace_recorder_kind(), flush=True)
            with tracing.root_span("GET /x", {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
                               **{"http.route": "/x"}) as s:
                tracing.set_attributes(request_id="r1", skipped=None)
                tracing.record_span("queue", time.monotonic() - 0.01, time.monotonic(),
                                    (("first_token", time.monotonic(), {"n": 1}),), index=0)
                with tracing.span("fails"):
                    try:
                        with tracing.span("inner", tags=["a", "b"], obj=object()):
                            raise RuntimeError("boom")
                    except RuntimeError:
                        pass
        """, receiver.endpoint, OTEL_RESOURCE_ATTRIBUTES="deployment.environment=test",
                       RADIXMESH_TRACE_RECORDER=recorder_kind)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        exporter, request_trace, kind = out.split()
        assert kind == recorder_kind
        assert _gone(int(exporter), 10), "the exporter outlived a clean exit"
        spans = receiver.wait_for("0af7651916cd43dd8448eb211c80319c", {"GET /x", "queue", "fails", "inner"}, 30)
        request = receiver.wait_for(request_trace, {"POST /generate", "route", "worker Generate"}, 30)
    finally:
        receiver.close()
    top = next(s for s in request if s.name == "POST /generate")
    assert top.parent_id in ("", None) and top.attributes == {"http.response.status_code": 200}
    assert {s.name: s.parent_id for s in request if s is not top} == {"route": top.span_id,
                                                                       "worker Generate": top.span_id}
    assert next(s for s in request if s.name == "route").attributes == {"radixmesh.policy": "p"}
    by_name = {s.name: s for s in spans}
    root = by_name["GET /x"]
    assert root.service == "radixmesh-router" and root.parent_id == "b7ad6b7169203331" and root.kind == 2
    assert root.attributes == {"http.route": "/x", "radixmesh.request_id": "r1"}
    assert by_name["queue"].parent_id == root.span_id and by_name["queue"].events == ("first_token",)
    assert by_name["queue"].attributes == {"radixmesh.index": 0}
    assert by_name["inner"].parent_id == by_name["fails"].span_id and by_name["inner"].events == ("exception",)
    assert "array_value" in by_name["inner"].attributes["radixmesh.tags"]
    assert by_name["inner"].attributes["radixmesh.obj"].startswith("<object object")


def test_the_exporter_ends_when_its_service_is_killed():
    proc = _traced("time.sleep(60)", "127.0.0.1:9")  # nothing listens there: the exporter must not hang on it
    try:
        exporter = int(proc.stdout.readline())
        assert not _gone(exporter, 0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert _gone(exporter, 10), "the exporter outlived its service"
    finally:
        proc.kill()
        proc.communicate()


def test_sdk_disabled_turns_tracing_off():
    code = """
        import os
        os.environ["OTEL_SDK_DISABLED"] = "true"
        from radixmesh.services.common import tracing
        assert tracing.setup_tracing(tracing.TraceSettings(enable_trace=True), "router") is False
        assert not tracing.enabled() and tracing.span("x") is tracing.span("y")
        print("ok")
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_the_otlp_encoding_parses_as_the_official_messages():
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan

    from radixmesh.services.common import trace_otlp

    values = {"s": "é", "t": True, "f": False, "i": 7, "neg": -3, "big": 1 << 70, "x": 2.5, "b": b"\x00\xff",
              "l": [1, "a"], "none": None, "http.route": "/x", "o": Path("/p")}
    records = [(1 << 127 | 5, 9, 0, False, "root", 2, 10, 20, values, None, None, ""),
               (3, 1 << 63, 9, True, "child", 3, 11, 1 << 63, {"i": 7}, [("ev", 12, {"n": 1}), ("bare", 13, {})],
                (2, "HTTP 500"), "k=v")]
    got = ExportTraceServiceRequest.FromString(trace_otlp.request(trace_otlp.resource({"service.name": "svc"}),
                                                                  "radixmesh", records))
    rs = got.resource_spans[0]
    assert [(a.key, a.value.string_value) for a in rs.resource.attributes] == [("service.name", "svc")]
    assert rs.scope_spans[0].scope.name == "radixmesh"
    root, child = rs.scope_spans[0].spans
    assert root.trace_id == (1 << 127 | 5).to_bytes(16, "big") and root.span_id == (9).to_bytes(8, "big")
    assert root.parent_span_id == b"" and root.kind == ProtoSpan.SPAN_KIND_SERVER and root.flags == 0x101
    assert (root.start_time_unix_nano, root.end_time_unix_nano, root.name) == (10, 20, "root")
    attrs = {a.key: a.value for a in root.attributes}
    assert list(attrs) == ["radixmesh." + k for k in "s t f i neg big x b l".split()] + ["http.route", "radixmesh.o"]
    assert attrs["radixmesh.s"].string_value == "é" and attrs["radixmesh.t"].bool_value
    assert attrs["radixmesh.f"].WhichOneof("value") == "bool_value" and not attrs["radixmesh.f"].bool_value
    assert attrs["radixmesh.i"].int_value == 7 and attrs["radixmesh.neg"].int_value == -3
    assert attrs["radixmesh.big"].string_value == str(1 << 70) and attrs["radixmesh.x"].double_value == 2.5
    assert attrs["radixmesh.b"].bytes_value == b"\x00\xff" and attrs["radixmesh.o"].string_value == "/p"
    assert [v.int_value or v.string_value for v in attrs["radixmesh.l"].array_value.values] == [1, "a"]
    assert child.parent_span_id == (9).to_bytes(8, "big") and child.flags == 0x301 and child.trace_state == "k=v"
    assert child.end_time_unix_nano == 1 << 63 and child.status.code == 2 and child.status.message == "HTTP 500"
    assert [(e.name, e.time_unix_nano, [a.key for a in e.attributes]) for e in child.events] == [
        ("ev", 12, ["radixmesh.n"]), ("bare", 13, [])]
    again = trace_otlp.request(trace_otlp.resource({"service.name": "svc"}), "radixmesh", records)  # from the cache
    assert ExportTraceServiceRequest.FromString(again) == got
