"""Traces end to end: `radixmesh serve --enable-trace --otlp-traces-endpoint --trace-sample-ratio 1.0` exporting to a
real OTLP/gRPC endpoint in the test (tests/otlp_receiver.py). For a colocated request (sent with a W3C traceparent,
whose trace id the mesh must keep) and a prefill/decode request routed on the kvstore's index, every process's
spans arrive over the wire and form one connected trace per request: a single root (the router's HTTP span, a child
of the client's span when it sent one), every other span's parent in the same trace, and the spans named in the
design (tokenize, route, PD's worker calls, queue, prefill, decode with its events, KV handoff and transfer,
kvstore calls). Health probes and load polls start no traces."""

from __future__ import annotations

import json
import os
import secrets

import pytest

from tests.conftest import model_path
from tests.e2e.conftest import MODEL
from tests.e2e.mesh import launch, stop_and_check
from tests.e2e.test_mesh_faults import post
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

NAME = model_path(MODEL)
GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
WORKER = "radixmesh.v1.WorkerService/Generate"
TOKENIZE = "radixmesh.v1.TokenizerService/Tokenize"
# colocated, the router sends /generate's text to the worker, which tokenizes it (its `tokenize` span); a PD pair
# (and kv_index) gets ids from the tokenizer service
COLOCATED = {"POST /generate", "route", WORKER, "tokenize", "queue", "prefill", "decode"}
PD = COLOCATED - {"tokenize"} | {TOKENIZE, "worker Generate", "kvstore MatchPrefix",
                                 "radixmesh.v1.KvStoreService/MatchPrefix", "kv_handoff",
                                 "radixmesh.v1.KvBootstrapService/Handoff", "kv_transfer"}


@pytest.fixture(scope="module")
def receiver():
    r = OtlpReceiver()
    old = {k: os.environ.get(k) for k in ("OTEL_BSP_SCHEDULE_DELAY", "RADIXMESH_KVSTORE_TIMEOUT_S")}
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # export every 0.2 s instead of 5 s
    os.environ["RADIXMESH_KVSTORE_TIMEOUT_S"] = "10"  # the router's MatchPrefix bound, generous on a busy machine
    try:
        yield r
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        r.close()


def traced_mesh(receiver: OtlpReceiver, tmp, *args: str):
    """Every request traced (the default ratio keeps a share of new traces)."""
    return launch(NAME, tmp, "--enable-trace", "--otlp-traces-endpoint", receiver.endpoint, "--trace-sample-ratio",
                  "1.0", *args)


def assert_connected(spans: list[ReceivedSpan], client_parent: str = "") -> ReceivedSpan:
    """One root (its parent: `client_parent`, the client's span that is not in the trace), every other span's
    parent in the trace, no span twice. Returns the root."""
    ids = {s.span_id for s in spans}
    assert len(ids) == len(spans), "a span id appears twice"
    roots = [s for s in spans if s.parent_id not in ids]
    assert [(r.name, r.parent_id) for r in roots] == [("POST /generate", client_parent)], \
        f"roots: {[(r.service, r.name, r.parent_id) for r in roots]}"
    return roots[0]


