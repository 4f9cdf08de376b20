"""services.common.tracing on the OpenTelemetry SDK: off by default and then nothing of OpenTelemetry is loaded or
installed (no SDK objects, no interceptors, a shared null context per span); the flags (--trace-sample-ratio
validated, passed on by the launcher) and which sampler wins over OTEL_TRACES_SAMPLER; on, the sampler's ratio is
honoured for new traces, a caller's sampled traceparent is always followed (parent-based) whatever the ratio, the
context travels in stream-lane requests, log lines carry the trace id and the spans reach a real OTLP endpoint.
Each traced case runs in a fresh interpreter (a process has one tracer provider)."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.otlp_receiver import OtlpReceiver

ROOT = Path(__file__).resolve().parents[2]


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def receiver():
    r = OtlpReceiver()
    try:
        yield r
    finally:
        r.close()


def test_tracing_off_installs_nothing():
    proc = run("""
        import sys
        import radixmesh.services.router.__main__, radixmesh.services.worker.__main__
        import radixmesh.services.tokenizer.__main__
        import radixmesh.services.kvstore.__main__, radixmesh.services.launch
        from radixmesh.services.common import tracing, trace_grpc
        from radixmesh.services.common.server import GrpcService, GrpcSettings, channel
        from radixmesh.services.common.errors import ErrorInterceptor
        from radixmesh.services.launch import trace_flags
        assert tracing.setup_tracing(tracing.TraceSettings(), "router") is False
        assert not tracing.enabled() and tracing.tracer() is None
        assert tracing.span("x") is tracing.span("y")  # the shared null context
        with tracing.span("x") as s:
            assert s is None
        assert tracing.start_span("x") is None and tracing.metadata_for(None) is None
        assert tracing.server_span({}) is None and tracing.clock() == 0 and tracing.current_span() is None
        assert trace_grpc.client_interceptors() == [] and trace_grpc.server_interceptors() == []
        ch = channel("127.0.0.1:1")
        assert not ch._unary_unary_interceptors and not ch._unary_stream_interceptors
        assert trace_flags({}) == []
        from radixmesh.services.common import logs
        assert logs.trace_id_source is None
        loaded = [m for m in sys.modules if m.startswith("opentelemetry")]
        assert loaded == [], loaded
        print("ok")
    """)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


def test_trace_settings_and_launcher_flags():
    from radixmesh.services.common.tracing import TraceSettings
    from radixmesh.services.launch import main as launch_main, trace_flags

    assert not TraceSettings().enabled and TraceSettings(enable_trace=True).enabled
    assert TraceSettings(otlp_traces_endpoint="c:4317").enabled  # asking for an endpoint means asking for traces
    assert trace_flags({"enable_trace": True}) == ["--enable-trace"]
    assert trace_flags({"otlp_traces_endpoint": "c:4317"}) == ["--otlp-traces-endpoint", "c:4317", "--enable-trace"]
    assert trace_flags({"enable_trace": True, "trace_sample_ratio": 1.0}) == [
        "--enable-trace", "--trace-sample-ratio", "1.0"]
    assert trace_flags({"trace_sample_ratio": 0.5}) == []  # a ratio alone does not turn tracing on
    for ratio in (0.0, 0.25, 1.0):
        assert TraceSettings(trace_sample_ratio=ratio).trace_sample_ratio == ratio
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match=r"--trace-sample-ratio must be in \[0, 1\]"):
            TraceSettings(trace_sample_ratio=bad)
        with pytest.raises(ValueError, match="--trace-sample-ratio"):
            trace_flags({"enable_trace": True, "trace_sample_ratio": bad})
    assert launch_main(["serve", "--model-path", "m", "--enable-trace", "--trace-sample-ratio", "7"]) == 2


def test_bad_ratio_stops_a_service_with_the_reason():
    proc = subprocess.run([sys.executable, "-m", "radixmesh.services.router", "--tokenizer-url", "127.0.0.1:1",
                           "--enable-trace", "--trace-sample-ratio", "2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "--trace-sample-ratio must be in [0, 1]" in proc.stderr, proc.stderr


def test_sampler_flag_wins_over_otel_traces_sampler_which_wins_over_the_default():
    from radixmesh.services.common.tracing import DEFAULT_SAMPLE_RATIO, TraceSettings, sampler

    described = lambda s: s.get_description()  # noqa: E731
    flagged = sampler(TraceSettings(trace_sample_ratio=0.5), {"OTEL_TRACES_SAMPLER": "always_on"})
    assert described(flagged).startswith("ParentBased{root:TraceIdRatioBased{0.5}")
    assert sampler(TraceSettings(), {"OTEL_TRACES_SAMPLER": "always_on"}) is None  # the SDK reads the variables
    assert described(sampler(TraceSettings(), {})).startswith(
        f"ParentBased{{root:TraceIdRatioBased{{{DEFAULT_SAMPLE_RATIO}}}")


def traced(endpoint: str, ratio: float, body: str) -> subprocess.CompletedProcess:
    """`body` run after tracing was set up for a router at `ratio`, exporting to `endpoint`, then shut down."""
    return run(f"""
        from radixmesh.services.common import tracing
        assert tracing.setup_tracing(tracing.TraceSettings(otlp_traces_endpoint="{endpoint}",
                                                           trace_sample_ratio={ratio}), "router")
        {textwrap.indent(textwrap.dedent(body), " " * 8).lstrip()}
        tracing.shutdown_tracing()
    """)


def test_ratio_is_honoured_for_new_traces(receiver):
    proc = traced(receiver.endpoint, 0.25, """
        import random
        for _ in range(400):
            s = tracing.server_span({})
            if s is not None:
                with tracing.span("child"):
                    pass
                s.finish("GET /x", ("http.request.method",), ("GET",))
        # server_span's inline decision on a new trace is the SDK sampler's own
        ids = [random.getrandbits(128) for _ in range(2000)]
        assert [tracing._keeps_new(i) for i in ids] == [
            tracing._sampler.should_sample(None, i, "x").decision.is_sampled() for i in ids]
    """)
    assert proc.returncode == 0, proc.stderr
    roots = [s for s in receiver.spans if s.name == "GET /x"]
    # binomial(400, 0.25): 100 +- 8.7; the bounds are 5 standard deviations
    assert 56 <= len(roots) <= 144, len(roots)
    children = [s for s in receiver.spans if s.name == "child"]
    assert sorted(c.parent_id for c in children) == sorted(r.span_id for r in roots)


def test_a_callers_sampled_traceparent_is_followed_whatever_the_ratio(receiver):
    trace_id, caller = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    proc = traced(receiver.endpoint, 0.0, f"""
        from radixmesh.v1 import worker_pb2
        assert tracing.server_span({{}}) is None  # ratio 0: a new trace is left out, nothing is current
        assert tracing.current_span() is None and tracing.clock() == 0 and tracing.current_metadata() is None
        assert tracing.server_span({{"traceparent": "00-{trace_id}-{caller}-00"}}) is None  # the caller's "no"
        s = tracing.server_span({{"traceparent": "00-{trace_id}-{caller}-01", "baggage": "k=v"}})
        assert s is not None and tracing.current_trace_id() == "{trace_id}"
        tracing.set_attribute("request_id", "r1")
        start = tracing.clock()
        tracing.leaf("route", tracing.INTERNAL, start, ("policy", "matched_tokens"), ("p", None))
        request = worker_pb2.GenerateRequest()
        assert tracing.put_context(request, tracing.current_span())  # what goes over a stream lane
        carried = tracing.carried_context(request)
        assert carried["baggage"] == "k=v" and "{trace_id}" in carried["traceparent"]
        tracing.clear_context(request, None)
        assert request == worker_pb2.GenerateRequest() and tracing.carried_context(request) is None
        call = tracing.start_span("worker Generate", worker="w", role="prefill")
        assert dict(tracing.metadata_for(call))["traceparent"].split("-")[2] == format(
            call.get_span_context().span_id, "016x")
        tracing.end_span(call, RuntimeError("gone"))
        with tracing.root_span("radixmesh.v1.WorkerService/Generate", carried, **{{"rpc.system": "grpc"}}):
            tracing.record_span("queue", 1.0, 2.0, (("admitted", 1.5, {{"index": 0}}),), index=0)
        s.finish("POST /generate", ("http.response.status_code",), (200,))
    """)
    assert proc.returncode == 0, proc.stderr
    spans = {s.name: s for s in receiver.wait_for(trace_id, {"POST /generate", "queue"}, timeout=10)}
    assert set(spans) == {"POST /generate", "route", "worker Generate", "radixmesh.v1.WorkerService/Generate",
                          "queue"}, sorted(spans)
    root = spans["POST /generate"]
    assert root.parent_id == caller and root.attributes == {"http.response.status_code": 200,
                                                            "radixmesh.request_id": "r1"}
    assert spans["route"].parent_id == root.span_id and spans["route"].attributes == {"radixmesh.policy": "p"}
    call = spans["worker Generate"]
    assert call.parent_id == root.span_id and call.status == 2 and call.events == ("exception",)
    served = spans["radixmesh.v1.WorkerService/Generate"]
    assert served.parent_id == root.span_id and spans["queue"].parent_id == served.span_id
    assert spans["queue"].events == ("admitted",) and spans["queue"].end_ns - spans["queue"].start_ns == 10**9
    assert {s.trace_id for s in receiver.spans} == {trace_id}  # nothing else was traced


def test_log_lines_carry_the_trace_id_and_spans_reach_the_endpoint(receiver):
    proc = run(f"""
        import logging
        from radixmesh.services.common import tracing
        from radixmesh.services.common.logs import setup_logging
        setup_logging("test")
        assert tracing.setup_tracing(tracing.TraceSettings(enable_trace=True, trace_sample_ratio=1.0,
                                                           otlp_traces_endpoint="{receiver.endpoint}"), "router")
        logging.getLogger("t").info("outside")
        with tracing.root_span("outer", {{}}, policy="p"):
            logging.getLogger("t").info("inside")
            print(tracing.current_trace_id())
        tracing.shutdown_tracing()
    """)
    assert proc.returncode == 0, proc.stderr
    trace_id = proc.stdout.strip()
    inside = next(ln for ln in proc.stderr.splitlines() if ln.endswith("inside"))
    outside = next(ln for ln in proc.stderr.splitlines() if ln.endswith("outside"))
    assert f"trace={trace_id}]" in inside and "trace=" not in outside
    spans = receiver.wait_for(trace_id, {"outer"}, timeout=10)
    assert [(s.name, s.service, s.attributes.get("radixmesh.policy")) for s in spans] == [
        ("outer", "radixmesh-router", "p")]
