"""Tenants end to end through a real router process (and the real tokenizer service): the API key's tenant
(--api-key-tenants) and the trusted header's (--tenant-header) reach the worker's GenerateRequest.tenant over
OpenAI chat/completions, /generate (single, batch, streamed), the public gRPC API and prefill/decode pairs; the key
wins over the header; an invalid tenant is a 400 / INVALID_ARGUMENT that says what a tenant name is; an unknown
key is a 401 / UNAUTHENTICATED. The workers are recording test doubles (sync gRPC servers in this process) that
keep every GenerateRequest they get."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from radixmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from radixmesh.services.launch import free_port
from radixmesh.services.router.tenants import TenantResolver, validate_tenant
from tests.conftest import ROOT, model_path

MODEL_NAME = "fake"
SHARED_KEY, ALPHA_KEY, BETA_KEY = "sk-shared", "sk-alpha", "sk-beta"
TENANT_FLAGS = ("--api-key", SHARED_KEY, "--api-key-tenants", f"{ALPHA_KEY}=alpha", f"{BETA_KEY}=team.b_2",
                "--tenant-header", "X-Tenant")


# ---- test doubles and processes (test_router_kv_index.py uses them too) ------------------------------------------
class RecordingWorker(worker_pb2_grpc.WorkerServiceServicer):
    """A WorkerService that keeps every GenerateRequest and answers it at once with two tokens. A decode worker
    given its `prefill` side answers only once that side got the request's bootstrap room (up to 10 s), as a real
    one waits for the KV: else the router may finish the request and cancel the prefill call before it arrives."""

    def __init__(self, mode: str = "null", loads: worker_pb2.GetLoadsResponse | None = None,
                 prefill: "RecordingWorker | None" = None):
        self.mode = mode
        self.loads = loads or worker_pb2.GetLoadsResponse()
        self.requests: list[worker_pb2.GenerateRequest] = []
        self.load_polls = 0
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self.prefill = prefill

    def take(self) -> list[worker_pb2.GenerateRequest]:
        """The requests received since the last take()."""
        with self._lock:
            out, self.requests = self.requests, []
        return out

    def Generate(self, request, context):
        with self._lock:
            self.requests.append(request)
            self._arrived.notify_all()
        if self.prefill is not None:
            room = request.disaggregated_params.bootstrap_room
            with self.prefill._arrived:
                self.prefill._arrived.wait_for(lambda: any(
                    r.disaggregated_params.bootstrap_room == room for r in self.prefill.requests), timeout=10)
        usage = common_pb2.Usage(prompt_tokens=len(request.input_ids), completion_tokens=2)
        yield worker_pb2.GenerateResponse(request_id=request.request_id, complete=worker_pb2.GenerateComplete(
            output_ids=[7, 8], text=" ok", usage=usage,
            finish_reason=common_pb2.FinishReason(type=common_pb2.FINISH_REASON_TYPE_LENGTH, length=2)))

    def GetLoads(self, request, context):
        with self._lock:
            self.load_polls += 1
        return self.loads

    def HealthCheck(self, request, context):
        return worker_pb2.HealthCheckResponse(healthy=True, message="recording")

    def GetModelInfo(self, request, context):
        return worker_pb2.GetModelInfoResponse(
            model_path=MODEL_NAME, tokenizer_path=MODEL_NAME, is_generation=True, served_model_name=MODEL_NAME,
            max_context_length=4096, vocab_size=32000, model_type="fake", preferred_sampling_params="{}",
            max_total_num_tokens=1 << 20, disaggregation_mode=self.mode, bootstrap_port=8998)

    def GetServerInfo(self, request, context):
        return worker_pb2.GetServerInfoResponse(server_info_json="{}")


@contextlib.contextmanager
def grpc_server(add):
    """A sync gRPC server on a free loopback port with `add(server)` registered and health SERVING; yields its url."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    add(server)
    checker = health.HealthServicer()
    checker.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


@contextlib.contextmanager
def serve_worker(worker: RecordingWorker):
    with grpc_server(lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker, s)) as url:
        yield url


def _serving(url: str) -> bool:
    with grpc.insecure_channel(url) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


@contextlib.contextmanager
def run_process(name: str, argv: list[str], log_dir: Path, ready, timeout_s: float = 90.0):
    """`python -m argv...` until `ready()` holds; stopped (SIGTERM, then SIGKILL) on exit."""
    log_path = log_dir / f"{name}-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start (exit {proc.poll()}):\n{log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def run_tokenizer(log_dir: Path):
    port = free_port()
    url = f"127.0.0.1:{port}"
    argv = ["radixmesh.services.tokenizer", "--model-path", model_path("tiny-llama"), "--port", str(port),
            "--log-level", "warning"]
    with run_process("tokenizer", argv, log_dir, lambda: _serving(url)):
        yield url


