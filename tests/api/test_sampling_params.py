"""Sampling parameters end to end through the Engine: each one changes the output exactly as a reference
computed from transformers' logits says, seeds are batch-independent, and the sampled distribution is right."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from radixmesh.engine.request import Req
from radixmesh.engine.sampling.params import SamplingParams
from tests.conftest import DIFFUSE_VOCAB, model_path
from tests.engine_utils import parity_prompts, running_engine
from tests.reference import hf_greedy, hf_model
from tests.unit.test_sampling import reference_adjust

PROMPT_LEN = 40


def prompt(seed: int = 11) -> list[int]:
    return torch.randint(0, DIFFUSE_VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def reference_greedy(path: str, ids: list[int], params: dict, stop_ids=frozenset()) -> list[int]:
    """Greedy decoding with the plain reference of penalties / bias / min_new_tokens on transformers' logits."""
    sp = SamplingParams.from_dict(params)
    req = Req(rid="ref", input_ids=list(ids), sampling=sp, stop_ids=frozenset(stop_ids), sink=lambda o: None)
    for _ in range(sp.max_new_tokens):
        logits = hf_model(path)(torch.tensor([req.fill_ids])).logits[0, -1].float().tolist()
        row = torch.tensor(reference_adjust_wide(logits, req))
        tok = int(row.argmax())
        req.output_ids.append(tok)
        if tok in stop_ids and len(req.output_ids) >= sp.min_new_tokens:
            break
    return req.output_ids


def reference_adjust_wide(row: list[float], req: Req) -> list[float]:
    import tests.unit.test_sampling as ref

    old, ref.VOCAB = ref.VOCAB, len(row)
    try:
        return reference_adjust(row, req)
    finally:
        ref.VOCAB = old


@pytest.mark.parametrize("params", [
    {"repetition_penalty": 1.8},
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0},
    {"frequency_penalty": -0.5, "repetition_penalty": 0.7},
    {"logit_bias": {"17": 40.0, "99": -3.0}},  # this model's logits span tens of units
])
def test_penalties_and_bias_match_the_reference(diffuse_model, params):
    full = {"max_new_tokens": 20, "temperature": 0, **params}
    ids = prompt()
    want = reference_greedy(diffuse_model, ids, full)
    with running_engine(diffuse_model, skip_tokenizer_init=True) as llm:
        outs = llm.generate(input_ids=[ids, prompt(3), ids], sampling_params=[full, {"max_new_tokens": 5}, full])
        plain = llm.generate(input_ids=ids, sampling_params={"max_new_tokens": 20, "temperature": 0})
    assert outs[0]["output_ids"] == want and outs[2]["output_ids"] == want
    assert want != plain["output_ids"], "the parameter had no effect on this prompt"


def test_min_new_tokens_suppresses_stop_tokens(diffuse_model):
    ids = prompt()
    with running_engine(diffuse_model, skip_tokenizer_init=True) as llm:
        base = llm.generate(input_ids=ids, sampling_params={"max_new_tokens": 12, "temperature": 0})["output_ids"]
        stop = base[1]
        early = llm.generate(input_ids=ids, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                              "stop_token_ids": [stop]})
        held = llm.generate(input_ids=ids, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                             "stop_token_ids": [stop], "min_new_tokens": 6})
    assert early["output_ids"] == base[:2]
    assert len(held["output_ids"]) >= 6 and stop not in held["output_ids"][:6]
    assert held["output_ids"] == reference_greedy(diffuse_model, ids, {"max_new_tokens": 12, "temperature": 0,
                                                                       "min_new_tokens": 6}, stop_ids={stop})


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_filters_that_keep_one_token_equal_greedy(params):
    path = model_path("tiny-qwen3")
    prompts = parity_prompts(path)[:5]
    with running_engine(path) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": 16, "temperature": 1.0, **params})
    assert [o["output_ids"] for o in outs] == hf_greedy(path, prompts, 16)


def test_sampling_seed_is_independent_of_the_batch(diffuse_model):
    seeded = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.95, "sampling_seed": 77}
    others = [prompt(100 + i)[: 5 + 3 * i] for i in range(16)]
    with running_engine(diffuse_model, skip_tokenizer_init=True, random_seed=1) as llm:
        alone = llm.generate(input_ids=prompt(), sampling_params=seeded)["output_ids"]
        mixed = llm.generate(input_ids=others + [prompt()],
                             sampling_params=[{"max_new_tokens": 16, "temperature": 1.0}] * 16 + [seeded])
        other_seed = llm.generate(input_ids=prompt(), sampling_params={**seeded, "sampling_seed": 78})["output_ids"]
    with running_engine(diffuse_model, skip_tokenizer_init=True, random_seed=999) as llm:
        fresh = llm.generate(input_ids=prompt(), sampling_params=seeded)["output_ids"]
    assert mixed[-1]["output_ids"] == alone == fresh
    assert other_seed != alone


