"""Overlap scheduling (the default; --disable-overlap-schedule turns it off) changes when the host reads tokens, never
which tokens come out: one mixed workload (stop strings, grammars, penalties, logprobs of prompt and output, n,
min_new_tokens, seeds, bias, zero-token requests, chunked prefill, a KV pool small enough to retract) gives
identical results with overlap on and off. Unseeded random sampling is the exception by design: it draws from the
engine's generator, whose sequence depends on how many steps ran."""

from __future__ import annotations

import json

import pytest

from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}}, "required": ["n", "ok"],
          "additionalProperties": False}


def workload(path: str, crowded: bool = False) -> tuple[list[list[int]], list[dict], list[dict]]:
    """(prompts, sampling params, per-request logprob options) exercising every per-step feature. `crowded`: twice
    as many requests with short prompts and long outputs, so decoding outgrows a small pool and retracts."""
    prompts = parity_prompts(path)
    base = {"max_new_tokens": 24, "temperature": 0}
    params = [
        {**base, "stop": ["e", "a "], "max_new_tokens": 40},
        {**base, "json_schema": json.dumps(SCHEMA), "temperature": 0.7, "sampling_seed": 5, "max_new_tokens": 60},
        {**base, "frequency_penalty": 0.8, "presence_penalty": 0.4, "repetition_penalty": 1.3},
        {**base, "temperature": 0.9, "top_p": 0.9, "top_k": 40, "min_p": 0.02, "sampling_seed": 17},
        {**base, "min_new_tokens": 10, "stop_token_ids": [5, 9, 11], "logit_bias": {"7": 2.5}},
        {**base, "max_new_tokens": 0},
        {**base, "n": 3, "temperature": 1.0, "sampling_seed": 23, "max_new_tokens": 12},
        {**base, "max_new_tokens": 1},
        {**base, "ignore_eos": True, "max_new_tokens": 50},
    ]
    logprobs = [{"return_logprob": i % 2 == 0, "top_logprobs_num": 3 if i % 4 == 0 else 0,
                 "logprob_start_len": 2 if i % 3 == 0 else -1} for i in range(len(prompts))]
    if crowded:
        prompts = [p[:24] for p in prompts] * 2
        params = [{**p, "max_new_tokens": max(p["max_new_tokens"], 60)} if p["max_new_tokens"] > 1 else p
                  for p in params] * 2
        logprobs = logprobs * 2
    return prompts, params, logprobs


def _run_all(llm, prompts, params, logprobs) -> list:
    """One batch call (all requests queued at once), each request with its own logprob options."""
    return llm.generate(input_ids=prompts, sampling_params=params,
                        return_logprob=[lp["return_logprob"] for lp in logprobs],
                        top_logprobs_num=[lp["top_logprobs_num"] for lp in logprobs],
                        logprob_start_len=[lp["logprob_start_len"] for lp in logprobs])


def _strip(outs: list) -> list:
    """Drop what depends on timing, not on the tokens: request ids, latencies and cached_tokens (the requests
    arrive concurrently, so which prefix is in the tree when a request is admitted varies from run to run)."""
    def clean(o: dict) -> dict:
        meta = {k: v for k, v in o["meta_info"].items() if k not in ("id", "e2e_latency", "cached_tokens")}
        return {**o, "meta_info": meta}

    return [[clean(x) for x in o] if isinstance(o, list) else clean(o) for o in outs]


def assert_same(a, b, where: str = "") -> None:
    """Equal, except floats (logprobs) within 1e-5: batches of different sizes round float32 matmuls differently,
    with or without overlap."""
    if isinstance(a, float) and isinstance(b, float):
        assert abs(a - b) <= 1e-5, f"{where}: {a} != {b}"
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("engine_kwargs", [
    dict(chunked_prefill_size=64, page_size=1),
    dict(chunked_prefill_size=32, page_size=16, enable_mixed_chunk=True),
    dict(chunked_prefill_size=64, page_size=4, max_total_tokens=320, schedule_conservativeness=0.05),
], ids=["chunked", "mixed-page16", "small-pool-retracts"])
def test_overlap_on_and_off_give_identical_results(engine_kwargs):
    path = model_path("tiny-qwen2")
    prompts, params, logprobs = workload(path, crowded="max_total_tokens" in engine_kwargs)
    results, stats = {}, {}
    for overlap in (True, False):
        with running_engine(path, disable_overlap_schedule=not overlap, **engine_kwargs) as llm:
            llm.generate(input_ids=prompts[:4], sampling_params={"max_new_tokens": 8, "temperature": 0})
            results[overlap] = _strip(_run_all(llm, prompts, params, logprobs))
            stats[overlap] = llm.get_load()
    assert_same(results[True], results[False], "outputs")
    finishes = [o["meta_info"]["finish_reason"]["type"] for o in results[True] if isinstance(o, dict)]
    assert {"stop", "length"} <= set(finishes), finishes
    json.loads(results[True][1]["text"])
    if "max_total_tokens" in engine_kwargs:
        assert stats[True]["retractions"] > 0 and stats[False]["retractions"] > 0, stats


def test_overlap_abort_mid_stream_frees_everything():
    """Aborts land while a step is in flight: the request ends with an abort and no page leaks (checked on exit)."""
    path = model_path("tiny-qwen2")
    prompts = parity_prompts(path)
    with running_engine(path, chunked_prefill_size=64) as llm:
        others = llm.generate(input_ids=prompts[:4], sampling_params={"max_new_tokens": 8, "temperature": 0},
                              rid=[f"o{i}" for i in range(4)])
        stream = llm.generate(input_ids=prompts[7], sampling_params={"max_new_tokens": 500, "temperature": 0,
                                                                     "ignore_eos": True}, stream=True, rid="long")
        seen = 0
        for chunk in stream:
            seen = len(chunk["output_ids"])
            if seen >= 3:
                llm.abort_request("long")
            if chunk["meta_info"]["finish_reason"] is not None:
                assert chunk["meta_info"]["finish_reason"]["type"] == "abort"
                break
        assert 3 <= seen < 500
        assert all(len(o["output_ids"]) == 8 for o in others)
