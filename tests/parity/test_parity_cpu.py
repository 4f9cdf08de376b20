"""Token-exact greedy parity with transformers (float32, CPU) for every tiny model, across cache, chunking and
paging configurations, concurrent async arrival, and a KV pool small enough to force eviction and retraction.

The tiny models' greedy choice depends on the last few tokens only (scripts/make_tiny_models.py builds them so
that it never sits near a tie), so the tests also compare every generated token's logprob with transformers: a
wrong key or value anywhere in a long cached prefix moves those far beyond the 1e-4 tolerance."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.conftest import TINY_MODELS, model_path
from tests.engine_utils import parity_prompts, running_engine
from tests.reference import hf_greedy, hf_token_logprobs

# 8 new tokens: decode still crosses a 16-token page's end for most prompts (11, 29, 57, 125, 160 and 300 tokens),
# after each configuration's prefill (where the configurations differ); later steps are more of the same
MAX_NEW = 8
POOL_MAX_NEW = 32  # the small pool's requests grow past what it holds (at 16 tokens none is retracted)
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}
POOL_GREEDY = {"max_new_tokens": POOL_MAX_NEW, "temperature": 0}
CONFIGS = [
    dict(disable_radix_cache=not radix, chunked_prefill_size=chunk, page_size=page)
    for radix, chunk, page in itertools.product([True, False], [64, -1], [1, 16])
]
_refs: dict[str, list[list[int]]] = {}
_ref_logprobs: dict[str, list[list[float]]] = {}
LOGPROB_ATOL = 1e-4


def reference(name: str, max_new: int = MAX_NEW) -> tuple[str, list[list[int]], list[list[int]]]:
    """The prompts and transformers' greedy outputs of at most `max_new` tokens: the first `max_new` of its
    POOL_MAX_NEW-token outputs (greedy: a longer run begins with the shorter one), generated once per model."""
    path = model_path(name)
    prompts = parity_prompts(path)
    if name not in _refs:
        _refs[name] = hf_greedy(path, prompts, POOL_MAX_NEW)
    return path, prompts, [r[:max_new] for r in _refs[name]]


def test_reference_is_not_degenerate():
    for name in TINY_MODELS:
        _, _, refs = reference(name, POOL_MAX_NEW)
        assert sum(len(r) for r in refs) >= 0.75 * POOL_MAX_NEW * len(refs), f"{name}: reference stops too early"
        assert len({tuple(r) for r in refs}) >= len(refs) - 2, f"{name}: outputs do not depend on the prompt"
        _, _, short = reference(name)
        assert len({tuple(r) for r in short}) >= len(short) - 2, f"{name}: outputs do not depend on the prompt"


def assert_logprobs_match(name: str, outs: list[dict]) -> None:
    """Each output's token logprobs against transformers' teacher-forced ones (of the POOL_MAX_NEW-token reference,
    as many as the output has: its ids equal the reference's first ones)."""
    path, prompts, refs = reference(name, POOL_MAX_NEW)
    if name not in _ref_logprobs:
        _ref_logprobs[name] = [hf_token_logprobs(path, p, r) for p, r in zip(prompts, refs)]
    for out, want in zip(outs, _ref_logprobs[name]):
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want[:len(got)], abs=LOGPROB_ATOL)


@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_batch_parity(name, cfg):
    path, prompts, refs = reference(name)
    with running_engine(path, **cfg) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        assert [o["output_ids"] for o in outs] == refs
        assert_logprobs_match(name, outs)
        # A second pass over the same prompts reuses cached prefixes (when the cache is on) with equal outputs.
        again = llm.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        assert [o["output_ids"] for o in again] == refs
        assert_logprobs_match(name, again)
        cached = [o["meta_info"]["cached_tokens"] for o in again]
        if cfg["disable_radix_cache"]:
            assert cached == [0] * len(prompts)
        else:
            page = cfg["page_size"]
            assert all(c >= (len(p) - 1) // page * page - page for c, p in zip(cached, prompts)), cached


@pytest.mark.parametrize("name", TINY_MODELS)
def test_concurrent_async_parity(name):
    path, prompts, refs = reference(name)

    async def main(llm):
        tasks = [llm.async_generate(input_ids=p, sampling_params=GREEDY, return_logprob=True) for p in prompts]
        return await asyncio.gather(*tasks)

    with running_engine(path, page_size=16, chunked_prefill_size=64, enable_mixed_chunk=True) as llm:
        outs = asyncio.run(main(llm))
        assert [o["output_ids"] for o in outs] == refs
        assert_logprobs_match(name, outs)
        assert llm.get_server_info()["internal_states"][0]["forward_extend"] >= 1


@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.parametrize("page", [1, 16])
def test_small_pool_evicts_and_retracts(name, page):
    path, prompts, refs = reference(name, POOL_MAX_NEW)
    with running_engine(path, page_size=page, max_total_tokens=384, chunked_prefill_size=64,
                        schedule_conservativeness=0.05) as llm:
        warm = llm.generate(input_ids=prompts[:4], sampling_params=POOL_GREEDY)  # leaves cached prefixes to evict
        assert [o["output_ids"] for o in warm] == refs[:4]
        outs = llm.generate(input_ids=prompts, sampling_params=POOL_GREEDY, return_logprob=True)
        assert [o["output_ids"] for o in outs] == refs
        assert_logprobs_match(name, outs)
        stats = llm.get_server_info()["internal_states"][0]
        assert stats["retractions"] > 0, stats
        assert stats["evicted_tokens"] > 0, stats
