"""Mixture-of-experts models on CUDA: `--moe-runner-backend auto` picks kernels.moe's grouped GEMMs there, decode runs
in CUDA graphs (padded rows included), and the tiny Qwen3-MoE stays token-exact with transformers in float32
(logprobs within 1e-3); the expert counters count each request's tokens, never a graph's padding rows."""

from __future__ import annotations

import pytest

from tests.conftest import model_path
from tests.engine_utils import assert_no_leak, parity_prompts, running_engine
from tests.reference import hf_greedy, hf_token_logprobs

pytestmark = pytest.mark.gpu
MAX_NEW = 12


def test_qwen3_moe_in_cuda_graphs_matches_transformers_and_counts_only_real_tokens():
    path = model_path("tiny-qwen3-moe")
    prompts = parity_prompts(path)[:3]  # a batch of 3 replays the graph of 4: one padding row
    refs = hf_greedy(path, prompts, MAX_NEW)
    with running_engine(path, device="cuda", dtype="float32", skip_tokenizer_init=True, disable_radix_cache=True,
                        enable_expert_distribution_metrics=True) as llm:
        assert llm.args.moe_runner_backend == "triton" and llm.runner.graphs is not None
        outs = llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0},
                            return_logprob=True)
        assert [o["output_ids"] for o in outs] == refs
        for p, out, ref in zip(prompts, outs, refs):
            got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
            assert got == pytest.approx(hf_token_logprobs(path, p, ref), abs=1e-3)
        # the last token is sampled, never forwarded
        forwarded = sum(len(p) + len(o["output_ids"]) - 1 for p, o in zip(prompts, outs))
        dist = llm.expert_distribution()
        assert all(sum(row) == 2 * forwarded for row in dist["tokens"]), dist  # top_k 2, no padding row counted
        assert_no_leak(llm)
