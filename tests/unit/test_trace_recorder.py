"""The light span recorder behind services.common.tracing (trace_recorder, trace_context, trace_pipe,
trace_export): ids and parent links, W3C traceparent in and out, the OTEL_TRACES_SAMPLER variables, the bounded
buffer dropping (and counting) spans when the exporter does not read, and the exporter process: spans reach a real
OTLP/gRPC endpoint, and the process ends on shutdown and when its service dies."""

from __future__ import annotations

import marshal
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.common import trace_recorder
from services.common.trace_context import Propagation, Sampler, extract, parse_traceparent, traceparent
from services.common.trace_pipe import SpanPipe
from services.common.trace_recorder import CLIENT, CURRENT, Child, Record, Span
from tests.otlp_receiver import OtlpReceiver

ROOT = Path(__file__).resolve().parents[2]
W3C = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-0[01]$")


@pytest.fixture(params=["python", "native"])
def recorder(request, monkeypatch):
    """Each recorder in turn, as trace_recorder.api() gives it: the Python one, and the native one `make` builds
    (services/common/_spanrec.c), which the router uses where it is built."""
    if request.param == "python":
        monkeypatch.setattr(trace_recorder, "native", None)
    elif trace_recorder.native is None:
        pytest.fail("the native span recorder is not built here: run `make native`")
    return SimpleNamespace(kind=request.param, **dict(zip(
        ("root", "Root", "open_call", "close_call", "leaf", "call_traceparent"), trace_recorder.api())))


def _tracing_on(monkeypatch, recorder) -> None:
    """services.common.tracing on, bound to `recorder`, without an exporter (the sink is what `configure` set)."""
    from services.common import tracing

    monkeypatch.setattr(tracing, "_pipe", object())
    for name, value in (("_Span", Span), ("_Child", Child), ("_Root", recorder.Root), ("_new_root", recorder.root),
                        ("_call_traceparent", recorder.call_traceparent), ("_current", CURRENT),
                        ("_propagation", Propagation()), ("_extract", extract)):
        monkeypatch.setattr(tracing, name, value)
    if recorder.kind == "native":  # the call sites' helpers in C too, as setup_tracing binds them
        trace_recorder.native.bind(*tracing._PYTHON_HELPERS, True)
        for name in ("server_span", "put_context", "set_attribute"):
            monkeypatch.setattr(tracing, name, getattr(trace_recorder.native, name))


@pytest.fixture
def records(recorder):
    """Finished spans as Records (the recorder's sink), with the default sampler; restored afterwards."""
    out: list = []
    trace_recorder.configure(Sampler(), lambda data: out.append(Record(*data)))
    yield out
    trace_recorder.configure(Sampler(), lambda data: None)


def test_ids_parent_links_and_the_current_span(records):
    with Span("root", 2, {"a": 1}, None) as root:
        assert CURRENT.get() is root
        with Span("child", 1, {}, CURRENT.get()) as child:
            loose = Span("call", CLIENT, {"worker": "w"}, CURRENT.get())  # not made current
        loose.end()
        loose.end()  # a second end records nothing
        assert CURRENT.get() is root
    assert CURRENT.get() is None
    by_name = {r.name: r for r in records}
    assert list(by_name) == ["child", "call", "root"]
    assert 0 < root.trace_id < 1 << 128 and 0 < root.span_id < 1 << 64
    assert by_name["root"].parent_id == 0 and not by_name["root"].parent_remote
    assert by_name["child"].trace_id == by_name["call"].trace_id == root.trace_id
    assert by_name["child"].parent_id == root.span_id and by_name["call"].parent_id == child.span_id
    assert len({r.span_id for r in records}) == 3
    assert all(r.start_ns <= r.end_ns for r in records)
    assert by_name["call"].kind == CLIENT and by_name["call"].attributes == {"worker": "w"}
    assert W3C.match(child.traceparent()) and child.traceparent().endswith("-01")


