"""Embedding engines (is_embedding): Engine.encode / async_encode against transformers' hidden states pooled the same
way (last token, or mean), Matryoshka `dimensions`, the prefix cache, chunked prompts, bad input, no KV leak."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from radixmesh.engine.pooling import Pooling, pooling_of
from tests.conftest import model_path
from tests.engine_utils import assert_no_leak, running_engine

TEXTS = ["Hello there, how are you?", "What is the capital of France?", "Once upon a time in a small village",
         "東京 is a city in 日本語 🙂"]
TOL = 1e-4


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModel, AutoTokenizer

    path = model_path("tiny-qwen3-embed")
    return AutoModel.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def reference(hf, ids: list[int], pooling: Pooling = Pooling.LAST) -> torch.Tensor:
    """transformers' final hidden states (after the final norm) pooled and L2-normalised."""
    model, _ = hf
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    return F.normalize(hidden[-1] if pooling is Pooling.LAST else hidden.mean(0), dim=-1)


def assert_close(result: dict, expected: torch.Tensor) -> None:
    got = torch.tensor(result["embedding"])
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < TOL


@pytest.fixture(scope="module")
def llm():
    # small pages and chunks: prompts span several pages, the long one several prefill chunks
    with running_engine(model_path("tiny-qwen3-embed"), is_embedding=True, page_size=4,
                        chunked_prefill_size=16) as engine:
        yield engine


def long_ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(16, 900, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_checkpoint_states_last_token_pooling():
    assert pooling_of(model_path("tiny-qwen3-embed")) is Pooling.LAST


def test_single_string_matches_transformers(llm, hf):
    out = llm.encode(TEXTS[0])
    ids = hf[1](TEXTS[0]).input_ids
    assert ids[-1] == hf[1].convert_tokens_to_ids("<|endoftext|>")  # the tokenizer appends EOS, as Qwen3-Embedding's
    assert set(out) == {"embedding", "meta_info"}
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    assert_close(out, reference(hf, ids))
    assert abs(sum(x * x for x in out["embedding"]) - 1.0) < 1e-5


def test_batch_of_strings_matches_transformers_and_differs_by_prompt(llm, hf):
    outs = llm.encode(TEXTS)
    assert isinstance(outs, list) and len(outs) == len(TEXTS)
    vectors = []
    for text, out in zip(TEXTS, outs):
        expected = reference(hf, hf[1](text).input_ids)
        assert_close(out, expected)
        vectors.append(expected)
    sims = torch.stack(vectors) @ torch.stack(vectors).T
    assert sims.fill_diagonal_(0).max().item() < 0.9  # distinct prompts give distinct vectors


def test_token_ids_one_and_batch_and_as_prompt(llm, hf):
    batch = [long_ids(7, 1), long_ids(40, 2), long_ids(3, 3)]  # 40 tokens: three prefill chunks
    one = llm.encode(input_ids=batch[1])
    assert_close(one, reference(hf, batch[1]))
    for outs in (llm.encode(input_ids=batch), llm.encode(batch)):  # SGLang's encode also takes ids as `prompt`
        for ids, out in zip(batch, outs):
            assert out["meta_info"]["prompt_tokens"] == len(ids)
            assert_close(out, reference(hf, ids))


def test_prefix_cache_reuse_gives_the_same_vector(llm, hf):
    shared = long_ids(30, 4)
    first = llm.encode(input_ids=shared + [101, 102])
    again = llm.encode(input_ids=shared + [103, 104, 105])
    assert again["meta_info"]["cached_tokens"] >= 28  # the shared prefix's whole pages
    assert_close(first, reference(hf, shared + [101, 102]))
    assert_close(again, reference(hf, shared + [103, 104, 105]))
    repeat = llm.encode(input_ids=shared + [101, 102])
    assert repeat["meta_info"]["cached_tokens"] > 0
    assert_close(repeat, torch.tensor(first["embedding"]))


def test_matryoshka_dimensions_truncate_and_renormalize(llm, hf):
    ids = hf[1](TEXTS[1]).input_ids
    full = reference(hf, ids)
    for d in (1, 16, 128):
        out = llm.encode(TEXTS[1], dimensions=d)
        assert_close(out, F.normalize(full[:d], dim=0))


@pytest.mark.parametrize("bad, words", [(0, "between 1 and 128"), (129, "between 1 and 128"),
                                        (True, "integer"), ("8", "integer")])
def test_bad_dimensions_are_rejected(llm, bad, words):
    with pytest.raises(ValueError, match=words):
        llm.encode("hello", dimensions=bad)


@pytest.mark.parametrize("kwargs, words", [({"prompt": ""}, "empty"), ({"prompt": []}, "empty"),
                                           ({"input_ids": [5, 99999]}, "outside the vocabulary"),
                                           ({"prompt": "a", "input_ids": [1]}, "exactly one"),
                                           ({"prompt": [1.5]}, "string")])
def test_bad_input_is_rejected_and_the_engine_keeps_serving(llm, hf, kwargs, words):
    with pytest.raises(ValueError, match=words):
        llm.encode(**kwargs)
    assert_close(llm.encode(input_ids=[7, 8, 9]), reference(hf, [7, 8, 9]))


def test_generation_is_refused_on_an_embedding_engine(llm):
    with pytest.raises(ValueError, match="embedding model"):
        llm.generate("hello", {"max_new_tokens": 2})
    with pytest.raises(ValueError, match="embedding model"):
        asyncio.run(llm.async_generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2}))


