"""Prefill/decode disaggregation with metrics on, as real processes (tokenizer, two prefill workers, one decode
worker, the router; Mooncake's transfer engine over TCP on loopback). One prefill worker corrupts its KV writes
(--disaggregation-inject-fault corrupt) and the decode worker verifies checksums, so some rooms fail and the router
retries them on the healthy pair. The scrapes must agree with each other and with the clients' answers: bytes sent by
the healthy prefill worker equal the bytes the decode worker received, transfers and failures by reason are counted
on each side, the router's retries equal the decode worker's failed rooms, and each role labels its own series."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from radixmesh.services.launch import free_port
from tests.conftest import ROOT, model_path
from tests.services.metrics_utils import scrape, spawn_grpc, stop, wait_grpc, wait_http

pytest.importorskip("mooncake.engine", reason="needs the Mooncake transfer engine (mooncake-transfer-engine)")

MODEL = model_path("tiny-llama")
PD = ("--disaggregation-transfer-backend", "mooncake")


def post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd-metrics")
    ports = {name: free_port() for name in ("tok", "good", "bad", "decode", "router")}
    procs, urls = [], {}
    try:
        tok, tok_url = spawn_grpc("radixmesh.services.tokenizer", "--model-path", MODEL, log=tmp / "tok.log")
        procs.append(tok)
        for name, extra in (("good", ()), ("bad", ("--disaggregation-inject-fault", "corrupt"))):
            p, urls[name] = spawn_grpc("radixmesh.services.prefill", "--model-path", MODEL, *PD, *extra,
                                       "--disaggregation-bootstrap-port", str(free_port()), "--served-model-name",
                                       "tiny", "--metrics-port", str(ports[name]), log=tmp / f"{name}.log")
            procs.append(p)
        p, urls["decode"] = spawn_grpc("radixmesh.services.worker", "--model-path", MODEL, *PD, "--disaggregation-mode",
                                       "decode", "--disaggregation-verify-kv", "--served-model-name", "tiny",
                                       "--enable-metrics", "--metrics-port", str(ports["decode"]),
                                       log=tmp / "decode.log")
        procs.append(p)
        for p, url in zip(procs, [tok_url, urls["good"], urls["bad"], urls["decode"]]):
            wait_grpc(p, url)
        for attempt in range(3):
            # the port is picked now, and again if the router could not bind it: a port free_port() found free can
            # be taken as an ephemeral port by the services started meanwhile (a CI run)
            ports["router"] = free_port()
            router = subprocess.Popen(
                [sys.executable, "-m", "radixmesh.services.router", "--port", str(ports["router"]),
                 "--tokenizer-url", tok_url, "--worker-urls", urls["good"], urls["bad"], urls["decode"],
                 "--policy", "round_robin", "--log-level", "warning", "--enable-metrics"],
                cwd=ROOT, stdout=open(tmp / f"router-{attempt}.log", "w"), stderr=subprocess.STDOUT)
            procs.append(router)
            deadline = time.monotonic() + 60
            while router.poll() is None and time.monotonic() < deadline:
                try:
                    wait_http(f"http://127.0.0.1:{ports['router']}/health", timeout=1)
                    break
                except RuntimeError:
                    pass
            else:
                if router.poll() is None:
                    raise RuntimeError("the router did not answer /health within 60 s")
                continue
            break
        else:
            raise RuntimeError("the router could not start on three free ports")
        yield ports, urls
    finally:
        for p in reversed(procs):
            stop(p)


def test_transfer_metrics_agree_across_prefill_decode_and_router(pd):
    ports, urls = pd
    prompts = [f"The lighthouse keeper number {i} wrote in the log that night" for i in range(4)]
    metas = [post(ports["router"], "/generate", {"text": t, "sampling_params": {"max_new_tokens": 5,
                                                                               "temperature": 0}})["meta_info"]
             for t in prompts]
    assert all(m["completion_tokens"] == 5 for m in metas)

    good, bad, dec = scrape(ports["good"]), scrape(ports["bad"]), scrape(ports["decode"])
    router = scrape(ports["router"])  # /metrics on the router's API port
    prefill_role, decode_role = {"model_name": "tiny", "role": "prefill"}, {"model_name": "tiny", "role": "decode"}
    failed = dec.value("radixmesh:kv_transfer_failures_total", reason="checksum_mismatch", **decode_role)
    assert failed >= 1  # round robin sent at least one request to the corrupting prefill worker
    assert dec.value("radixmesh:kv_transfer_failures_total", **decode_role) == failed, \
        [(s.labels, s.value) for s in dec.all("radixmesh:kv_transfer_failures_total")]
    # every request finally went through the healthy pair: its bytes are exactly what the decode worker took in
    assert good.value("radixmesh:kv_transfer_seconds_count", **prefill_role) == 4
    assert dec.value("radixmesh:kv_transfer_seconds_count", **decode_role) == 4
    sent = good.value("radixmesh:kv_transfer_bytes_total", **prefill_role)
    assert sent > 0 and sent == dec.value("radixmesh:kv_transfer_bytes_total", **decode_role)
    # the corrupting worker's writes "succeeded" from its side
    assert bad.value("radixmesh:kv_transfer_seconds_count", **prefill_role) == failed
    assert bad.value("radixmesh:kv_transfer_failures_total", **prefill_role) == 0
    # request counters per role: the prefill side counts prompts, the decode side generations and TTFT
    assert good.value("sglang:num_requests_total", **prefill_role) == 4
    assert good.value("sglang:prompt_tokens_total", **prefill_role) == sum(m["prompt_tokens"] for m in metas)
    assert good.value("sglang:generation_tokens_total", **prefill_role) == 0
    assert dec.value("sglang:generation_tokens_total", **decode_role) == 4 * 5
    assert dec.value("sglang:time_to_first_token_seconds_count", **decode_role) == 4
    assert dec.value("sglang:num_requests_total", **decode_role) == 4 + failed
    assert dec.value("sglang:num_aborted_requests_total", **decode_role) == failed
    assert dec.value("sglang:num_decode_prealloc_queue_reqs", **decode_role) == 0
    assert dec.value("sglang:kv_transfer_speed_gb_s", **decode_role) > 0
    assert good.value("sglang:num_prefill_inflight_queue_reqs", **prefill_role) == 0
    # the prefill side is where PD requests queue: each prefilled request's wait is observed there
    assert good.value("sglang:queue_time_seconds_count", **prefill_role) == 4
    assert bad.value("sglang:queue_time_seconds_count", **prefill_role) == failed
    # the router: one retry per failed room, each charged to a worker of the failed pair
    assert router.value("sgl_router_retries_total", model_name="tiny", role="router") == failed
    assert router.value("sgl_router_processed_requests_total", worker=urls["decode"]) == 4 + failed
    assert router.value("sgl_router_processed_requests_total", worker=urls["good"]) == 4
    assert router.value("sgl_router_policy_decisions_total", policy="least_loaded") == 4 + failed
    assert router.value("sgl_router_request_errors_total") == 0