def by_name(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def parent(spans: list[ReceivedSpan], s: ReceivedSpan) -> ReceivedSpan:
    return next(p for p in spans if p.span_id == s.parent_id)


def check_common(spans: list[ReceivedSpan], root: ReceivedSpan, router_tokenizes: bool) -> None:
    assert root.service == "radixmesh-router"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["radixmesh.request_id"]
    route = by_name(spans, "route")[0]
    assert parent(spans, route) == root
    if router_tokenizes:
        # the router's call to the tokenizer has no client span: the tokenizer's server span hangs off the request's
        tok = by_name(spans, TOKENIZE)[0]
        assert tok.service == "radixmesh-tokenizer" and parent(spans, tok) == root
        assert by_name(spans, "tokenize") == []
        assert {"radixmesh.policy", "radixmesh.worker", "radixmesh.prompt_tokens"} <= set(route.attributes)
    else:  # routed on the text (its length in bytes), tokenized in the worker's Generate
        assert by_name(spans, TOKENIZE) == []
        assert {"radixmesh.policy", "radixmesh.worker", "radixmesh.prompt_bytes"} <= set(route.attributes)
        tokenize = by_name(spans, "tokenize")[0]
        assert parent(spans, tokenize).name == WORKER and tokenize.attributes["radixmesh.prompt_tokens"] > 0
    decode = by_name(spans, "decode")[0]
    assert decode.events == ("first_token", "finished")
    assert decode.attributes["radixmesh.completion_tokens"] == GREEDY["max_new_tokens"]
    assert parent(spans, decode).name == WORKER


def test_colocated_request_is_one_trace_with_the_clients_trace_id(receiver, tmp_path):
    mesh = traced_mesh(receiver, tmp_path)
    try:
        trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
        status, raw = post(mesh.url + "/generate", {"text": "The capital of France is", "sampling_params": GREEDY},
                           headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
        assert status == 200, raw
        assert json.loads(raw)["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
        status, raw = post(mesh.url + "/generate", {"text": "Another prompt", "sampling_params": GREEDY},
                           headers={})
        assert status == 200, raw
        # a chat prompt goes to the worker as messages too: the worker renders and tokenizes it
        chat_trace = secrets.token_hex(16)
        status, raw = post(mesh.url + "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 3,
                            "temperature": 0}, headers={"traceparent": f"00-{chat_trace}-{client_span}-01"})
        assert status == 200, raw
        assert json.loads(raw)["usage"]["prompt_tokens"] > 0
        spans = receiver.wait_for(trace_id, COLOCATED)
        chat_spans = receiver.wait_for(chat_trace, {"POST /v1/chat/completions", "route", WORKER, "tokenize",
                                                    "decode"})
    finally:
        stop_and_check(mesh)
    assert by_name(chat_spans, TOKENIZE) == [], "the router asked the tokenizer service to render the chat"
    rendered = by_name(chat_spans, "tokenize")[0]
    assert parent(chat_spans, rendered).name == WORKER and rendered.attributes["radixmesh.chat_messages"] == 1
    assert rendered.attributes["radixmesh.prompt_tokens"] > 0
    assert COLOCATED <= {s.name for s in spans}, sorted({s.name for s in spans})
    root = assert_connected(spans, client_parent=client_span)
    check_common(spans, root, router_tokenizes=False)
    assert {s.service for s in spans} == {"radixmesh-router", "radixmesh-colocated"}
    worker = {s.name for s in spans if s.service == "radixmesh-colocated"}
    assert {"queue", "prefill", "decode", WORKER} <= worker
    # a colocated call that worked has no client span either: the worker's server span is the request's child
    assert by_name(spans, "worker Generate") == [] and parent(spans, by_name(spans, WORKER)[0]) == root
    prefill = by_name(spans, "prefill")[0]
    assert parent(spans, prefill).name == WORKER and prefill.end_ns <= by_name(spans, "decode")[0].start_ns
    # the request without a traceparent got a trace of its own; nothing else (health probes, polls) was traced
    roots = [s for s in receiver.spans if s.name == "POST /generate"]
    assert len(roots) == 2 and len({r.trace_id for r in roots}) == 2
    traced = {r.trace_id for r in roots} | {chat_trace}
    assert [(s.service, s.name) for s in receiver.spans if s.trace_id not in traced] == []
    for r in roots:
        assert_connected(receiver.trace(r.trace_id), client_parent=client_span if r.trace_id == trace_id else "")


def test_pd_request_is_one_trace_across_router_tokenizer_prefill_decode_and_kvstore(receiver, tmp_path):
    pytest.importorskip("mooncake.engine", reason="needs the Mooncake transfer engine (mooncake-transfer-engine)")
    seen = {s.trace_id for s in receiver.spans}
    mesh = traced_mesh(receiver, tmp_path, "--disaggregation", "pd", "--disaggregation-transfer-backend", "mooncake",
                       "--kvstore", "--policy", "kv_index")
    try:
        trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
        status, raw = post(mesh.url + "/generate", {"text": "The capital of France is", "sampling_params": GREEDY},
                           headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
        assert status == 200, raw
        spans = receiver.wait_for(trace_id, PD)
    finally:
        stop_and_check(mesh)
    assert PD <= {s.name for s in spans}, sorted({s.name for s in spans})
    root = assert_connected(spans, client_parent=client_span)
    check_common(spans, root, router_tokenizes=True)
    assert {s.service for s in spans} == {"radixmesh-router", "radixmesh-tokenizer", "radixmesh-kvstore",
                                         "radixmesh-prefill", "radixmesh-decode"}
    calls = {s.attributes["radixmesh.role"]: s for s in by_name(spans, "worker Generate")}
    assert set(calls) == {"prefill", "decode"} and all(parent(spans, c) == root for c in calls.values())
    served = {s.service: s for s in by_name(spans, WORKER)}
    assert parent(spans, served["radixmesh-prefill"]) == calls["prefill"]
    assert parent(spans, served["radixmesh-decode"]) == calls["decode"]
    match = by_name(spans, "radixmesh.v1.KvStoreService/MatchPrefix")[0]
    assert match.service == "radixmesh-kvstore" and parent(spans, match).name == "kvstore MatchPrefix"
    assert parent(spans, parent(spans, match)).name == "route"
    assert by_name(spans, "prefill")[0].service == "radixmesh-prefill"
    assert by_name(spans, "decode")[0].service == "radixmesh-decode"
    handoff = by_name(spans, "kv_handoff")[0]
    assert handoff.service == "radixmesh-decode" and parent(spans, handoff) == served["radixmesh-decode"]
    assert {"bootstrapping", "transferring", "decoding"} <= set(handoff.events)
    bootstrap = by_name(spans, "radixmesh.v1.KvBootstrapService/Handoff")[0]
    assert bootstrap.service == "radixmesh-prefill" and parent(spans, bootstrap) == handoff
    transfers = {s.attributes["radixmesh.direction"]: s for s in by_name(spans, "kv_transfer")}
    assert transfers["send"].service == "radixmesh-prefill" and transfers["receive"].service == "radixmesh-decode"
    assert transfers["send"].attributes["radixmesh.bytes"] > 0
    assert parent(spans, transfers["receive"]) == handoff
    new = {s.trace_id for s in receiver.spans} - seen
    assert new == {trace_id}, "something other than the request was traced"
