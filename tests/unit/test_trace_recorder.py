"""The light span recorder behind services.common.tracing (trace_recorder, trace_context, trace_pipe,
trace_export): ids and parent links, W3C traceparent in and out, the OTEL_TRACES_SAMPLER variables, each test run
through the Python recorder and the native one. The pipe and the exporter process are in test_trace_export.py, the
native recorder's own behaviour in test_native_span_recorder.py."""

from __future__ import annotations

import marshal
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from radixmesh.v1 import tokenizer_pb2, worker_pb2
from radixmesh.services.common import trace_recorder
from radixmesh.services.common.trace_context import Propagation, Sampler, extract, parse_traceparent, traceparent
from radixmesh.services.common.trace_recorder import CLIENT, CURRENT, Child, Record, Span

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
    from radixmesh.services.common import tracing

    monkeypatch.setattr(tracing, "_pipe", object())
    for name, value in (("_Span", Span), ("_Child", Child), ("_Root", recorder.Root), ("_new_root", recorder.root),
                        ("_call_traceparent", recorder.call_traceparent), ("_current", CURRENT),
                        ("_propagation", Propagation()), ("_extract", extract)):
        monkeypatch.setattr(tracing, name, value)
    if recorder.kind == "native":  # the call sites' helpers in C too, as setup_tracing binds them
        trace_recorder.native.bind(*tracing._PYTHON_HELPERS, True)
        for name in ("server_span", "put_context", "set_attribute", "clear_context"):
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

    from radixmesh.services.common import tracing
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

    from radixmesh.services.common import tracing
    from radixmesh.services.router import http_common
    from radixmesh.services.router.core import RouterError

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

    from radixmesh.services.common import tracing
    _tracing_on(monkeypatch, recorder)
    names = ("policy", "worker", "matched_tokens")
    recorder.leaf("route", 1, 5, names, ("p", "w", None))  # no current span: nothing
    assert recorder.open_call() is None
    with Span("root", 2, {}, None) as root:
        recorder.leaf("route", 1, 5, names, ("p", "w", None))
        call = recorder.open_call()
        carrier = worker_pb2.GenerateRequest()
        assert tracing.put_context(carrier, call)
        assert carrier.traceparent == f"00-{root.trace_id:032x}-{call[1]:016x}-01"
        assert tracing.carried_context(carrier) == {"traceparent": carrier.traceparent, "tracestate": "",
                                                    "baggage": ""}
        tracing.clear_context(carrier, call)
        assert carrier == worker_pb2.GenerateRequest() and tracing.carried_context(carrier) is None
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
        carrier = tokenizer_pb2.TokenizeRequest()
        assert tracing.put_context(carrier, quiet) and carrier.traceparent.endswith("-00")
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


def test_a_call_under_a_callers_span_carries_its_tracestate_and_baggage_until_cleared(records, recorder,
                                                                                      monkeypatch):
    """A request sent over a stream carries the context in plain fields (put_context): a trace that came from a
    caller passes its tracestate and baggage on; clear_context leaves the request as it was, with either recorder
    (the native one clears a Root's call itself and hands this case to the Python helper)."""
    from radixmesh.services.common import tracing
    _tracing_on(monkeypatch, recorder)
    caller = extract({"traceparent": f"00-{7:032x}-{9:016x}-01", "tracestate": "k=v", "baggage": "user=1"},
                     Propagation())
    with Span("server", 2, {}, Span.remote(caller)):
        call = recorder.open_call()
    request = tokenizer_pb2.TokenizeRequest(text="x")
    assert tracing.put_context(request, call)
    assert request.traceparent == f"00-{7:032x}-{call[1]:016x}-01"
    assert tracing.carried_context(request) == {"traceparent": request.traceparent, "tracestate": "k=v",
                                                "baggage": "user=1"}
    tracing.clear_context(request, call)
    assert request == tokenizer_pb2.TokenizeRequest(text="x")


def test_a_request_under_the_requests_own_span_carries_that_spans_context(records, recorder, monkeypatch):
    """The router's calls that record no client span (tokenize, a colocated worker call) put the current span's
    context into the request: a Root's (in C for the native one) or a Span's, its own span id as the parent; the
    callee's span is then that span's child. clear_context takes it out again."""
    from radixmesh.services.common import tracing
    _tracing_on(monkeypatch, recorder)
    root = tracing.server_span({})
    try:
        request = worker_pb2.GenerateRequest(request_id="r")
        assert tracing.put_context(request, tracing.current_span())
        assert request.traceparent == root.traceparent() == f"00-{root.trace_id:032x}-{root.span_id:016x}-01"
        assert tracing.carried_context(request)["traceparent"] == root.traceparent()
        tracing.clear_context(request, root)
        assert request == worker_pb2.GenerateRequest(request_id="r")
    finally:
        root.finish("POST /generate", (), ())
    with Span("server", 2, {}, None) as span:
        request = tokenizer_pb2.TokenizeRequest(text="x")
        assert tracing.put_context(request, span) and request.traceparent == span.traceparent()
        tracing.clear_context(request, span)
        assert request == tokenizer_pb2.TokenizeRequest(text="x")
    assert not tracing.put_context(request, None) and request.traceparent == ""


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
