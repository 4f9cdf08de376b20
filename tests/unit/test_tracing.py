"""services.common.tracing: off by default and then nothing of OpenTelemetry is loaded or installed (no SDK
objects, no interceptors, a shared null context per span); on, log lines carry the trace id of the current span and
the spans reach a real OTLP endpoint. Each case runs in a fresh interpreter (a process has one tracer provider)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.otlp_receiver import OtlpReceiver

ROOT = Path(__file__).resolve().parents[2]


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_tracing_off_installs_nothing():
    proc = run("""
        import sys
        import radixmesh.services.router.__main__, radixmesh.services.worker.__main__
        import radixmesh.services.tokenizer.__main__
        import radixmesh.services.kvstore.__main__, radixmesh.services.launch
        from radixmesh.services.common import tracing, trace_grpc
        from radixmesh.services.common.server import GrpcService, GrpcSettings, channel
        from radixmesh.services.common.errors import ErrorInterceptor
        from radixmesh.services.launch import LaunchSettings, trace_flags
        assert tracing.setup_tracing(tracing.TraceSettings(), "router") is False
        assert not tracing.enabled() and tracing.tracer() is None
        assert tracing.span("x") is tracing.span("y")  # the shared null context
        with tracing.span("x") as s:
            assert s is None
        assert tracing.start_span("x") is None and tracing.metadata_for(None) is None
        assert trace_grpc.client_interceptors() == [] and trace_grpc.server_interceptors() == []
        ch = channel("127.0.0.1:1")
        assert not ch._unary_unary_interceptors and not ch._unary_stream_interceptors
        assert trace_flags(LaunchSettings()) == []
        from radixmesh.services.common import logs
        assert logs.trace_id_source is None
        loaded = [m for m in sys.modules if m.startswith("opentelemetry")]
        assert loaded == [], loaded
        print("ok")
    """)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


def test_trace_settings_and_launcher_flags():
    from radixmesh.services.common.tracing import TraceSettings
    from radixmesh.services.launch import LaunchSettings, trace_flags

    assert not TraceSettings().enabled and TraceSettings(enable_trace=True).enabled
    assert TraceSettings(otlp_traces_endpoint="c:4317").enabled  # asking for an endpoint means asking for traces
    assert trace_flags(LaunchSettings(enable_trace=True)) == ["--enable-trace"]
    assert trace_flags(LaunchSettings(otlp_traces_endpoint="c:4317")) == ["--enable-trace", "--otlp-traces-endpoint",
                                                                           "c:4317"]


def test_log_lines_carry_the_trace_id_and_spans_reach_the_endpoint():
    receiver = OtlpReceiver()
    try:
        proc = run(f"""
            import logging
            from radixmesh.services.common import tracing
            from radixmesh.services.common.logs import setup_logging
            setup_logging("test")
            assert tracing.setup_tracing(tracing.TraceSettings(enable_trace=True,
                                                               otlp_traces_endpoint="{receiver.endpoint}"), "router")
            logging.getLogger("t").info("outside")
            with tracing.span("outer", kind="server", policy="p") as s:
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
    finally:
        receiver.close()