def test_a_child_goes_inside_its_parents_record_or_on_its_own_once_the_parent_ended(records):
    with Span("root", 2, {}, None) as root:
        call = Child("worker Generate", CLIENT, {"worker": "w"}, root)
        early = Child("route", 1, {}, root)
        early.set_attributes({"policy": "p"})
        early.end()
        assert W3C.match(call.traceparent()) and call.traceparent()[36:52] == f"{call.span_id:016x}"
        assert call.traceparent()[3:35] == f"{root.trace_id:032x}" and call.tracestate == ""
        late = Child("late", 1, {}, root)
    call.record_exception(ValueError("gone"))
    call.set_error("gone")
    call.end()  # after its parent: a record of its own
    call.end()
    (rec, alone) = records
    assert rec.name == "root" and [c[1] for c in rec.children] == ["route"] and alone.name == "worker Generate"
    spans = [Record(*r) for r in trace_recorder.expand([tuple(rec), tuple(alone)])]
    assert [s.name for s in spans] == ["root", "route", "worker Generate"]
    route = spans[1]
    assert (route.trace_id, route.parent_id, route.kind, route.attributes) == (root.trace_id, root.span_id, 1,
                                                                               {"policy": "p"})
    assert spans[2].parent_id == root.span_id and spans[2].status == (trace_recorder.STATUS_ERROR, "gone")
    assert [e[0] for e in spans[2].events] == ["exception"] and late.recording  # never ended: never sent


def test_server_spans_end_named_with_their_attributes_and_restore_the_current_span(records, recorder, monkeypatch):
    """tracing.server_span (the router's request span): a Root for a new trace, a Span under a caller's
    traceparent; both current until `finish`, which names them, gives their attributes as values under names (and
    those set while open), marks errors, and makes the span before current again."""
    import asyncio

    from services.common import tracing
    _tracing_on(monkeypatch, recorder)  # the recorder's sink is `records`
    names = ("http.request.method", "http.response.status_code")
    root = tracing.server_span({})
    assert type(root) is recorder.Root and CURRENT.get() is root and root.sampled
    assert W3C.match(root.traceparent()) and root.trace_id_hex == f"{root.trace_id:032x}"
    assert root.traceparent() == f"00-{root.trace_id:032x}-{root.span_id:016x}-01"
    tracing.set_attribute("request_id", "r1")
    recorder.leaf("route", 1, 5, ("policy",), ("p",))
    with tracing.span("detokenize", "client") as inner:  # a Span under a Root
        assert tracing.start_span("call").parent is inner
    assert type(tracing.start_span("call")) is Child
    root.finish("POST /generate", names, ("POST", 200))
    root.finish("again", names, ("POST", 200))  # once
    assert CURRENT.get() is None
    caller_trace, caller_span = "ab" * 16, "cd" * 8
    under = tracing.server_span({"traceparent": f"00-{caller_trace}-{caller_span}-01"})
    assert type(under) is Span and CURRENT.get() is under
    under.finish("POST /v1/completions", names, ("POST", 502), "HTTP 502")
    failed = tracing.server_span({"traceparent": "not a traceparent"})  # refused: a new trace
    assert type(failed) is recorder.Root
    failed.finish("GET /x", names[:1], ("GET",), ValueError("boom"))
    gone = tracing.server_span({})
    gone.finish("GET /y", names[:1], ("GET",), asyncio.CancelledError())
    assert CURRENT.get() is None
    spans = [Record(*r) for r in trace_recorder.expand(marshal.loads(trace_recorder.encode_batch(
        [tuple(r) for r in records])))]
    by_name = {s.name: s for s in spans}
    assert [s.name for s in spans] == ["detokenize", "POST /generate", "route", "POST /v1/completions", "GET /x",
                                       "GET /y"]
    top = by_name["POST /generate"]
    assert (top.trace_id, top.span_id, top.parent_id, top.kind) == (root.trace_id, root.span_id, 0, 2)
    assert top.attributes == {"http.request.method": "POST", "http.response.status_code": 200, "request_id": "r1"}
    assert top.status is None and top.start_ns <= top.end_ns
    assert by_name["route"].parent_id == by_name["detokenize"].parent_id == root.span_id
    assert by_name["route"].trace_id == root.trace_id
    remote = by_name["POST /v1/completions"]
    assert (f"{remote.trace_id:032x}", f"{remote.parent_id:016x}", remote.parent_remote) == (caller_trace,
                                                                                          caller_span, True)
    assert remote.attributes == {"http.request.method": "POST", "http.response.status_code": 502}
    assert remote.status == (trace_recorder.STATUS_ERROR, "HTTP 502")
    assert by_name["GET /x"].status == (trace_recorder.STATUS_ERROR, "ValueError: boom")
    assert [e[0] for e in by_name["GET /x"].events] == ["exception"]
    assert by_name["GET /y"].attributes == {"http.request.method": "GET", "radixmesh.cancelled": True}
    assert by_name["GET /y"].status is None


