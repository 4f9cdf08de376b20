"""Draft trees (speculative_eagle_topk > 1) under tensor parallelism on CPU (gloo): the leader drafts the tree and
verifies it; every rank runs the verify forward under the tree mask (it travels with the step's batch,
batch.ForwardBatch.packed), and every rank moves the kept path's KV into place in its own heads' shard (the leader
journals the copy: model_runner.ModelRunner.mirror_kv_copy).

With the oracle head of tests/parity/test_speculative_tree (the right token ranked second), kept paths run through
second-ranked children, so nearly every verify moves KV: a rank that did not move its shard would read the rejected
nodes' KV at the next verify and the tokens would leave transformers'. TP=2 gives transformers' greedy tokens, from
a cold cache and again from the prefix cache, at pages of 1 and 4, keeps the drafts one process keeps, and scores
every token as one process does (a rank without the tree mask changes the scores first)."""

from __future__ import annotations

import pytest

from tests.conftest import model_path
from tests.engine_utils import parity_prompts
from tests.parity.test_speculative_tree import Oracle, tree_engine, write_head_once
from tests.reference import hf_greedy

pytestmark = pytest.mark.timeout(300)
NAME = "tiny-llama"
NEW = 16


def _oracle_run(llm, prompts, refs) -> tuple[list[list[int]], list[float], int, int]:
    """(outputs of the prompts asked twice: cold, then from the prefix cache; their tokens' logprobs; accepted
    drafts; verify rows)."""
    Oracle(llm.scheduler.spec.model.runner, [p + r for p, r in zip(prompts, refs)], 1000)
    sampling = {"temperature": 0, "max_new_tokens": NEW}
    outs = [o for _ in range(2) for o in llm.generate(input_ids=prompts, sampling_params=sampling,
                                                        return_logprob=True)]
    stats = llm.scheduler.load()
    logprobs = [lp for o in outs for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
    return [o["output_ids"] for o in outs], logprobs, stats["spec_accepted_tokens"], stats["spec_verify_rows"]


@pytest.mark.parametrize("page", [1, 4])
def test_tp2_trees_keep_second_ranked_paths_token_exact(page, tmp_path_factory):
    path = model_path(NAME)
    heads = {"EAGLE": write_head_once(path, tmp_path_factory)}
    prompts = parity_prompts(path)[:3]
    refs = hf_greedy(path, prompts, NEW)
    runs = {}
    for tp in (2, 1):
        with tree_engine(path, heads, "EAGLE", 2, 3, 11, page_size=page, tp_size=tp) as llm:
            assert llm.runner.tp.size == tp
            runs[tp] = _oracle_run(llm, prompts, refs)
    outs, logprobs, accepted, rows = runs[2]
    assert outs == refs * 2
    # more than one draft kept per verify, where a chain keeps none (the oracle ranks the right token second): paths
    # through second-ranked children, their KV moved on both ranks (without the followers' copy, these tokens
    # leave transformers' from the first moved verify on; at 8 new tokens they did not yet)
    assert accepted > rows
    assert runs[2][::2] == runs[1][::2] and runs[2][3] == runs[1][3]  # the same trees kept as one process
    # and the same scores: every rank attends under the tree mask (a rank that let each node see its earlier
    # siblings moved half of them, by up to 0.03, though the tiny model's greedy tokens held)
    assert logprobs == pytest.approx(runs[1][1], abs=1e-4)