def test_async_encode_concurrent_calls(llm, hf):
    async def run():
        return await asyncio.gather(*(llm.async_encode(t) for t in TEXTS), llm.async_encode(input_ids=[[4, 5], [6]]))

    *singles, pair = asyncio.run(run())
    for text, out in zip(TEXTS, singles):
        assert_close(out, reference(hf, hf[1](text).input_ids))
    assert_close(pair[0], reference(hf, [4, 5]))
    assert_close(pair[1], reference(hf, [6]))
    assert_no_leak(llm)


def test_encode_is_refused_on_a_generation_engine():
    with running_engine(model_path("tiny-qwen2"), max_total_tokens=256) as gen:
        with pytest.raises(ValueError, match="--is-embedding"):
            gen.encode("hello")


def _mean_pooling_copy(tmp_path, matryoshka: bool) -> str:
    """The tiny embedding checkpoint with its sentence-transformers pooling switched to mean tokens."""
    src = model_path("tiny-qwen3-embed")
    dst = tmp_path / "mean-embed"
    shutil.copytree(src, dst)
    cfg_file = dst / "1_Pooling" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(pooling_mode_lasttoken=False, pooling_mode_mean_tokens=True)
    cfg_file.write_text(json.dumps(cfg))
    if not matryoshka:
        model_cfg = json.loads((dst / "config.json").read_text())
        model_cfg.pop("is_matryoshka")
        (dst / "config.json").write_text(json.dumps(model_cfg))
    return str(dst)


def test_mean_pooling_runs_without_prefix_cache_and_matches_transformers(tmp_path, hf):
    path = _mean_pooling_copy(tmp_path, matryoshka=False)
    assert pooling_of(path) is Pooling.MEAN
    with running_engine(path, is_embedding=True, page_size=4, chunked_prefill_size=16) as llm:
        assert llm.args.disable_radix_cache  # every token's state is needed: no cache hit may skip one
        batch = [long_ids(45, 5), long_ids(6, 6), hf[1](TEXTS[2]).input_ids]
        for _ in range(2):
            outs = llm.encode(input_ids=batch)
            for ids, out in zip(batch, outs):
                assert out["meta_info"]["cached_tokens"] == 0
                assert_close(out, reference(hf, ids, Pooling.MEAN))
        with pytest.raises(ValueError, match="matryoshka"):
            llm.encode("hello", dimensions=8)
