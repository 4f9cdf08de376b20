"""The router, the tokenizer and two colocated workers as real processes, each exporting metrics; real requests
through the router's HTTP API, then every /metrics scraped and parsed: per-route and per-worker router counters that
add up to the requests sent, errors by type, the policy's decisions, the workers' token counters summing to the
usage the clients got, the tokenizer's calls and tokens, /metrics open without the API key, a worker that dies
counted as a worker error and a retry, and the metrics flags (environment, config file, --metrics-port alone)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import grpc
import pytest

from radixmesh.services.common.metrics import MetricsSettings, ServiceMetrics
from radixmesh.settings import parse_settings
from radixmesh.services.launch import free_port
from radixmesh.services.router.settings import RouterSettings
from tests.conftest import ROOT, model_path
from radixmesh.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from tests.services.metrics_utils import http_get, scrape, spawn_grpc, stop, wait_grpc, wait_http

MODEL = model_path("tiny-llama")
KEY = {"Authorization": "Bearer sk-test"}
ROUTER = {"model_name": "tiny", "role": "router"}


def post(port: int, path: str, body: bytes, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router-metrics")
    procs, ports = [], {"tokenizer": free_port(), "w0": free_port(), "w1": free_port(), "router": free_port(),
                        "router_metrics": free_port()}
    try:
        tok, tok_url = spawn_grpc("radixmesh.services.tokenizer", "--model-path", MODEL, "--served-model-name", "tiny",
                                  "--metrics-port", str(ports["tokenizer"]), log=tmp / "tokenizer.log")
        procs.append(tok)
        urls = []
        for name in ("w0", "w1"):
            w, url = spawn_grpc("radixmesh.services.worker", "--model-path", MODEL, "--served-model-name", "tiny",
                                "--enable-metrics", "--metrics-port", str(ports[name]), log=tmp / f"{name}.log")
            procs.append(w)
            urls.append(url)
        for p, url in zip(procs, [tok_url, *urls]):
            wait_grpc(p, url)
        router = subprocess.Popen(
            [sys.executable, "-m", "radixmesh.services.router", "--port", str(ports["router"]),
             "--tokenizer-url", tok_url, "--worker-urls", *urls, "--policy", "round_robin",
             "--api-key", "sk-test", "--log-level", "warning",
             "--health-check-interval-s", "600", "--enable-metrics", "--metrics-port", str(ports["router_metrics"])],
            cwd=ROOT, stdout=open(tmp / "router.log", "w"), stderr=subprocess.STDOUT)
        procs.append(router)
        wait_http(f"http://127.0.0.1:{ports['router']}/health")
        yield ports, urls, procs, tok_url
    finally:
        for p in reversed(procs):
            stop(p)


def test_flags_come_from_the_cli_the_environment_and_config_files(tmp_path, monkeypatch):
    def parse(*argv: str) -> MetricsSettings:
        _, kwargs = parse_settings("t", RouterSettings, ["--tokenizer-url", "h:1", *argv], MetricsSettings)
        return MetricsSettings(**kwargs)

    assert not parse().enabled and ServiceMetrics.from_settings(parse(), "router") is None
    assert parse("--enable-metrics").enabled and parse("--enable-metrics").metrics_port is None
    alone = parse("--metrics-port", "9100")  # asking for a port means asking for metrics
    assert alone.enabled and not alone.enable_metrics and alone.metrics_port == 9100
    config = tmp_path / "c.yaml"
    config.write_text("enable-metrics: true\nmetrics-host: 0.0.0.0\n")
    from_file = parse("--config", str(config))
    assert from_file.enabled and from_file.metrics_host == "0.0.0.0"
    monkeypatch.setenv("RADIXMESH_METRICS_PORT", "9200")
    assert parse().metrics_port == 9200 and parse("--metrics-port", "9300").metrics_port == 9300
    with pytest.raises(ValueError, match="metrics-port"):
        MetricsSettings(metrics_port=70000)
    for module in ("radixmesh.services.router", "radixmesh.services.tokenizer", "radixmesh.services.worker",
                   "radixmesh.services.prefill"):
        out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and "--enable-metrics" in out.stdout and "--metrics-port" in out.stdout, module


def test_router_worker_and_tokenizer_metrics_add_up(mesh):
    ports, urls, _, _ = mesh
    usages, prompts = [], ["The lighthouse keeper", "Once upon a time", "A river runs", "Far away", "Hello", "Tea"]
    for text in prompts:
        status, body = post(ports["router"], "/generate", json.dumps(
            {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).encode(), KEY)
        assert status == 200, body
        usages.append(json.loads(body)["meta_info"])
    for text in prompts[:2]:
        status, body = post(ports["router"], "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": text, "max_tokens": 3, "stream": True, "temperature": 0, "echo": True,
             "stream_options": {"include_usage": True}}).encode(), KEY)
        assert status == 200
        events = [json.loads(line[6:]) for line in body.decode().splitlines()
                  if line.startswith("data: {")]
        u = events[-1]["usage"]
        usages.append({"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"]})
    assert post(ports["router"], "/generate", b"{not json", KEY)[0] == 400
    assert post(ports["router"], "/generate", b"{}")[0] == 401

    # /metrics is on the API port without the API key, and on --metrics-port
    assert http_get(f"http://127.0.0.1:{ports['router']}/metrics")[0] == 200
    r = scrape(ports["router_metrics"])
    assert r.value("sgl_router_requests_total", route="/generate", **ROUTER) == 8
    assert r.value("sgl_router_requests_total", route="/v1/completions", **ROUTER) == 2
    assert r.value("sgl_router_request_duration_seconds_count", route="/generate") == 8
    assert r.value("sgl_router_request_errors_total", route="/generate", error_type="bad_request") == 1
    assert r.value("sgl_router_request_errors_total", route="/generate", error_type="unauthorized") == 1
    per_worker = {u: r.value("sgl_router_processed_requests_total", worker=u, **ROUTER) for u in urls}
    assert per_worker == {urls[0]: 4, urls[1]: 4}  # round robin over 8 generations
    assert r.value("sgl_router_policy_decisions_total", policy="round_robin") == 8
    assert r.value("sgl_router_worker_request_duration_seconds_count") == 8
    assert r.value("sgl_router_worker_time_to_first_token_seconds_count") == 2  # the streamed ones
    assert r.value("sgl_router_active_workers", **ROUTER) == 2
    assert all(r.value("sgl_router_worker_health", worker=u) == 1 for u in urls)
    assert all(r.value("sgl_router_running_requests", worker=u) == 0 for u in urls)
    assert all(r.value("radixmesh_router_open_streams", worker=u) == 0 for u in urls)  # (tests/e2e: > 0 mid-load)
    assert r.value("sgl_router_retries_total") == 0

    workers = [scrape(ports[name]) for name in ("w0", "w1")]
    total = lambda name: sum(w.value(name, model_name="tiny", role="colocated") for w in workers)  # noqa: E731
    assert total("sglang:num_requests_total") == 8
    assert total("sglang:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert total("sglang:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert total("sglang:e2e_request_latency_seconds_count") == 8

    # /generate's text went to the workers, which tokenized it; the tokenizer service tokenized the completions,
    # whose `echo` needs the prompt's ids in the router (without it they go to the workers as text too)
    tok = scrape(ports["tokenizer"])
    labels = {"model_name": "tiny", "role": "tokenizer"}
    assert tok.value("radixmesh:tokenizer_requests_total", method="tokenize_text", **labels) == 2
    assert tok.value("radixmesh:tokenizer_tokens_total", method="tokenize_text", **labels) == \
        sum(u["prompt_tokens"] for u in usages[-2:])
    assert tok.value("radixmesh:tokenizer_latency_seconds_count", method="tokenize_text", **labels) == 2
    assert tok.value("radixmesh:tokenizer_errors_total", **labels) == 0


def test_a_dead_worker_counts_as_a_worker_error_and_a_retry(mesh):
    ports, urls, procs, _ = mesh
    assert stop(procs[2]) == 0  # the second worker; the router's health probe is slow, so it still routes there
    before = scrape(ports["router_metrics"])
    for text in ("one", "two"):
        status, body = post(ports["router"], "/generate", json.dumps(
            {"text": text, "sampling_params": {"max_new_tokens": 2}}).encode(), KEY)
        assert status == 200, body
    after = scrape(ports["router_metrics"])
    assert after.value("sgl_router_retries_total", worker=urls[1], **ROUTER) == 1
    assert after.value("sgl_router_worker_errors_total", worker=urls[1], error_type="UNAVAILABLE") == 1
    assert after.value("sgl_router_worker_health", worker=urls[1]) == 0
    assert after.value("sgl_router_active_workers") == 1
    got = {u: after.value("sgl_router_processed_requests_total", worker=u) -
           before.value("sgl_router_processed_requests_total", worker=u) for u in urls}
    assert got == {urls[0]: 2, urls[1]: 1}  # one attempt on the dead worker, then both on the live one
    assert after.value("sgl_router_request_errors_total", route="/generate") == 2  # only the earlier 400 and 401


def test_tokenizer_errors_are_counted(mesh):
    ports, _, _, tok_url = mesh
    before = scrape(ports["tokenizer"])
    with grpc.insecure_channel(tok_url) as ch:
        with pytest.raises(grpc.RpcError) as e:
            tokenizer_pb2_grpc.TokenizerServiceStub(ch).Tokenize(tokenizer_pb2.TokenizeRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = scrape(ports["tokenizer"])
    assert after.value("radixmesh:tokenizer_errors_total", method="tokenize_none") == \
        before.value("radixmesh:tokenizer_errors_total", method="tokenize_none") + 1
