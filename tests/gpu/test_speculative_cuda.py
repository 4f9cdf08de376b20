"""Speculative decoding on CUDA, every attention backend: a verify forward (an EXTEND of the newest token and its
drafts over the request's KV) gives the greedy tokens plain decoding gives, with NGRAM drafts kept whole, in part
and not at all (the oracle drafter of tests/parity/test_speculative.py), with a STANDALONE draft model (the target
drafting for itself), pages of 1 and 16 tokens, shared prefixes; steps without drafts still run in CUDA graphs, and
nothing leaks."""

from __future__ import annotations

import pytest

from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine
from tests.parity.test_speculative import use_oracle

pytestmark = pytest.mark.gpu
GREEDY = {"max_new_tokens": 24, "temperature": 0}


@pytest.mark.parametrize("backend,page", [("flashinfer", 16), ("triton", 1), ("triton", 16), ("torch_native", 4)])
def test_verify_forwards_on_cuda_decode_as_plain_steps(backend, page):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    path = model_path("tiny-llama")
    prompts = parity_prompts(path)[3:7]
    common = dict(device="cuda", page_size=page, attention_backend=backend, skip_tokenizer_init=True,
                  max_total_tokens=8192)
    with running_engine(path, **common) as plain:
        want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=GREEDY)]
    with running_engine(path, **common, speculative_algorithm="NGRAM", speculative_num_draft_tokens=6) as llm:
        assert llm.runner.graphs is not None or backend == "torch_native"
        use_oracle(llm, {tuple(p): w for p, w in zip(prompts, want)})
        got = llm.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in got] == want
    assert sum(o["meta_info"]["spec_accept_token_num"] for o in got) > 0


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_a_standalone_draft_model_on_cuda_keeps_greedy_outputs(backend):
    """The target drafting for itself (its KV pool mirrored slot for slot by the draft's): drafts kept nearly
    whole, outputs as plain decoding's."""
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    path = model_path("tiny-llama")
    prompts = parity_prompts(path)[3:7]
    common = dict(device="cuda", page_size=16, attention_backend=backend, skip_tokenizer_init=True,
                  max_total_tokens=8192)
    with running_engine(path, **common) as plain:
        want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=GREEDY)]
    with running_engine(path, **common, speculative_algorithm="STANDALONE", speculative_draft_model_path=path,
                        speculative_num_steps=4) as llm:
        assert llm.draft_runner.kv_pool.capacity_tokens == llm.runner.kv_pool.capacity_tokens
        got = llm.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in got] == want
    kept = sum(o["meta_info"]["spec_accept_token_num"] for o in got)
    assert kept > 0.8 * sum(o["meta_info"]["spec_draft_token_num"] for o in got)