@dataclass
class RouterProc:
    port: int
    grpc_port: int
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def run_router(tokenizer_url: str, worker_urls: list[str], log_dir: Path, *flags: str):
    port, grpc_port = free_port(), free_port()
    argv = ["radixmesh.services.router", "--tokenizer-url", tokenizer_url, "--worker-urls", *worker_urls,
            "--port", str(port), "--grpc-port", str(grpc_port), "--log-level", "warning", *flags]

    def ready() -> bool:  # /readiness: a worker is registered (/health answers before the first probe has)
        return http("GET", f"http://127.0.0.1:{port}/readiness")[0] == 200 and _serving(f"127.0.0.1:{grpc_port}")

    with run_process("router", argv, log_dir, ready) as proc:
        yield RouterProc(port, grpc_port, proc)


def http(method: str, url: str, body=None, headers: dict | None = None) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


# ---- fixtures --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tenants")


@pytest.fixture(scope="module")
def tokenizer(log_dir):
    with run_tokenizer(log_dir) as url:
        yield url


@pytest.fixture(scope="module")
def worker():
    w = RecordingWorker()
    with serve_worker(w) as url:
        yield w, url


@pytest.fixture(scope="module")
def router(tokenizer, worker, log_dir):
    with run_router(tokenizer, [worker[1]], log_dir, *TENANT_FLAGS) as r:
        yield r


def one_tenant(worker: RecordingWorker) -> str:
    requests = worker.take()
    assert len(requests) == 1, requests
    return requests[0].tenant


def chat(content: str = "hi") -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 2}


# ---- HTTP ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("headers, tenant", [
    (bearer(ALPHA_KEY), "alpha"),
    (bearer(BETA_KEY), "team.b_2"),
    (bearer(SHARED_KEY), ""),
    ({**bearer(SHARED_KEY), "X-Tenant": "acme"}, "acme"),
    ({**bearer(SHARED_KEY), "x-tenant": "acme-2"}, "acme-2"),  # header names are case-insensitive
    ({**bearer(ALPHA_KEY), "X-Tenant": "acme"}, "alpha"),  # the key's tenant wins
])
def test_openai_requests_carry_the_tenant(router, worker, headers, tenant):
    w, _ = worker
    w.take()
    status, body = http("POST", router.url + "/v1/chat/completions", chat(), headers)
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["content"] == " ok"
    assert one_tenant(w) == tenant
    status, body = http("POST", router.url + "/v1/completions",
                        {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, "stream": True}, headers)
    assert status == 200 and body.rstrip().endswith(b"data: [DONE]"), body
    assert one_tenant(w) == tenant


def test_generate_requests_carry_the_tenant(router, worker):
    w, _ = worker
    w.take()
    status, body = http("POST", router.url + "/generate", {"text": "hello"}, bearer(ALPHA_KEY))
    assert status == 200 and json.loads(body)["output_ids"] == [7, 8], body
    assert one_tenant(w) == "alpha"
    status, body = http("POST", router.url + "/generate", {"input_ids": [[1, 2], [3, 4]]},
                        {**bearer(SHARED_KEY), "X-Tenant": "acme"})
    assert status == 200 and len(json.loads(body)) == 2, body
    assert [r.tenant for r in w.take()] == ["acme", "acme"]
    status, body = http("POST", router.url + "/generate", {"input_ids": [5, 6], "stream": True}, bearer(BETA_KEY))
    assert status == 200 and b"[DONE]" in body, body
    assert one_tenant(w) == "team.b_2"


