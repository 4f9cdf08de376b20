"""A standing property-based fuzz of every public endpoint of a real launched mesh: router, tokenizer and two
colocated tiny-llama workers as OS processes on loopback, with an API key and metrics on; then an --is-embedding
mesh (tiny-qwen3-embed) for the embedding endpoints past their parsers.

Hypothesis (derandomized: the same requests on every run) sends valid and malformed requests (tests/fuzz/valid.py,
tests/fuzz/malformed.py) to the first mesh, one at a time and then several at once with clients that hang up
mid-request: RADIXMESH_FUZZ_SCALE times the full budget of PHASES, more than 5000 requests at 1. `make test` runs the
default, 0.25 (over 1250 requests, every phase of them at least 30 examples); RADIXMESH_FUZZ_SCALE=1 (or 10) is the full
run. tests/fuzz/checks.py checks every answer: no 5xx, no hang, a status the OpenAPI document lists, an OpenAI error
object for every 4xx, a body the document accepts for every request served, a 200 that respects the request for every
valid one. Afterwards every worker is idle with its whole KV pool free again, no service logged a traceback, and the
mesh's greedy output for a fixed prompt (its embedding, for the embedding mesh) is what it was before. Counts and
status histograms are printed.
The tests at the end are regressions of what the fuzzing found."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import time
import urllib.request

import grpc
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from radixmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.conftest import model_path
from tests.e2e.mesh import alive, running_mesh
from tests.fuzz import malformed, valid
from tests.fuzz.checks import Fuzzer
from tests.fuzz.request import Req, Target

MODEL = model_path("tiny-llama")
EMBED = model_path("tiny-qwen3-embed")
KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
PROMPT = "The capital of France is"
# (name, strategy factory, examples at scale 1): more than 5000 requests in all on the generation mesh
PHASES = [("chat", valid.chat, 450), ("completions", valid.completion, 450), ("generate", valid.generate, 450),
          ("tokenizer", valid.tokenizer, 300), ("embeddings", valid.embeddings, 150), ("reads", valid.reads, 250),
          ("admin", valid.admin, 120), ("mutated", malformed.mutated, 1500), ("garbage", malformed.garbage, 450),
          ("unauthorized", malformed.unauthorized, 250), ("wrong routes", malformed.wrong_routes, 250),
          ("concurrent", malformed.concurrent, 150)]  # the last: 2 to 6 requests an example
MIN_REQUESTS = 5000


def _refused(factory):
    """Valid generation requests sent to an embedding model: each a 400."""
    return lambda target: factory(target).map(lambda r: dataclasses.replace(r, ok=False, expect=400))


EMBED_PHASES = [("embeddings", valid.embeddings, 300), ("mutated", malformed.mutated, 300),
                ("garbage", malformed.garbage, 100), ("tokenizer", valid.tokenizer, 50),
                ("generation refused", _refused(valid.completion), 50), ("concurrent", malformed.concurrent, 60)]
# Multiplies every phase's examples. 0.25 keeps `make test` inside its CI budget (the full 5000 took a minute of a
# 2-core CI run, 0.4 half a minute); 1 is the full budget, 10 a long run.
SCALE = float(os.environ.get("RADIXMESH_FUZZ_SCALE", "0.25"))


def call(mesh, method: str, path: str, body=None, timeout: float = 60.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(mesh.url + path, data=data, method=method, headers=AUTH)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def greedy(mesh) -> tuple[str, list[int]]:
    """The mesh's greedy continuation of PROMPT, through /v1/completions and /generate (they must agree)."""
    status, raw = call(mesh, "POST", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 12,
                                                         "temperature": 0})
    assert status == 200, raw
    text = json.loads(raw)["choices"][0]["text"]
    status, raw = call(mesh, "POST", "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 12,
                                                                                       "temperature": 0}})
    assert status == 200, raw
    out = json.loads(raw)
    assert out["text"] == text, (out, text)
    return text, out["output_ids"]


