"""Workers find the router on their own, as real processes: a router started with no workers is not ready (503 on
/readiness, 200 on /liveness); a worker started with --router-url registers itself (through the API key from
RADIXMESH_ROUTER_API_KEY), the router becomes ready and serves through it; on SIGTERM the worker leaves (long
before its lease would lapse) and exits 0; a worker that is SIGKILLed is forgotten when its lease lapses; and a
worker that never registers is found through --discovery-dns (the system resolver answering for localhost)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from radixmesh.services.launch import free_port
from tests.conftest import ROOT, model_path
from tests.services.metrics_utils import http_get, start_grpc, stop, wait_http

MODEL = model_path("tiny-llama")
KEY = {"Authorization": "Bearer sk-reg"}


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **KEY})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def wait_for(check, timeout: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {what}")


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("registration")
    port, discovered_port = free_port(), free_port()
    tok, tok_url = start_grpc("radixmesh.services.tokenizer", "--model-path", MODEL, log=tmp / "tokenizer.log")
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixmesh.services.router", "--port", str(port), "--tokenizer-url", tok_url,
         "--api-key", "sk-reg", "--discovery-dns", f"localhost:{discovered_port}", "--discovery-interval-s", "0.5",
         "--connect-timeout-s", "1", "--health-check-interval-s", "0.5", "--log-level", "info"],
        cwd=ROOT, stdout=open(tmp / "router.log", "w"), stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        yield f"http://127.0.0.1:{port}", discovered_port, tmp
    finally:
        stop(proc)
        stop(tok)


def workers(base: str) -> list[str]:
    return [w["url"] for w in json.loads(http_get(base + "/get_server_info", KEY)[1])["workers"]]


def start_worker(tmp, name: str, *args: str, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """A tiny-model worker logging at info (its registration lines are asserted on); the router's API key comes
    from the environment, as a Kubernetes Secret would give it."""
    return start_grpc("radixmesh.services.worker", "--model-path", MODEL, *args, "--log-level", "info",
                      log=tmp / f"{name}.log", port=port, env={"RADIXMESH_ROUTER_API_KEY": "sk-reg"})


def complete(base: str) -> dict:
    status, body = post(base + "/v1/completions", {"model": MODEL, "prompt": "The quick brown", "max_tokens": 4,
                                                  "temperature": 0})
    assert status == 200, body
    return body


def test_a_worker_registers_itself_serves_and_leaves_on_sigterm(router):
    base, _, tmp = router
    assert http_get(base + "/liveness")[0] == 200
    status, body = http_get(base + "/readiness")
    assert status == 503 and json.loads(body)["ready"] is False
    proc, url = start_worker(tmp, "self-registered", "--router-url", base)
    try:
        wait_for(lambda: http_get(base + "/readiness")[0] == 200, 30, "the router ready through the worker")
        assert url in workers(base)
        assert complete(base)["usage"]["completion_tokens"] == 4
    finally:
        assert stop(proc) == 0
    took = wait_for(lambda: url not in workers(base), 5, "the worker gone from the router")
    assert took < 5  # it left; its 30 s lease did not have to lapse
    assert http_get(base + "/readiness")[0] == 503
    assert "left router" in (tmp / "self-registered.log").read_text()


def test_a_killed_worker_is_forgotten_when_its_lease_lapses(router):
    base, _, tmp = router
    proc, url = start_worker(tmp, "leased", "--router-url", base, "--router-lease-s", "3")
    try:
        wait_for(lambda: url in workers(base), 30, "the worker registered")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        took = wait_for(lambda: url not in workers(base), 10, "the lapsed registration removed")
        assert took > 1.0  # not at once: the router waited for the lease
    finally:
        stop(proc)


def test_a_worker_that_does_not_register_is_found_by_dns(router):
    base, discovered_port, tmp = router
    proc, url = start_worker(tmp, "discovered", port=discovered_port)
    try:
        wait_for(lambda: url in workers(base), 30, "the worker discovered through DNS")
        wait_for(lambda: http_get(base + "/readiness")[0] == 200, 10, "ready")
        assert complete(base)["choices"][0]["text"]
    finally:
        stop(proc)


def test_add_worker_refuses_bad_leases_and_unreachable_workers(router):
    base = router[0]
    req = urllib.request.Request(f"{base}/add_worker?url=127.0.0.1:1&lease_s=-3", data=b"", method="POST",
                                 headers=KEY)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400 and "lease_s" in e.value.read().decode()
    req = urllib.request.Request(f"{base}/add_worker?url=127.0.0.1:{free_port()}", data=b"", method="POST",
                                 headers=KEY)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400 and "Failed to add worker" in e.value.read().decode()
