"""The router's gateway features triggered for real, with the tokenizer service, the router and fake workers
(benchmarks.fake_worker: delays, refusals, PD roles) as separate processes, and the client-visible result asserted:
retries with backoff around a failing worker and its circuit breaker opening; a hung worker bounded by
--request-timeout-secs; a full queue (429 with Retry-After) and a queue timeout (408); a per-key rate limit that
refills; sticky sessions (X-SMG-Routing-Key, OpenAI `user`) on the manual policy; PD prefill and decode policies
choosing as configured; the admin key and worker URL checks on the admin endpoints."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from radixmesh.v1 import worker_pb2, worker_pb2_grpc
from radixmesh.services.launch import free_port
from tests.conftest import ROOT, model_path
from tests.otlp_receiver import OtlpReceiver
from tests.services.metrics_utils import http_get, scrape, start_grpc, stop, wait_http

MODEL = model_path("tiny-llama")
KEY = "sk-gw"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    proc, url = start_grpc("radixmesh.services.tokenizer", "--model-path", MODEL, "--served-model-name", "fake",
                           log=tmp_path_factory.mktemp("gw") / "tokenizer.log")
    yield url
    stop(proc)


class Mesh:
    """Fake workers and one router started for a test; stopped at its end."""

    def __init__(self, tokenizer: str, tmp):
        self.tokenizer, self.tmp, self.procs = tokenizer, tmp, []
        self.workers: list[str] = []
        self.starting: list[str] = []  # workers started with wait=False, not yet serving

    def worker(self, *args: str, wait: bool = True) -> str:
        """A fake worker on a free port, serving once this returns; wait=False: only started (the next router()
        waits for it), so that several start side by side."""
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "radixmesh.benchmarks.fake_worker", "--port", str(port),
                                 "--served-model-name", "fake", "--tokens", "4", *args], cwd=ROOT)
        self.procs.append(proc)
        url = f"127.0.0.1:{port}"
        self.starting.append(url)
        if wait:
            self.wait_workers()
        self.workers.append(url)
        return url

    def wait_workers(self) -> None:
        for url in self.starting:
            with grpc.insecure_channel(url) as ch:
                grpc.channel_ready_future(ch).result(timeout=30)
        self.starting.clear()

    def router(self, *args: str) -> str:
        self.wait_workers()
        port, metrics = free_port(), free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "radixmesh.services.router", "--port", str(port), "--tokenizer-url", self.tokenizer,
             "--worker-urls", *self.workers, "--api-key", KEY, "--enable-metrics", "--metrics-port", str(metrics),
             "--log-level", "warning", *args],
            cwd=ROOT, stdout=open(self.tmp / f"router-{port}.log", "w"), stderr=subprocess.STDOUT)
        self.procs.append(proc)
        self.metrics_port = metrics
        self.log = self.tmp / f"router-{port}.log"
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/health")
        return base

    def calls(self, url: str) -> int:
        with grpc.insecure_channel(url) as ch:
            info = worker_pb2_grpc.WorkerServiceStub(ch).GetServerInfo(worker_pb2.GetServerInfoRequest(), timeout=5)
        return json.loads(info.server_info_json)["generate_calls"]

    def close(self) -> None:
        for p in reversed(self.procs):
            stop(p)


@pytest.fixture
def mesh(tokenizer, tmp_path):
    m = Mesh(tokenizer, tmp_path)
    yield m
    m.close()


def post(base: str, path: str, body: dict, headers: dict | None = None, key: str = KEY):
    """(status, parsed body, headers)."""
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, raw, headers = r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        status, raw, headers = e.code, e.read(), e.headers
    return status, json.loads(raw) if raw.startswith(b"{") else raw.decode(), headers


def generate(base: str, **kw):
    return post(base, "/generate", {"text": "hello there", "sampling_params": {"max_new_tokens": 4}}, **kw)


def test_retries_go_around_a_failing_worker_and_its_breaker_opens(mesh):
    bad = mesh.worker("--fail-first", "1000", wait=False)
    good = mesh.worker(wait=False)
    base = mesh.router("--policy", "round_robin", "--retry-initial-backoff-ms", "5", "--cb-failure-threshold", "3",
                       "--cb-timeout-duration-secs", "600", "--health-check-interval-s", "0.2",
                       "--health-success-threshold", "1")
    for _ in range(12):
        status, body, _ = generate(base)
        assert status == 200 and body["meta_info"]["completion_tokens"] == 4  # every client got its answer
        time.sleep(0.25)  # the refused worker passes its next probe: only its breaker keeps it out now
    assert mesh.calls(bad) == 3  # three failures opened the breaker; it got nothing after
    assert mesh.calls(good) == 12
    metrics = scrape(mesh.metrics_port)
    assert metrics.value("sgl_router_worker_cb_state", worker=bad) == 1  # open
    assert metrics.value("sgl_router_retries_total", worker=bad) == 3


def test_a_traced_retry_shows_the_failed_call_and_no_client_span_for_the_call_that_worked(mesh, monkeypatch):
    """The router records a `worker Generate` client span only for a call that failed (its worker, attempt and
    error); a call that worked is timed by the worker's own server span (tests/e2e/test_tracing.py), as the
    tokenizer's call is by the tokenizer's. (The fake workers and this tokenizer do not trace.)"""
    receiver = OtlpReceiver()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    try:
        bad = mesh.worker("--fail-first", "1000", wait=False)
        good = mesh.worker(wait=False)
        base = mesh.router("--policy", "round_robin", "--retry-initial-backoff-ms", "5", "--enable-trace",
                           "--otlp-traces-endpoint", receiver.endpoint, "--trace-sample-ratio", "1.0")
        for _ in range(2):  # round robin: one of the two goes to the failing worker first
            status, body, _ = generate(base)
            assert status == 200 and body["meta_info"]["completion_tokens"] == 4
        deadline = time.monotonic() + 30
        while len({s.trace_id for s in receiver.spans if s.name == "POST /generate"}) < 2:
            assert time.monotonic() < deadline, "the router's spans did not arrive"
            time.sleep(0.1)
        traces = {}
        for s in receiver.spans:
            traces.setdefault(s.trace_id, []).append(s)
    finally:
        receiver.close()
    assert len(traces) == 2 and mesh.calls(bad) == 1 and mesh.calls(good) == 2
    retried = [t for t in traces.values() if any(s.name == "worker Generate" for s in t)]
    assert len(retried) == 1
    for spans in traces.values():
        root = next(s for s in spans if s.name == "POST /generate")
        assert all(s.parent_id == root.span_id for s in spans if s is not root)
    failed = [s for s in retried[0] if s.name == "worker Generate"]
    assert [(s.attributes["radixmesh.worker"], s.attributes["radixmesh.attempt"], s.status, s.kind)
            for s in failed] == [(bad, 0, 2, 3)]
    assert [s.attributes["radixmesh.worker"] for s in retried[0] if s.name == "route"] == [bad, good]


def test_a_worker_that_dies_after_the_last_chunk_costs_the_client_nothing(mesh):
    dying = mesh.worker("--die-after-last-chunk", wait=False)
    spare = mesh.worker(wait=False)
    base = mesh.router("--policy", "round_robin", "--health-check-interval-s", "60")
    req = urllib.request.Request(base + "/generate", method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}, data=json.dumps({
            "text": "hello there", "stream": True, "sampling_params": {"max_new_tokens": 4}}).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        status, raw = r.status, r.read()
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n") and not any("error" in e for e in events)
    last = events[-1]
    assert last["output_ids"] == [0, 1, 2, 3] and last["text"] == " tok" * 4
    assert last["meta_info"]["finish_reason"]["type"] == "length" and last["meta_info"]["completion_tokens"] == 4
    assert mesh.calls(spare) == 0  # every token had come: nothing was run again elsewhere
    assert "after request" in mesh.log.read_text() and dying


def test_without_retries_the_failure_reaches_the_client(mesh):
    mesh.worker("--fail-first", "1000")
    base = mesh.router("--disable-retries")
    status, body, _ = generate(base)
    assert status == 503 and "fake failure" in body["error"]["message"]


def test_a_hung_worker_is_bounded_by_the_request_timeout(mesh):
    mesh.worker("--delay-s", "600")
    base = mesh.router("--request-timeout-secs", "1.5")
    started = time.monotonic()
    status, body, _ = generate(base)
    assert status == 504 and time.monotonic() - started < 10


def test_a_full_queue_answers_429_and_a_long_wait_408(mesh):
    mesh.worker("--delay-s", "2")
    base = mesh.router("--max-concurrent-requests", "1", "--queue-size", "1", "--queue-timeout-secs", "0.7")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = pool.submit(generate, base)
        time.sleep(0.3)
        queued = pool.submit(generate, base)
        time.sleep(0.2)
        full = generate(base)
        results = [first.result(), queued.result(), full]
    assert [r[0] for r in results] == [200, 408, 429]
    assert "--queue-size" in results[2][1]["error"]["message"] and int(results[2][2]["Retry-After"]) >= 1
    assert "--queue-timeout-secs" in results[1][1]["error"]["message"]
    metrics = scrape(mesh.metrics_port)
    assert metrics.value("sgl_router_rejected_requests_total", reason="queue_full") == 1
    assert metrics.value("sgl_router_rejected_requests_total", reason="queue_timeout") == 1
    assert http_get(base + "/health")[0] == 200  # probes are never queued


def test_the_rate_limit_is_per_key_and_refills(mesh):
    mesh.worker()
    base = mesh.router("--api-key-tenants", "sk-other=acme", "--rate-limit-tokens-per-second", "2",
                       "--rate-limit-burst", "2")
    assert [generate(base)[0] for _ in range(2)] == [200, 200]
    status, body, headers = generate(base)
    assert status == 429 and "rate limit" in body["error"]["message"] and headers["Retry-After"] == "1"
    assert generate(base, key="sk-other")[0] == 200  # another key, another bucket
    time.sleep(0.6)
    assert generate(base)[0] == 200


def test_sticky_sessions_stay_on_one_worker(mesh):
    workers = [mesh.worker(wait=False) for _ in range(3)]
    base = mesh.router("--policy", "manual")
    chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for session in ("alpha", "beta", "gamma", "delta"):
        before = [mesh.calls(w) for w in workers]
        for _ in range(3):
            assert generate(base, headers={"X-SMG-Routing-Key": session})[0] == 200
            assert post(base, "/v1/chat/completions", {**chat, "user": session})[0] == 200
        moved = [mesh.calls(w) - b for w, b in zip(workers, before)]
        assert sorted(moved) == [0, 0, 6], (session, moved)  # header and `user`: the same key, one worker


def test_pd_policies_choose_as_configured(mesh):
    prefills = [mesh.worker("--disaggregation-mode", "prefill", wait=False) for _ in range(2)]
    decodes = [mesh.worker("--disaggregation-mode", "decode", wait=False) for _ in range(2)]
    base = mesh.router("--policy", "cache_aware", "--prefill-policy", "round_robin", "--decode-policy", "manual")
    for i in range(6):
        status, body, _ = generate(base, headers={"X-SMG-Routing-Key": "one-session"})
        assert status == 200 and body["meta_info"]["completion_tokens"] == 4
    log = mesh.log.read_text()[-3000:]
    metrics = scrape(mesh.metrics_port)
    # Round robin over the prefill workers, read from the router's decisions: a fake prefill worker may never see
    # a call, as the router cancels it once the fake decode side (which needs no KV) has answered.
    assert [metrics.value("sgl_router_policy_decisions_total", policy="round_robin", worker=w)
            for w in prefills] == [3, 3], log
    assert sorted(mesh.calls(w) for w in decodes) == [0, 6], log  # sticky
    assert metrics.value("sgl_router_policy_decisions_total", policy="round_robin") == 6
    assert metrics.value("sgl_router_policy_decisions_total", policy="manual") == 6


def test_admin_endpoints_need_the_admin_key_and_a_host_port(mesh):
    mesh.worker(wait=False)
    extra = mesh.worker(wait=False)
    mesh.workers.remove(extra)
    base = mesh.router("--admin-api-key", "sk-admin")
    assert post(base, f"/add_worker?url={extra}", {})[0] == 403  # the API key is not the admin key
    assert post(base, f"/add_worker?url={extra}", {}, key="sk-wrong")[0] == 401
    for bad in ("a%20b:1", "host:0", "host:port", "http://h:1/x"):
        status, body, _ = post(base, f"/add_worker?url={bad}", {}, key="sk-admin")
        assert status == 400 and "host:port" in body["error"]["message"], bad
    assert post(base, f"/add_worker?url={extra}", {}, key="sk-admin")[0] == 200
    status, body, _ = post(base, "/remove_worker?url=bad%20host:1", {}, key="sk-admin")
    assert status == 400
    assert post(base, f"/remove_worker?url={extra}", {}, key="sk-admin")[0] == 200
    assert generate(base)[0] == 200  # the API key still serves requests


def test_the_l0_tokenizer_cache_answers_repeats_and_forgets_the_oldest(mesh):
    mesh.worker()
    base = mesh.router("--tokenizer-cache-enable-l0", "--tokenizer-cache-l0-max-entries", "2")

    def chat(text):
        body = {"model": "fake", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
        status, out, _ = post(base, "/v1/chat/completions", body)
        assert status == 200
        return out["usage"]["prompt_tokens"]

    first = chat("the same question")
    assert [chat("the same question") for _ in range(2)] == [first, first]
    metrics = scrape(mesh.metrics_port)
    assert (metrics.value("sgl_router_tokenizer_cache_hits_total"),
            metrics.value("sgl_router_tokenizer_cache_misses_total")) == (2, 1)
    chat("a second question")
    chat("a third, longer question than the others")  # the cache holds two: the first is forgotten
    assert chat("the same question") == first
    metrics = scrape(mesh.metrics_port)
    assert metrics.value("sgl_router_tokenizer_cache_misses_total") == 4
    assert metrics.value("sgl_router_tokenizer_cache_entries") == 2


def test_before_any_worker_answered_requests_get_503_not_a_placeholder_model(mesh):
    """A router that has not heard of a worker yet (compose starts several router processes before the worker is
    up) lists no model and answers a named one with 503 "no model is being served yet", not a 404 that names a
    placeholder; once a worker is added it serves the worker's name."""
    worker = mesh.worker()
    mesh.workers.remove(worker)
    base = mesh.router()
    models = json.loads(http_get(base + "/v1/models", {"Authorization": f"Bearer {KEY}"})[1])
    assert models["data"] == []
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, out, _ = post(base, "/v1/chat/completions", body)
    assert status == 503 and "no model is being served yet" in out["error"]["message"], out
    assert post(base, f"/add_worker?url={worker}", {})[0] == 200
    models = json.loads(http_get(base + "/v1/models", {"Authorization": f"Bearer {KEY}"})[1])
    assert [m["id"] for m in models["data"]] == ["fake"]
    status, out, _ = post(base, "/v1/chat/completions", body)
    assert status == 200 and out["model"] == "fake", out
    status, out, _ = post(base, "/v1/chat/completions", {**body, "model": "other"})
    assert status == 404 and "serves: fake" in out["error"]["message"], out
