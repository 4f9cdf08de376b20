"""A colocated worker process with --enable-metrics: real requests over gRPC, then /metrics scraped over HTTP and
parsed with prometheus_client: SGLang's names and types, the model_name/role labels, token counters equal to what
was sent and generated, histogram counts equal to request (and streamed chunk) counts, per-tier cache hits rising
on a repeated prompt, running/aborted requests, and counters that do not reset on a cache flush."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest

from radixmesh.engine.config import EngineArgs, resolve_args
from radixmesh.engine.model_config import ModelConfig
from radixmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from radixmesh.services.launch import free_port
from tests.conftest import model_path
from tests.services.metrics_utils import scrape, start_grpc, stop

MODEL = model_path("tiny-llama")
ROLE = {"model_name": "tiny", "role": "colocated"}


@pytest.fixture(scope="module")
def worker():
    port = free_port()
    proc, url = start_grpc("radixmesh.services.worker", "--model-path", MODEL, "--served-model-name", "tiny",
                           "--enable-metrics", "--metrics-port", str(port))
    ch = grpc.insecure_channel(url)
    yield worker_pb2_grpc.WorkerServiceStub(ch), port
    ch.close()
    assert stop(proc) == 0


def greedy(max_new: int, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, **kw)


def generate(stub, rid: str, prompt: list[int], params, stream: bool) -> list[worker_pb2.GenerateResponse]:
    return list(stub.Generate(worker_pb2.GenerateRequest(request_id=rid, input_ids=prompt, sampling_params=params,
                                                         stream=stream)))


def test_request_counters_and_histograms_match_the_requests(worker):
    stub, port = worker
    before = scrape(port)
    assert before.types["sglang:prompt_tokens"] == "counter"
    assert before.types["sglang:time_to_first_token_seconds"] == "histogram"
    assert before.types["sglang:num_running_reqs"] == "gauge"
    assert before.value("sglang:num_requests_total", **ROLE) == 0
    p1, p2 = list(range(20, 60)), list(range(100, 130))
    streamed = generate(stub, "m1", p1, greedy(12), stream=True)
    whole = generate(stub, "m2", p2, greedy(5, n=2), stream=False)
    usages = [streamed[-1].complete.usage] + [m.complete.usage for m in whole]
    chunks = [m for m in streamed if m.WhichOneof("response") == "chunk" and m.chunk.token_ids]
    after = scrape(port)
    assert after.value("sglang:num_requests_total", **ROLE) == 3
    assert after.value("sglang:prompt_tokens_total", **ROLE) == len(p1) + 2 * len(p2)
    assert after.value("sglang:generation_tokens_total", **ROLE) == 12 + 2 * 5 == sum(u.completion_tokens
                                                                                        for u in usages)
    assert after.value("sglang:cached_tokens_total", **ROLE) == sum(u.cached_tokens for u in usages)
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "time_per_output_token_seconds",
                 "queue_time_seconds"):
        assert after.value(f"sglang:{name}_count", **ROLE) == 3, name
        assert after.value(f"sglang:{name}_bucket", le="+Inf", **ROLE) == 3, name
    # one inter-token observation per streamed chunk after the first
    assert after.value("sglang:inter_token_latency_seconds_count", **ROLE) == len(chunks) - 1
    e2e, ttft = after.value("sglang:e2e_request_latency_seconds_sum"), after.value(
        "sglang:time_to_first_token_seconds_sum")
    assert 0 < ttft <= e2e
    assert after.value("sglang:num_aborted_requests_total", **ROLE) == 0
    assert after.value("radixmesh:cache_lookup_tokens_total", **ROLE) >= len(p1) + len(p2)


def test_a_repeated_prompt_counts_device_cache_hits(worker):
    stub, port = worker
    prompt = list(range(200, 248))
    generate(stub, "c1", prompt, greedy(4), stream=False)
    before = scrape(port)
    again = generate(stub, "c2", prompt, greedy(4), stream=True)[-1].complete.usage
    after = scrape(port)
    assert again.cached_tokens == len(prompt) - 1  # all but the last token, which is recomputed for its logits
    hits = after.value("radixmesh:cache_hit_tokens_total", tier="device", **ROLE) - \
        before.value("radixmesh:cache_hit_tokens_total", tier="device", **ROLE)
    assert hits == again.cached_tokens
    assert after.value("radixmesh:cache_hit_tokens_total", tier="host", **ROLE) == 0  # no host tier here
    assert after.value("sglang:cached_tokens_total", **ROLE) - before.value("sglang:cached_tokens_total",
                                                                            **ROLE) == again.cached_tokens
    assert 0 < after.value("sglang:cache_hit_rate", **ROLE) < 1
    assert after.value("radixmesh:cache_lookup_tokens_total", **ROLE) - \
        before.value("radixmesh:cache_lookup_tokens_total", **ROLE) == len(prompt)


def test_gauges_while_running_and_the_aborted_counter(worker):
    stub, port = worker
    base = scrape(port)
    stream = stub.Generate(worker_pb2.GenerateRequest(request_id="long", input_ids=list(range(30, 90)),
                                                      sampling_params=greedy(900), stream=True))
    next(stream)
    during = scrape(port)
    loads = stub.GetLoads(worker_pb2.GetLoadsRequest())
    assert during.value("sglang:num_running_reqs", **ROLE) == 1
    assert during.value("sglang:num_queue_reqs", **ROLE) == 0
    assert during.value("radixmesh:worker_active_requests", **ROLE) == 1
    assert during.value("sglang:max_total_num_tokens", **ROLE) == loads.total_kv_tokens
    assert 0 < during.value("sglang:num_used_tokens", **ROLE) <= loads.total_kv_tokens
    assert during.value("sglang:token_usage", **ROLE) == pytest.approx(
        during.value("sglang:num_used_tokens", **ROLE) / loads.total_kv_tokens)
    assert during.value("sglang:gen_throughput", **ROLE) > 0
    assert stub.Abort(worker_pb2.AbortRequest(request_id="long")).found
    list(stream)
    after = scrape(port)
    assert after.value("sglang:num_aborted_requests_total", **ROLE) == base.value(
        "sglang:num_aborted_requests_total", **ROLE) + 1
    assert after.value("sglang:num_running_reqs", **ROLE) == 0
    assert after.value("radixmesh:worker_active_requests", **ROLE) == 0


def test_a_client_that_leaves_counts_as_aborted_and_bad_input_is_not_a_request(worker):
    stub, port = worker
    base = scrape(port)
    stream = stub.Generate(worker_pb2.GenerateRequest(request_id="gone", input_ids=list(range(30, 90)),
                                                      sampling_params=greedy(900), stream=True))
    next(stream)
    stream.cancel()
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, "bad", [10 ** 9], greedy(2), stream=False)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    deadline = time.monotonic() + 10
    while scrape(port).value("sglang:num_aborted_requests_total", **ROLE) == base.value(
            "sglang:num_aborted_requests_total", **ROLE):
        assert time.monotonic() < deadline, "the cancelled stream was not counted"
        time.sleep(0.1)
    after = scrape(port)
    assert after.value("sglang:num_requests_total", **ROLE) == base.value("sglang:num_requests_total", **ROLE) + 1
    assert after.value("sglang:prompt_tokens_total", **ROLE) == base.value("sglang:prompt_tokens_total",
                                                                           **ROLE) + 60


def test_counters_survive_a_cache_flush_and_concurrent_scrapes(worker):
    stub, port = worker
    before = scrape(port)
    assert stub.FlushCache(worker_pb2.FlushCacheRequest()).success
    errors: list[BaseException] = []

    def scrape_loop() -> None:
        try:
            for _ in range(5):
                scrape(port)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=scrape_loop) for _ in range(3)]
    for t in threads:
        t.start()
    generate(stub, "f1", list(range(300, 320)), greedy(3), stream=True)
    for t in threads:
        t.join()
    assert not errors
    after = scrape(port)
    for name in ("sglang:num_requests_total", "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
                 "radixmesh:cache_hit_tokens_total", "radixmesh:forward_steps_total"):
        assert after.value(name, **ROLE) >= before.value(name, **ROLE), name
    assert after.value("sglang:num_requests_total", **ROLE) == before.value("sglang:num_requests_total", **ROLE) + 1
    assert after.value("radixmesh:forward_steps_total", mode="extend", **ROLE) > 0
    assert after.value("radixmesh:forward_steps_total", mode="decode", **ROLE) > 0


def test_expert_distribution_of_a_mixture_of_experts_worker():
    """--enable-expert-distribution-metrics on the tiny Qwen3-MoE: tokens per expert summed over its three MoE
    layers equal top_k x the tokens forwarded x 3, balancedness in (0, 1], and GetServerInfo has the per-layer
    counts. A dense model refuses the flag with the reason."""
    port = free_port()
    proc, url = start_grpc("radixmesh.services.worker", "--model-path", model_path("tiny-qwen3-moe"),
                           "--served-model-name", "tiny", "--enable-metrics", "--metrics-port", str(port),
                           "--enable-expert-distribution-metrics", "--disable-radix-cache")
    try:
        with grpc.insecure_channel(url) as ch:
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            prompt = list(range(40, 60))
            generate(stub, "m1", prompt, greedy(6), stream=False)
            got = scrape(port)
            forwarded = len(prompt) + 6 - 1  # the last token is sampled, never forwarded
            experts = got.labels("radixmesh:moe_expert_tokens_total", "expert")
            assert experts == {"0", "1", "2", "3"}
            assert got.value("radixmesh:moe_expert_tokens_total", **ROLE) == 2 * forwarded * 3
            assert 0 < got.value("radixmesh:moe_expert_balancedness", **ROLE) <= 1
            info = json.loads(stub.GetServerInfo(worker_pb2.GetServerInfoRequest()).server_info_json)
            dist = info["expert_distribution"]
            assert dist["layers"] == [0, 2, 3] and all(sum(row) == 2 * forwarded for row in dist["tokens"])
    finally:
        assert stop(proc) == 0
    with pytest.raises(ValueError, match="has no mixture-of-experts layers"):
        resolve_args(EngineArgs(model_path=MODEL, device="cpu", enable_expert_distribution_metrics=True),
                     ModelConfig.from_path(MODEL))