def test_first_token_distribution_matches_analytic(broad_model):
    """temperature 0.7, top_p 0.9: 2000 draws of the first token against the exact filtered distribution."""
    n, ids = 2000, prompt()
    with torch.inference_mode():
        logits = hf_model(broad_model)(torch.tensor([ids])).logits[0, -1].float()
    probs = torch.softmax(logits / 0.7, dim=-1)
    sorted_p, order = probs.sort(descending=True)
    keep = (sorted_p.cumsum(0) - sorted_p) <= 0.9
    expected = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    expected /= expected.sum()
    with running_engine(broad_model, skip_tokenizer_init=True, random_seed=5) as llm:
        outs = llm.generate(input_ids=[ids] * n, sampling_params={"max_new_tokens": 1, "temperature": 0.7,
                                                                  "top_p": 0.9})
    counts = torch.bincount(torch.tensor([o["output_ids"][0] for o in outs]), minlength=len(probs)).double()
    assert counts[expected == 0].sum() == 0, "sampled a token outside the top-p set"
    exp_counts = expected.double() * n
    big = exp_counts >= 5  # pool the rare tokens into one bin so every expected count is >= 5
    rare = ~big & (expected > 0)
    obs = torch.cat([counts[big], counts[rare].sum()[None]]) if rare.any() else counts[big]
    exp = torch.cat([exp_counts[big], exp_counts[rare].sum()[None]]) if rare.any() else exp_counts[big]
    assert len(obs) > 5, "the distribution is too peaked for a meaningful test"
    exp *= obs.sum() / exp.sum()  # float rounding only: both sum to n
    result = chisquare(obs.numpy(), exp.numpy())
    assert result.pvalue > 0.001, (result, obs.tolist(), exp.tolist())


@pytest.mark.parametrize("use_async", [False, True])
def test_n_samples_share_one_prefill(diffuse_model, use_async):
    import asyncio

    ids = prompt(21) * 3  # 120 tokens
    params = {"max_new_tokens": 8, "temperature": 1.0, "n": 4}
    with running_engine(diffuse_model, skip_tokenizer_init=True) as llm:
        before = llm.get_server_info()["internal_states"][0]["prefill_tokens"]
        if use_async:
            outs = asyncio.run(llm.async_generate(input_ids=ids, sampling_params=params))
        else:
            outs = llm.generate(input_ids=ids, sampling_params=params)
        prefilled = llm.get_server_info()["internal_states"][0]["prefill_tokens"] - before
        pair = llm.generate(input_ids=[ids[:50], ids[50:]], sampling_params={**params, "n": 2, "sampling_seed": 3})
    assert isinstance(outs, list) and len(outs) == 4
    assert all(len(o["output_ids"]) == 8 for o in outs)
    assert len({tuple(o["output_ids"]) for o in outs}) > 1, "the samples should differ"
    assert prefilled == len(ids) + 4, prefilled  # the prompt once, then each sample's last prompt token
    assert all(o["meta_info"]["cached_tokens"] == len(ids) - 1 for o in outs)
    assert len(pair) == 4 and pair[0]["output_ids"] != pair[1]["output_ids"]


@pytest.mark.parametrize("mode", ["model", "openai"])
def test_generation_config_supplies_default_sampling_params(tmp_path, mode):
    import json
    import shutil

    dst = tmp_path / "tiny-qwen3"
    shutil.copytree(model_path("tiny-qwen3"), dst)
    gen = json.loads((dst / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0, "top_k": 1}))
    prompts = parity_prompts(str(dst))[:3]
    with running_engine(str(dst), sampling_defaults=mode, random_seed=4) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": 12})
        explicit = llm.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 12, "temperature": 1.0,
                                                                      "top_k": -1})
    greedy = hf_greedy(model_path("tiny-qwen3"), prompts, 12)
    if mode == "model":  # the file's temperature 0 applies; an explicit value still wins
        assert [o["output_ids"] for o in outs] == greedy
        assert explicit["output_ids"] != greedy[0]
    else:
        assert [o["output_ids"] for o in outs] != greedy


def test_seeded_draw_ignores_other_rows_filters(diffuse_model):
    """A seeded request without top-k/top-p/min-p samples the same tokens whether or not a request that filters shares
    its batch (regression: a filtering row used to put the whole batch's draw in sorted-probability order)."""
    seeded = {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 5}
    filtering = {"max_new_tokens": 16, "temperature": 1.0, "top_k": 20, "top_p": 0.9}
    with running_engine(diffuse_model, skip_tokenizer_init=True) as llm:
        alone = llm.generate(input_ids=prompt(), sampling_params=seeded)["output_ids"]
        mixed = llm.generate(input_ids=[prompt(3), prompt()], sampling_params=[filtering, seeded])
    assert mixed[1]["output_ids"] == alone