@pytest.mark.parametrize("value", ["", "a b", "x" * 65, "semi;colon", "ünï"])
def test_an_invalid_tenant_is_a_clear_400(router, worker, value):
    w, _ = worker
    w.take()
    for path, body in (("/v1/chat/completions", chat()), ("/generate", {"text": "hi"})):
        status, raw = http("POST", router.url + path, body, {**bearer(SHARED_KEY), "X-Tenant": value})
        assert status == 400, raw
        err = json.loads(raw)["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == "tenant"
        assert "invalid tenant" in err["message"] and "X-Tenant" in err["message"]
        assert "1-64 characters" in err["message"]
    assert w.take() == []  # refused before any worker saw it


@pytest.mark.parametrize("headers", [{}, bearer("sk-unknown"), {"Authorization": ALPHA_KEY}, {"X-Tenant": "alpha"}])
def test_an_unknown_key_is_a_401(router, worker, headers):
    w, _ = worker
    w.take()
    status, raw = http("POST", router.url + "/v1/chat/completions", chat(), headers)
    assert status == 401, raw
    err = json.loads(raw)["error"]
    assert err["type"] == "authentication_error" and "API key" in err["message"]
    assert http("POST", router.url + "/generate", {"text": "hi"}, headers)[0] == 401
    assert http("GET", router.url + "/health")[0] == 200
    assert w.take() == []


def test_server_info_hides_the_keys(router):
    status, raw = http("GET", router.url + "/get_server_info", headers=bearer(SHARED_KEY))
    assert status == 200, raw
    settings = json.loads(raw)["router"]
    assert "api_key" not in settings and "api_key_tenants" not in settings
    assert settings["tenant_header"] == "X-Tenant"
    assert ALPHA_KEY.encode() not in raw and SHARED_KEY.encode() not in raw


# ---- gRPC ------------------------------------------------------------------------------------------------------
def grpc_generate(router: RouterProc, metadata: list[tuple[str, str]]) -> list:
    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        request = router_pb2.RouterServiceGenerateRequest(text="hello")
        return list(stub.Generate(request, metadata=metadata, timeout=30))


@pytest.mark.parametrize("metadata, tenant", [
    ([("authorization", f"Bearer {BETA_KEY}")], "team.b_2"),
    ([("authorization", f"Bearer {SHARED_KEY}"), ("x-tenant", "acme")], "acme"),
    ([("authorization", f"Bearer {SHARED_KEY}")], ""),
    ([("authorization", f"Bearer {ALPHA_KEY}"), ("x-tenant", "acme")], "alpha"),
])
def test_grpc_requests_carry_the_tenant(router, worker, metadata, tenant):
    w, _ = worker
    w.take()
    out = grpc_generate(router, metadata)
    assert out[-1].complete.text == " ok"
    assert one_tenant(w) == tenant


def test_grpc_refuses_unknown_keys_and_invalid_tenants(router, worker):
    w, _ = worker
    w.take()
    for metadata in ([], [("authorization", "Bearer sk-unknown")]):
        with pytest.raises(grpc.RpcError) as info:
            grpc_generate(router, metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        grpc_generate(router, [("authorization", f"Bearer {SHARED_KEY}"), ("x-tenant", "no spaces allowed")])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "invalid tenant 'no spaces allowed'" in info.value.details() and "1-64" in info.value.details()
    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.ListModels(router_pb2.ListModelsRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        models = stub.ListModels(router_pb2.ListModelsRequest(), timeout=10,
                                 metadata=[("authorization", f"Bearer {ALPHA_KEY}")])
        assert list(models.models) == [MODEL_NAME]
    assert w.take() == []


# ---- without tenant flags: one shared namespace, the header is not trusted -------------------------------------
def test_default_is_the_shared_namespace(tokenizer, worker, log_dir):
    w, url = worker
    with run_router(tokenizer, [url], log_dir) as r:
        w.take()
        status, body = http("POST", r.url + "/v1/chat/completions", chat(), {"X-Tenant": "acme"})
        assert status == 200, body
        assert one_tenant(w) == ""
        assert grpc_generate(r, [("x-tenant", "acme")])[-1].complete.text == " ok"
        assert one_tenant(w) == ""


# ---- prefill/decode pairs: both workers get the tenant ---------------------------------------------------------
def test_pd_pairs_carry_the_tenant(tokenizer, log_dir):
    prefill = RecordingWorker("prefill")
    decode = RecordingWorker("decode", prefill=prefill)
    with serve_worker(prefill) as purl, serve_worker(decode) as durl, \
            run_router(tokenizer, [purl, durl], log_dir, *TENANT_FLAGS) as r:
        status, body = http("POST", r.url + "/generate", {"text": "hello"}, bearer(ALPHA_KEY))
        assert status == 200 and json.loads(body)["output_ids"] == [7, 8], body
        (p,), (d,) = prefill.take(), decode.take()
        assert p.tenant == d.tenant == "alpha"
        assert p.disaggregated_params.bootstrap_room == d.disaggregated_params.bootstrap_room != 0
        status, body = http("POST", r.url + "/v1/chat/completions", chat(), {**bearer(SHARED_KEY), "X-Tenant": "t1"})
        assert status == 200, body
        assert prefill.take()[0].tenant == decode.take()[0].tenant == "t1"


# ---- the resolver on its own -----------------------------------------------------------------------------------
def test_resolver_rules():
    class S:
        api_key, api_key_tenants, tenant_header = None, ("k1=a", "k=with=eq=b"), None

    r = TenantResolver.from_settings(S)
    assert r.resolve("Bearer k1", None) == "a" and r.resolve("Bearer k=with=eq", None) == "b"
    S.api_key_tenants, S.tenant_header = (), "X-Tenant"
    r = TenantResolver.from_settings(S)
    assert r.resolve(None, None) == "" and r.resolve(None, "t") == "t" and r.metadata_key == "x-tenant"
    assert validate_tenant("A.b_c-9" * 9 + "1", "x") == "A.b_c-9" * 9 + "1"  # 64 characters
    for bad in ("", "x" * 65, "a/b"):
        with pytest.raises(ValueError, match="invalid tenant"):
            validate_tenant(bad, "x")