def workers(mesh) -> list[dict]:
    status, raw = call(mesh, "GET", "/get_server_info")
    assert status == 200, raw
    infos = json.loads(raw)["workers"]
    assert all("error" not in w for w in infos), infos
    return infos


def assert_idle_and_empty(mesh, count: int = 2, timeout: float = 20.0) -> None:
    """Every worker has no request running or waiting, and after /flush_cache its whole KV pool is free."""
    deadline = time.monotonic() + timeout
    while True:
        busy = [w["internal_states"][0] for w in workers(mesh)
                if w["internal_states"][0]["running"] or w["internal_states"][0]["waiting"]]
        flushed = not busy and call(mesh, "POST", "/flush_cache")[0] == 200
        if flushed or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert flushed, f"requests still held by the workers: {busy}"
    infos = workers(mesh)
    assert len(infos) == count
    for w in infos:
        assert w["available_kv_tokens"] == w["max_total_num_tokens"], (w["url"], w["available_kv_tokens"],
                                                                        w["max_total_num_tokens"])


def assert_clean_log(mesh) -> None:
    """No service logged an unhandled error or a traceback."""
    log = mesh.log_path.read_text(errors="replace")
    assert "unhandled error" not in log and "Traceback" not in log, mesh.log_tail(120)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with running_mesh(MODEL, tmp_path_factory.mktemp("fuzz"), "--enable-metrics", num_workers=2,
                      api_key=KEY) as m:
        yield m


@pytest.fixture(scope="module")
def target(mesh) -> Target:
    return Target(MODEL, KEY, tuple(w["url"] for w in workers(mesh)))


def _phase(fuzzer: Fuzzer, strategy: st.SearchStrategy[Req | list[Req]], examples: int) -> None:
    @settings(max_examples=examples, derandomize=True, database=None, deadline=None, print_blob=False,
              suppress_health_check=list(HealthCheck), phases=(Phase.explicit, Phase.generate, Phase.shrink))
    @given(strategy)
    def send(req: Req | list[Req]) -> None:
        fuzzer.run_all(req) if isinstance(req, list) else fuzzer.run(req)
    send()


def fuzz(mesh, target: Target, phases, capsys) -> Fuzzer:
    """Runs every phase against `mesh`, prints what was sent and what came back."""
    fuzzer = Fuzzer(mesh.port)
    started = time.monotonic()
    done = []
    try:
        for name, factory, examples in phases:
            sent, begun = fuzzer.sent, time.monotonic()
            examples = max(1, round(examples * SCALE))
            _phase(fuzzer, factory(target), examples)
            done.append(f"{name} {fuzzer.sent - sent} in {time.monotonic() - begun:.0f} s")
            assert fuzzer.sent - sent >= examples * 0.9, f"phase {name} sent only {fuzzer.sent - sent} requests"
    finally:
        fuzzer.close()
        took = time.monotonic() - started
        with capsys.disabled():
            print(f"\nfuzz {target.model}: {fuzzer.sent} requests in {took:.0f} s ({', '.join(done)}); statuses "
                  f"{dict(sorted(fuzzer.statuses.items()))}, {fuzzer.hung_up} hung up by the client; slowest answer "
                  f"{fuzzer.slowest[0]:.2f} s: {fuzzer.slowest[1][:300]}")
    return fuzzer


def test_fuzz_every_endpoint(mesh, target, capsys):
    before = greedy(mesh)
    assert_idle_and_empty(mesh)
    fuzzer = fuzz(mesh, target, PHASES, capsys)
    assert fuzzer.sent >= MIN_REQUESTS * min(SCALE, 1)
    assert all(alive(pid) for pid in mesh.known_pids), "a service process died"
    assert_idle_and_empty(mesh)
    assert greedy(mesh) == before
    assert_clean_log(mesh)


@pytest.fixture(scope="module")
def embed_mesh(tmp_path_factory):
    with running_mesh(EMBED, tmp_path_factory.mktemp("fuzz-embed"), "--is-embedding", api_key=KEY) as m:
        yield m


