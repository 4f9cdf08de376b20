"""The offline Engine API: results shape, prefix reuse, streaming, bad input, control calls."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from radixmesh.engine.outputs import RequestOutput
from tests.conftest import model_path
from tests.engine_utils import assert_no_leak, parity_prompts, running_engine, vocab_size
from tests.reference import hf_greedy, hf_model

GREEDY = {"max_new_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def llm():
    with running_engine(model_path("tiny-qwen2"), chunked_prefill_size=64) as engine:
        yield engine


def assert_still_serving_without_leak(llm) -> None:
    """Once the aborted requests have left the scheduler: it still generates, and no KV page is leaked."""
    for _ in range(200):
        if llm.get_server_info()["internal_states"][0]["running"] == 0:
            break
        threading.Event().wait(0.02)
    assert llm.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["meta_info"]["completion_tokens"] > 0
    assert_no_leak(llm)


def test_result_shape_and_text(llm):
    out = llm.generate("The river runs past the old mill and", GREEDY)
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason"} <= set(meta)
    assert meta["completion_tokens"] == len(out["output_ids"]) > 0
    assert meta["prompt_tokens"] == len(llm.tokenizer("The river runs past the old mill and").input_ids)
    assert out["text"] == llm.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert meta["finish_reason"]["type"] in ("stop", "length")


def test_shared_200_token_prefix_is_reused(llm):
    path = model_path("tiny-qwen2")
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(16, vocab_size(path) - 16, (200,), generator=gen).tolist()
    first, second = prefix + [101, 102, 103], prefix + [201, 202]
    llm.generate(input_ids=first, sampling_params=GREEDY)
    out = llm.generate(input_ids=second, sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] >= 192
    assert out["output_ids"] == hf_greedy(path, [second], 16)[0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=""), "empty"),
    (dict(input_ids=[]), "empty"),
    (dict(input_ids=[1, 2, -1]), "outside the vocabulary"),
    (dict(input_ids=[1, 10**6]), "outside the vocabulary"),
    (dict(input_ids=[5] * 1024), "longer than the model's context length"),
    (dict(input_ids=[5, 6], sampling_params={"max_new_tokens": -1}), "max_new_tokens must be >= 0"),
    (dict(input_ids=[5, 6], sampling_params={"max_new_tokens": 2000}), "context length"),
    (dict(input_ids=[5, 6], sampling_params={"temperature": -0.5}), "temperature"),
    (dict(input_ids=[5, 6], sampling_params={"no_such_param": 1}), "unsupported sampling parameter"),
    (dict(input_ids=[[5, 6], []]), "empty"),
    (dict(prompt="hi", input_ids=[1]), "exactly one of"),
])
def test_bad_input_raises_and_engine_keeps_serving(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(**kwargs)
    assert llm.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["meta_info"]["completion_tokens"] > 0
    assert_no_leak(llm)


def test_unknown_engine_argument_is_rejected():
    with pytest.raises(TypeError, match="unknown engine argument"):
        running_engine(model_path("tiny-qwen2"), no_such_flag=1).__enter__()


def test_stream_is_cumulative_by_default(llm):
    prompt = "Once upon a time, in a quiet village,"
    full = llm.generate(prompt, GREEDY)
    chunks = list(llm.generate(prompt, GREEDY, stream=True))
    assert len(chunks) == len(full["output_ids"])
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"]) and b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]

    async def collect():
        gen = await llm.async_generate(prompt, GREEDY, stream=True)
        return [c async for c in gen]

    assert asyncio.run(collect())[-1]["text"] == full["text"]


def test_stream_output_sends_disjoint_segments():
    prompt = "Once upon a time, in a quiet village,"
    with running_engine(model_path("tiny-qwen2"), stream_output=True) as eng:
        full = eng.generate(prompt, GREEDY)
        chunks = list(eng.generate(prompt, GREEDY, stream=True))
        batch = list(eng.generate([prompt, "The river"], GREEDY, stream=True))
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert sum((c["output_ids"] for c in chunks), []) == full["output_ids"]
    assert "".join(c["text"] for c in batch if c["index"] == 0) == full["text"]
    assert {c["index"] for c in batch} == {0, 1}


@pytest.mark.parametrize("segments", [False, True])
def test_stream_interval_sends_the_first_token_then_every_nth_and_the_last(segments):
    """--stream-interval 5: 13 tokens arrive as 1, 5, 5, 2 (cumulative: 1, 6, 11, 13), the same tokens, text and
    logprobs as one whole answer; a stop string cuts the text as without an interval."""
    prompt = "Once upon a time, in a quiet village,"
    params = {"max_new_tokens": 13, "temperature": 0, "ignore_eos": True}
    # (no prefix cache: each run computes the prompt alike, so the logprobs match exactly)
    with running_engine(model_path("tiny-qwen2"), stream_output=segments, stream_interval=5,
                        disable_radix_cache=True) as eng:
        full = eng.generate(prompt, params, return_logprob=True)
        chunks = list(eng.generate(prompt, params, stream=True, return_logprob=True))
        stop = full["text"][len(full["text"]) // 2:][:3]
        cut = eng.generate(prompt, {**params, "stop": [stop]})
        cut_chunks = list(eng.generate(prompt, {**params, "stop": [stop]}, stream=True))
    sizes = [len(c["output_ids"]) for c in chunks]
    logprobs = [c["meta_info"]["output_token_logprobs"] for c in chunks]
    if segments:
        assert sizes == [1, 5, 5, 2]
        assert sum((c["output_ids"] for c in chunks), []) == full["output_ids"]
        assert "".join(c["text"] for c in chunks) == full["text"]
        assert sum(logprobs, []) == full["meta_info"]["output_token_logprobs"]
        assert "".join(c["text"] for c in cut_chunks) == cut["text"]
    else:
        assert sizes == [1, 6, 11, 13]
        assert chunks[-1]["output_ids"] == full["output_ids"] and chunks[-1]["text"] == full["text"]
        assert logprobs[-1] == full["meta_info"]["output_token_logprobs"]
        assert cut_chunks[-1]["text"] == cut["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_stream_interval_must_be_positive():
    with pytest.raises(ValueError, match="stream_interval"):
        running_engine(model_path("tiny-qwen2"), stream_interval=0).__enter__()


def test_stream_abandoned_early_frees_the_request(llm):
    gen = llm.generate(input_ids=[9, 10, 11], sampling_params={"max_new_tokens": 200, "temperature": 0,
                                                                  "ignore_eos": True}, stream=True)
    next(gen)
    gen.close()
    for _ in range(100):
        if llm.get_server_info()["internal_states"][0]["running"] == 0:
            break
        threading.Event().wait(0.02)
    assert_no_leak(llm)


def test_max_new_tokens_zero_and_stop_token_ids(llm):
    zero = llm.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 0})
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    base = llm.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["output_ids"]
    stop = base[3]
    out = llm.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "stop_token_ids": [stop]})
    assert out["output_ids"] == base[:base.index(stop) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_eos_ids_come_from_config_and_generation_config(llm):
    gen_eos = hf_model(model_path("tiny-qwen2")).generation_config.eos_token_id
    assert set(gen_eos if isinstance(gen_eos, list) else [gen_eos]) <= llm.model_config.eos_token_ids


def test_temperature_sampling_is_seeded():
    path = model_path("tiny-llama")
    params = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    prompts = parity_prompts(path)[:4]
    runs = []
    for _ in range(2):
        with running_engine(path, random_seed=123) as eng:
            runs.append([o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)])
    assert runs[0] == runs[1]
    assert runs[0] != hf_greedy(path, prompts, 16)


def test_output_logprobs_match_transformers(llm):
    path = model_path("tiny-qwen2")
    prompt = parity_prompts(path)[3]
    out = llm.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True)
    triples = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in triples] == out["output_ids"]
    ids = torch.tensor([prompt + out["output_ids"]])
    with torch.inference_mode():
        logits = hf_model(path)(ids).logits[0].float()
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(out["output_ids"])[:, None])
    assert torch.allclose(torch.tensor([lp for lp, _, _ in triples]), ref.squeeze(1), atol=1e-4)


def test_concurrent_threads_share_the_engine(llm):
    path = model_path("tiny-qwen2")
    prompts = parity_prompts(path)[:6]
    refs = hf_greedy(path, prompts, 16)
    results: dict[int, list[int]] = {}

    def worker(i):
        results[i] = llm.generate(input_ids=prompts[i], sampling_params=GREEDY)["output_ids"]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(prompts))] == refs


def test_server_info(llm):
    info = llm.get_server_info()
    assert info["max_total_num_tokens"] > 0 and info["available_kv_tokens"] <= info["max_total_num_tokens"]
    assert info["page_size"] == 1 and info["chunked_prefill_size"] == 64 and info["device"] == "cpu"


def test_stream_without_tokenizer_carries_ids_and_logprobs():
    path = model_path("tiny-llama")
    with running_engine(path, skip_tokenizer_init=True, stream_output=True) as eng:
        full = eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY, return_logprob=True)
        chunks = list(eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY, return_logprob=True, stream=True))
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            eng.generate("text needs a tokenizer", GREEDY)
    assert full["text"] == "" and all(c["text"] == "" for c in chunks)
    assert sum((c["output_ids"] for c in chunks), []) == full["output_ids"]
    streamed = sum((c["meta_info"]["output_token_logprobs"] for c in chunks), [])
    assert [t for _, t, _ in streamed] == full["output_ids"]
    full_lps = [lp for lp, _, _ in full["meta_info"]["output_token_logprobs"]]
    assert [lp for lp, _, _ in streamed] == pytest.approx(full_lps, abs=1e-5)  # the rerun reuses cached KV


def test_cancelled_async_call_frees_its_request_and_engine_survives(llm):
    params = {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}

    async def cancelled():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(llm.async_generate(input_ids=[9, 10, 11], sampling_params=params), 0.02)

    async def abandoned_stream():
        gen = await llm.async_generate(input_ids=[9, 10, 12], sampling_params=params, stream=True)
        await gen.__anext__()
        await gen.aclose()

    asyncio.run(cancelled())  # the loop closes while the scheduler may still be sending to it
    asyncio.run(abandoned_stream())
    assert_still_serving_without_leak(llm)


def test_top_logprobs_and_token_ids_logprob_match_transformers(llm):
    path = model_path("tiny-qwen2")
    prompt = parity_prompts(path)[4]
    watch = [5, 17, 300]
    out = llm.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=3,
                       token_ids_logprob=watch, return_text_in_logprobs=True)
    meta = out["meta_info"]
    with torch.inference_mode():
        logits = hf_model(path)(torch.tensor([prompt + out["output_ids"]])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    assert meta["input_token_logprobs"] == [] and len(meta["output_top_logprobs"]) == len(out["output_ids"])
    for step, (top, by_id) in enumerate(zip(meta["output_top_logprobs"], meta["output_token_ids_logprobs"])):
        values, ids = ref[step].topk(3)
        assert [t for _, t, _ in top] == ids.tolist()
        assert [lp for lp, _, _ in top] == pytest.approx(values.tolist(), abs=1e-4)
        assert [t for _, t, _ in by_id] == watch
        assert [lp for lp, _, _ in by_id] == pytest.approx(ref[step, watch].tolist(), abs=1e-4)
        assert all(text == llm.tokenizer.decode([t]) for _, t, text in top)
    assert meta["output_token_logprobs"][0][2] == llm.tokenizer.decode([out["output_ids"][0]])


@pytest.mark.parametrize("kwargs, message", [
    (dict(logprob_start_len=2), "logprob_start_len"),
    (dict(logprob_start_len=-3), "logprob_start_len"),
    (dict(top_logprobs_num=-1), "top_logprobs_num"),
    (dict(token_ids_logprob=[1, 10**6]), "token_ids_logprob"),
])
def test_bad_logprob_arguments(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(input_ids=[5, 6], sampling_params=GREEDY, return_logprob=True, **kwargs)


@pytest.mark.parametrize("start", [0, 1, 37])
@pytest.mark.parametrize("cfg", [dict(), dict(page_size=16, chunked_prefill_size=32)])
def test_input_token_logprobs_match_transformers(start, cfg):
    path = model_path("tiny-llama")
    prompt = parity_prompts(path)[5]  # 133 tokens sharing a 120-token prefix with the prompt run first
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(path)(torch.tensor([prompt])).logits[0].float(), -1)
    with running_engine(path, **cfg) as eng:
        eng.generate(input_ids=parity_prompts(path)[4], sampling_params=GREEDY)  # caches the shared prefix
        out = eng.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=start,
                           top_logprobs_num=2, token_ids_logprob=[5, 17])
    got, tops = out["meta_info"]["input_token_logprobs"], out["meta_info"]["input_top_logprobs"]
    assert [t for _, t, _ in got] == prompt[start:]
    first = 1 if start == 0 else 0
    if start == 0:
        assert got[0][0] is None and tops[0] is None
    want = [ref[i - 1, prompt[i]].item() for i in range(max(start, 1), len(prompt))]
    assert [lp for lp, _, _ in got[first:]] == pytest.approx(want, abs=1e-4)
    by_id = out["meta_info"]["input_token_ids_logprobs"]
    assert len(by_id) == len(got)
    for i, row, ids_row in zip(range(max(start, 1), len(prompt)), tops[first:], by_id[first:]):
        assert [t for _, t, _ in row] == ref[i - 1].topk(2).indices.tolist()
        assert [lp for lp, _, _ in ids_row] == pytest.approx(ref[i - 1, [5, 17]].tolist(), abs=1e-4)
    assert out["meta_info"]["cached_tokens"] <= max(start - 1, 0)  # the cache may not hide wanted logits


def test_prompt_scoring_with_no_new_tokens(llm):
    path = model_path("tiny-qwen2")
    prompt = parity_prompts(path)[3]
    out = llm.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                       logprob_start_len=0)
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(path)(torch.tensor([prompt])).logits[0].float(), -1)
    got = out["meta_info"]["input_token_logprobs"]
    assert out["output_ids"] == [] and got[0][0] is None and len(got) == len(prompt)
    want = [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert [lp for lp, _, _ in got[1:]] == pytest.approx(want, abs=1e-4)


def test_generate_into_hands_over_what_the_stream_yields(llm):
    """generate_into hands typed outputs (engine.outputs.RequestOutput) whose SGLang dicts are what the public
    stream yields."""
    prompts = ["Once upon a time", "The river"]

    async def both():
        streamed = [d async for d in await llm.async_generate(prompts, GREEDY, stream=True)]
        typed: list[RequestOutput] = []
        assert await llm.generate_into(typed.append, prompts, GREEDY) is None
        return streamed, typed

    streamed, typed = asyncio.run(both())
    assert all(isinstance(d, RequestOutput) for d in typed)
    assert all(d.finished == (d.finish_reason is not None) for d in typed)
    handed = [d.to_dict() for d in typed]
    assert all(set(d) == set(streamed[0]) for d in handed)  # text, output_ids, meta_info and index
    for i in (0, 1):  # per prompt the same cumulative deltas (how they group into steps may differ)
        mine = [d for d in handed if d["index"] == i]
        theirs = [d for d in streamed if d["index"] == i]
        assert mine[-1]["text"] == theirs[-1]["text"] and mine[-1]["output_ids"] == theirs[-1]["output_ids"]
        assert mine[-1]["meta_info"]["finish_reason"] == theirs[-1]["meta_info"]["finish_reason"]
        assert all(d["meta_info"]["finish_reason"] is None for d in mine[:-1])


def test_generate_into_error_or_cancel_frees_the_request(llm):
    params = {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}
    seen: list[RequestOutput] = []

    def failing(delta: RequestOutput) -> None:
        seen.append(delta)
        if len(seen) == 3:
            raise KeyError("the consumer broke")

    async def main():
        with pytest.raises(KeyError, match="the consumer broke"):
            await llm.generate_into(failing, input_ids=[9, 10, 11], sampling_params=params)
        count = len(seen)
        await asyncio.sleep(0.2)  # outputs already on their way are dropped, never handed over
        assert len(seen) == count == 3
        task = asyncio.ensure_future(llm.generate_into(seen.append, input_ids=[9, 10, 12], sampling_params=params))
        while len(seen) < 5:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        count = len(seen)
        await asyncio.sleep(0.2)
        assert len(seen) == count

    asyncio.run(main())
    assert_still_serving_without_leak(llm)


def test_stream_interval_counts_from_the_first_token_not_from_an_output_without_one():
    """An output that carries no token (a prompt chunk) before the first token does not make the first token wait
    for the interval."""
    from radixmesh.engine.request import StepOutput
    from radixmesh.engine.results import RequestSpec, ResultBuilder
    from radixmesh.engine.sampling.params import SamplingParams

    builder = ResultBuilder(RequestSpec("r", [1, 2, 3], SamplingParams(), None), None, stream=True, segments=True,
                            interval=4)

    def out(ids, done=False):
        return StepOutput("r", ids, None, None, None, done, None, 3, 0, 0)

    steps = [([], False), ([7], False), ([8], False), ([9], False), ([10], False), ([11], False), ([12], True)]
    sent = [builder.push(out(ids, done)) for ids, done in steps]
    assert [d and d.output_ids for d in sent] == [[], [7], None, None, None, [8, 9, 10, 11], [12]]