async def test_the_routers_traced_middleware_names_its_spans_by_route_and_answers_errors(records, recorder,
                                                                                         monkeypatch):
    """services.router.http_common.traced_errors_middleware: one server span per request, named by method and route
    template (cached per route; an unmatched request's route is never cached), the status code among its
    attributes, 5xx marked failed; probes untraced; errors still answered as before."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from services.common import tracing
    from services.router import http_common
    from services.router.core import RouterError

    _tracing_on(monkeypatch, recorder)
    monkeypatch.setattr(http_common, "_SPAN_NAMES", {})

    async def item(request):
        if request.match_info["id"] == "bad":
            raise ValueError("not an item")
        if request.match_info["id"] == "down":
            raise RouterError(503, "no worker")
        return web.json_response({"id": request.match_info["id"]})

    async def health(request):
        return web.Response(text="ok")

    app = web.Application(middlewares=[http_common.traced_errors_middleware])
    app[http_common.INFLIGHT] = {"n": 0}
    app.router.add_get("/items/{id}", item)
    app.router.add_get("/health", health)
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        statuses = [(await client.get(path)).status for path in ("/items/1", "/items/2", "/items/bad", "/items/down",
                                                                 "/nowhere", "/elsewhere", "/health")]
    finally:
        await client.close()
    assert statuses == [200, 200, 400, 503, 404, 404, 200]
    assert app[http_common.INFLIGHT]["n"] == 0 and CURRENT.get() is None
    spans = [Record(*r) for r in trace_recorder.expand([tuple(r) for r in records])]
    assert [s.name for s in spans] == ["GET /items/{id}"] * 4 + ["GET unmatched"] * 2  # /health: none
    assert [s.attributes["http.response.status_code"] for s in spans] == [200, 200, 400, 503, 404, 404]
    assert [s.attributes["url.path"] for s in spans][:2] == ["/items/1", "/items/2"]
    assert {s.attributes["http.route"] for s in spans} == {"/items/{id}", "unmatched"}
    assert [s.status for s in spans] == [None] * 3 + [(trace_recorder.STATUS_ERROR, "HTTP 503")] + [None] * 2
    assert len({s.trace_id for s in spans}) == 6 and all(s.parent_id == 0 and s.kind == 2 for s in spans)
    assert list(http_common._SPAN_NAMES.values()) == [("GET /items/{id}", "/items/{id}")]


def test_an_unsampled_root_records_nothing(recorder):
    out: list = []
    trace_recorder.configure(Sampler("always_off"), out.append)
    try:
        root = recorder.root()
        assert not root.sampled and CURRENT.get() is root
        recorder.leaf("route", 1, 5, ("policy",), ("p",))
        call = recorder.open_call()
        assert call is not None and call[0] is root
        assert recorder.call_traceparent(call) == traceparent(root.trace_id, call[1], False)
        assert recorder.call_traceparent(call).endswith("-00")
        recorder.close_call(call, "worker Generate", CLIENT, ("worker",), ("w",))
        root.finish("POST /generate", ("a",), (1,))
        assert CURRENT.get() is None and out == []
    finally:
        trace_recorder.configure(Sampler(), lambda data: None)


def test_leaves_and_calls_recorded_as_tuples(records, recorder, monkeypatch):
    """tracing.leaf / open_call / close_call (the router's request path): positional attributes, into the open
    parent's record; ids given by the exporter to leaves; a call's context is its own span id; errors and
    cancellations as end_span marks them; after the parent ended, a record of its own."""
    import asyncio

    from services.common import tracing
    _tracing_on(monkeypatch, recorder)
    names = ("policy", "worker", "matched_tokens")
    recorder.leaf("route", 1, 5, names, ("p", "w", None))  # no current span: nothing
    assert recorder.open_call() is None
    with Span("root", 2, {}, None) as root:
        recorder.leaf("route", 1, 5, names, ("p", "w", None))
        call = recorder.open_call()
        carrier: dict = {}
        assert tracing.put_context(carrier, call)
        assert carrier["traceparent"] == f"00-{root.trace_id:032x}-{call[1]:016x}-01"
        recorder.close_call(call, "worker Generate", CLIENT, ("worker",), ("w",), ValueError("bad"))
        cancelled = recorder.open_call()
        recorder.close_call(cancelled, "tokenize", CLIENT, ("prompt_tokens",), (None,), asyncio.CancelledError())
        late = recorder.open_call()
    recorder.close_call(late, "late", CLIENT, ("worker",), ("w",))
    (rec, alone) = records
    assert [c[0] for c in rec.children] == [0, call[1], cancelled[1]]
    spans = [Record(*r) for r in trace_recorder.expand(marshal.loads(trace_recorder.encode_batch(
        [tuple(rec), tuple(alone)])))]
    assert [s.name for s in spans] == ["root", "route", "worker Generate", "tokenize", "late"]
    route, worker, tok, late_span = spans[1:]
    assert route.span_id not in (0, root.span_id, call[1]) and route.parent_id == root.span_id
    assert route.attributes == {"policy": "p", "worker": "w", "matched_tokens": None}  # None: dropped on export
    assert route.start_ns == 5 and route.end_ns >= 5
    assert (worker.span_id, worker.kind, worker.attributes) == (call[1], CLIENT, {"worker": "w"})
    assert worker.status == (trace_recorder.STATUS_ERROR, "bad") and worker.events[0][0] == "exception"
    assert tok.attributes == {"prompt_tokens": None, "cancelled": True} and tok.status is None
    assert (late_span.span_id, late_span.parent_id, late_span.trace_id) == (late[1], root.span_id, root.trace_id)
    records.clear()
    unsampled = Span("root", 2, {}, None)
    unsampled.sampled = unsampled.recording = False
    with unsampled:
        recorder.leaf("route", 1, 5, names, ("p", "w", 0))
        quiet = recorder.open_call()
        carrier = {}
        assert tracing.put_context(carrier, quiet) and carrier["traceparent"].endswith("-00")
        recorder.close_call(quiet, "worker Generate", CLIENT, ("worker",), ("w",))
    assert records == []
    remote = Span.remote(extract({"traceparent": f"00-{7:032x}-{9:016x}-01"}, Propagation()))
    token = CURRENT.set(remote)
    try:
        recorder.leaf("route", 1, 5, names, ("p", "w", 0))
    finally:
        CURRENT.reset(token)
    (r,) = records
    assert (r.trace_id, r.parent_id, r.parent_remote, r.span_id != 0) == (7, 9, True, True)


def test_a_batch_with_values_marshal_cannot_write_goes_as_their_strings():
    rec = (1, 2, 0, False, "root", 2, 3, 4, {"o": object()}, None, None, "",
           [(5, "child", 1, 3, 4, {"p": Path("/x"), "n": 1}, [("ev", 3, {"q": object()})], None)])
    (back,) = trace_recorder.expand(marshal.loads(trace_recorder.encode_batch([rec])))[:1]
    assert back[8]["o"].startswith("<object object")
    child = trace_recorder.expand(marshal.loads(trace_recorder.encode_batch([rec])))[1]
    assert child[8] == {"p": "/x", "n": 1} and child[9][0][2]["q"].startswith("<object object")


def test_an_escaping_exception_marks_the_span_failed(records):
    with pytest.raises(ValueError):
        with Span("work", 1, {}, None) as s:
            s.add_event("step", {"n": 1})
            raise ValueError("bad input")
    (r,) = records
    assert r.status == (trace_recorder.STATUS_ERROR, "ValueError: bad input")
    assert [e[0] for e in r.events] == ["step", "exception"]
    assert r.events[1][2]["exception.type"] == "ValueError" and "bad input" in r.events[1][2]["exception.stacktrace"]


def test_traceparent_in_and_out():
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert parse_traceparent(tp) == (0x0af7651916cd43dd8448eb211c80319c, 0xb7ad6b7169203331, True)
    assert traceparent(*parse_traceparent(tp)) == tp
    for bad in (None, "", tp.upper(), tp[:-1], "ff" + tp[2:], tp.replace("0af7", "0000", 1)[:3] + "0" * 32 + tp[35:],
                tp[:36] + "0" * 16 + tp[52:], "00-xyz", tp + "-extra", tp.replace("-", "_")):
        assert parse_traceparent(bad) is None, bad
    assert parse_traceparent("01" + tp[2:] + "-future") is not None  # a later version may append fields
    ctx = extract({"traceparent": tp, "tracestate": "k=v", "baggage": "user=1"}, Propagation())
    assert ctx.tracestate == "k=v" and ctx.baggage == "user=1" and ctx.sampled
    assert extract({"traceparent": tp}, Propagation(False, False)) is None
    assert extract({"baggage": "user=1"}, Propagation()) is None


def test_a_remote_parent_is_kept(records):
    ctx = extract({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "k=v"},
                  Propagation())
    with Span("server", 2, {}, Span.remote(ctx)) as s:
        pass
    (r,) = records
    assert r.trace_id == ctx.trace_id and r.parent_id == ctx.span_id and r.parent_remote and r.tracestate == "k=v"
    assert s.traceparent().startswith("00-0af7651916cd43dd8448eb211c80319c-")


@pytest.mark.parametrize("env, root, child_of_sampled, child_of_unsampled", [
    ({}, True, True, False),
    ({"OTEL_TRACES_SAMPLER": "always_on"}, True, True, True),
    ({"OTEL_TRACES_SAMPLER": "always_off"}, False, False, False),
    ({"OTEL_TRACES_SAMPLER": "parentbased_always_off"}, False, True, False),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, False, False, False),
    ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, False, True, False),
    ({"OTEL_TRACES_SAMPLER": "no_such_sampler"}, True, True, False),  # the default, with a warning
])
def test_sampler_variables(env, root, child_of_sampled, child_of_unsampled):
    sampler = Sampler.from_env(env)
    assert sampler.sample(None, 12345) is root
    assert sampler.sample(True, 12345) is child_of_sampled
    assert sampler.sample(False, 12345) is child_of_unsampled


def test_traceidratio_decides_on_the_low_64_bits_of_the_trace_id():
    half = Sampler.from_env({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5"})
    assert half.sample(None, (7 << 64) | (1 << 62)) and not half.sample(None, 1 << 63)
    bad = Sampler.from_env({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"})
    assert bad.sample(None, (1 << 64) - 1)  # an invalid ratio means 1.0


def test_an_unsampled_span_records_nothing_and_passes_the_decision_on(records):
    trace_recorder.configure(Sampler("parentbased_always_off"), lambda data: records.append(data))
    with Span("root", 2, {}, None) as root:
        with Span("child", 1, {}, CURRENT.get()) as child:
            child.set_attribute("x", 1)
    assert records == [] and not root.sampled and child.traceparent().endswith("-00")


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
        from services.common import tracing
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
        from services.common import tracing
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

    from services.common import trace_otlp

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


def _router_request(recorder, out: list) -> list[Record]:
    """What the router's request path records, through `recorder`: a Root with an attribute set while open, a
    routing leaf, a worker call, a failed tokenize call and a cancelled one, a Span under it, a failed leaf, a finish
    with an error description, and a call that ends after it. Returns the records (the sink's `out`), expanded."""
    import asyncio

    from services.common import tracing

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
    from services.common import tracing

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

    from services.common import trace_otlp

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


def _any(v):
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

    return AnyValue(string_value=v) if isinstance(v, str) else AnyValue(int_value=v)


def test_the_native_buffer_is_taken_whole_records_at_a_time():
    """take(most): the oldest records whose spans add up to at most `most` (so an export request stays within
    OTEL_BSP_MAX_EXPORT_BATCH_SIZE without being cut), at least one record however large; the rest stays, in order."""
    from services.common import trace_otlp

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


def test_a_forked_process_draws_other_ids(recorder):
    """Ids come from a generator seeded per process: a forked child (the router's --router-workers) must not repeat
    its parent's."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next root's ids
        try:
            root = recorder.root()
            root.finish("x", (), ())
            os.write(write, f"{root.trace_id} {root.span_id}".encode())
        finally:
            os._exit(0)
    os.close(write)
    root = recorder.root()
    root.finish("x", (), ())
    os.waitpid(pid, 0)
    child_trace, child_span = map(int, os.read(read, 200).split())
    os.close(read)
    assert child_trace != root.trace_id and child_span != root.span_id


def test_the_native_traceparent_is_w3cs():
    if trace_recorder.native is None:
        pytest.fail("the native span recorder is not built here: run `make native`")
    from services.common import trace_context

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
    from services.common import trace_otlp

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

    from services.common import trace_otlp

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
        from services.common import _spanrec
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