def embedding(mesh) -> list[float]:
    status, raw = call(mesh, "POST", "/v1/embeddings", {"input": PROMPT})
    assert status == 200, raw
    return json.loads(raw)["data"][0]["embedding"]


def test_fuzz_embedding_endpoints(embed_mesh, capsys):
    """The embedding endpoints past their parsers: an --is-embedding mesh, fuzzed the same way."""
    target = Target(EMBED, KEY, tuple(w["url"] for w in workers(embed_mesh)), embedding=True)
    before = embedding(embed_mesh)
    fuzz(embed_mesh, target, EMBED_PHASES, capsys)
    assert all(alive(pid) for pid in embed_mesh.known_pids), "a service process died"
    assert_idle_and_empty(embed_mesh, count=1)
    assert embedding(embed_mesh) == before
    assert_clean_log(embed_mesh)


# ---- regressions the fuzzing found -------------------------------------------------------------------------------
def test_deeply_nested_bodies_are_a_400(mesh):
    for raw in (b"[" * 100_000, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"):
        req = urllib.request.Request(mesh.url + "/v1/completions", data=raw, method="POST", headers=AUTH)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 400
        assert "nested too deeply" in json.loads(err.value.read())["error"]["message"]


def test_a_huge_n_is_refused_before_any_worker_sees_it(mesh):
    """/generate's sampling_params.n (and the gRPC API's) is bounded as the OpenAI endpoints' n is: a worker asked
    for 100000 samples was busy for minutes, answering nothing else."""
    started = time.monotonic()
    status, raw = call(mesh, "POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1,
                                                                                     "n": 100_000}})
    assert status == 400 and "sampling_params.n must be in [1, 128]" in json.loads(raw)["error"]["message"], raw
    with grpc.insecure_channel(f"127.0.0.1:{mesh.grpc_port}") as ch:
        request = router_pb2.RouterServiceGenerateRequest(
            text="hi", sampling_params=common_pb2.SamplingParams(max_new_tokens=1, n=100_000))
        with pytest.raises(grpc.RpcError) as err:
            list(router_pb2_grpc.RouterServiceStub(ch).Generate(request, timeout=30,
                                                                metadata=[("authorization", f"Bearer {KEY}")]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be" in err.value.details()
    assert time.monotonic() - started < 20  # it was minutes: the worker busy with 100000 samples
    status, raw = call(mesh, "POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, "n": 128}})
    assert status == 200 and len(json.loads(raw)) == 128, raw


def test_a_refused_flush_is_an_error_object(mesh):
    """/flush_cache refused (a request is running) answers a 400 with an OpenAI error object, as every 4xx does."""
    conn = http.client.HTTPConnection("127.0.0.1", mesh.port, timeout=30)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=AUTH)
    try:
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")  # it runs on a worker now
        status, raw = call(mesh, "POST", "/flush_cache")
        assert status == 400, raw
        assert json.loads(raw)["error"]["message"].startswith("Cache not flushed"), raw
    finally:
        conn.close()
    assert_idle_and_empty(mesh)



def test_a_seed_past_64_bits_for_a_sample_is_a_400(mesh):
    """Sample j draws with seed + j: past 2**63 - 1 the worker's sampling step raised and aborted every request of
    that step (the client got a 200 whose choices all ended 'abort'). The last seed that fits is served."""
    top = 2**63 - 1
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "n": 2}
    status, raw = call(mesh, "POST", "/v1/completions", {**body, "seed": top})
    assert status == 400 and "seed" in json.loads(raw)["error"]["message"], raw
    status, raw = call(mesh, "POST", "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 2, "n": 2,
                                                                                       "sampling_seed": top}})
    assert status == 400 and "seed" in json.loads(raw)["error"]["message"], raw
    status, raw = call(mesh, "POST", "/v1/completions", {**body, "seed": top - 1})
    assert status == 200 and [c["finish_reason"] for c in json.loads(raw)["choices"]] == ["length"] * 2, raw
    assert "forward failed" not in mesh.log_path.read_text(errors="replace")
