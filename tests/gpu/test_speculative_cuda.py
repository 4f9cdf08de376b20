"""Speculative decoding on CUDA, every attention backend. A verify forward is a decode batch of a fixed number of rows
per request (the newest token, its drafts, padding), in CUDA graphs: each position is computed alike whichever drafts
its step had, so a greedy request's tokens are the same with drafts kept whole, in part or not at all (the oracle
drafter of tests/parity/test_speculative.py against one that never drafts), bit for bit in float16; in float32 they
are also plain decoding's. A STANDALONE draft model (the target drafting for itself) runs its steps in graphs of its
own. Pages of 1 and 16 tokens; nothing leaks."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import model_path
from tests.engine_utils import assert_no_leak, parity_prompts, running_engine
from tests.parity.test_speculative import use_oracle

pytestmark = pytest.mark.gpu
GREEDY = {"max_new_tokens": 24, "temperature": 0}


class Never:
    def propose(self, tokens: list[int], k: int) -> list[int]:
        return []


def one_at_a_time(llm, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt alone (a batch of one throughout, so every verify has one shape)."""
    return [llm.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]


def drafted_as_undrafted(llm, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens with no drafts, then with an oracle's (mostly right, some wrong): the same, and
    drafts were kept. Returns the tokens."""
    llm.scheduler.spec.new_drafter = lambda req: Never()
    undrafted = one_at_a_time(llm, prompts)
    use_oracle(llm, {tuple(p): w for p, w in zip(prompts, undrafted)})
    got = [llm.generate(input_ids=p, sampling_params=GREEDY) for p in prompts]
    assert [o["output_ids"] for o in got] == undrafted
    assert sum(o["meta_info"]["spec_accept_token_num"] for o in got) > 0
    return undrafted


@pytest.mark.parametrize("backend,page,dtype", [("triton", 1, "float32"), ("triton", 16, "float16"),
                                                ("torch_native", 4, "float32")])
def test_verify_forwards_on_cuda_keep_greedy_outputs(backend, page, dtype):
    path = model_path("tiny-llama")
    prompts = parity_prompts(path)[3:7]
    common = dict(device="cuda", dtype=dtype, page_size=page, attention_backend=backend, skip_tokenizer_init=True,
                  max_total_tokens=8192)
    with running_engine(path, **common) as plain:
        plain_out = one_at_a_time(plain, prompts)
    with running_engine(path, **common, speculative_algorithm="NGRAM", speculative_num_draft_tokens=6) as llm:
        # verifies are decode batches of six rows per request: 4 requests at once replay graphs too
        assert llm.runner.graphs is not None and max(llm.runner.graphs.sizes) >= 24 or backend == "torch_native"
        undrafted = drafted_as_undrafted(llm, prompts)
        batched = llm.generate(input_ids=prompts, sampling_params=GREEDY)  # four at once: runs, keeps drafts
        assert sum(o["meta_info"]["spec_accept_token_num"] for o in batched) > 0
        assert_no_leak(llm)
    if dtype == "float32":
        assert undrafted == plain_out


def test_flashinfer_verifies_the_8b_shape_alike_whatever_was_drafted():
    """FlashInfer's decode kernels (their head sizes exclude the tiny models') on the Llama-3.1-8B shape in bfloat16,
    dummy weights: oracle drafts give the tokens no drafts give."""
    pytest.importorskip("flashinfer")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 120000, (n,), generator=gen).tolist() for n in (40, 300)]
    with running_engine("benchmarks/configs/llama-3.1-8b", device="cuda", load_format="dummy", dtype="bfloat16",
                        attention_backend="flashinfer", skip_tokenizer_init=True, max_running_requests=8,
                        context_length=1024, mem_fraction_static=0.5, speculative_algorithm="NGRAM",
                        speculative_num_draft_tokens=8) as llm:
        drafted_as_undrafted(llm, prompts)
        assert_no_leak(llm)


@pytest.mark.parametrize("backend", ["triton"])
def test_a_standalone_draft_model_on_cuda_keeps_greedy_outputs(backend):
    """The target drafting for itself (its KV pool mirrored slot for slot by the draft's): drafts kept nearly
    whole, outputs as with a draft model that is never right."""
    path = model_path("tiny-llama")
    prompts = parity_prompts(path)[3:7]
    common = dict(device="cuda", dtype="float16", page_size=16, attention_backend=backend, skip_tokenizer_init=True,
                  max_total_tokens=8192, speculative_algorithm="STANDALONE", speculative_num_steps=4)
    with running_engine(path, **common, speculative_draft_model_path=path) as llm:
        assert llm.draft_runner.kv_pool.capacity_tokens == llm.runner.kv_pool.capacity_tokens
        assert llm.draft_runner.graphs is not None  # the draft's one-token steps replay graphs
        got = [llm.generate(input_ids=p, sampling_params=GREEDY) for p in prompts]
        kept = sum(o["meta_info"]["spec_accept_token_num"] for o in got)
        assert kept > 0.8 * sum(o["meta_info"]["spec_draft_token_num"] for o in got)
        assert_no_leak(llm)
    with running_engine(path, **common, speculative_draft_model_path=path) as wrong:
        wrong.scheduler.spec.model.propose = lambda reqs, ks: ([[(7 + i) % 50] * k for i, k in enumerate(ks)], None)
        assert [wrong.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts] == \
            [o["output_ids"] for o in got]


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_eagle_heads_draft_alike_in_cuda_graphs_and_outside(algorithm, tmp_path):
    """An EAGLE head's one-token steps replay CUDA graphs (reading the previous step's output from a static buffer)
    and the target's verifies keep their hidden states from inside its graphs: every draft equals the one computed
    without graphs, and the outputs are the plain engine's (float32)."""
    from tests.parity.test_speculative_eagle import record_proposals, write_head

    path = model_path("tiny-llama")
    prompts = parity_prompts(path)[3:7]
    head = write_head(tmp_path / "head", path, algorithm.lower())
    common = dict(device="cuda", dtype="float32", page_size=4, attention_backend="triton", skip_tokenizer_init=True,
                  max_total_tokens=8192)
    with running_engine(path, **common) as plain:
        want = one_at_a_time(plain, prompts)
    runs = []
    for graphs in (True, False):
        with running_engine(path, **common, disable_cuda_graph=not graphs, speculative_algorithm=algorithm,
                            speculative_draft_model_path=head, speculative_num_steps=3) as llm:
            assert (llm.draft_runner.graphs is not None) == graphs and (llm.runner.graphs is not None) == graphs
            seen = record_proposals(llm)
            runs.append((one_at_a_time(llm, prompts), seen))
            assert_no_leak(llm)
    assert runs[0][0] == runs[1][0] == want
    assert runs[0][1] == runs[1][1] and len(runs[0][1]) > 10


def _check_tree_replays(runner) -> list[int]:
    """[replays of batches with a draft tree's mask] of `runner`'s graphs from now on, each replay's logits checked
    against the same batch run eagerly just before it (the same KV slots written with the same values; float32)."""
    count, replay = [0], runner.graphs.replay

    def checked(batch):
        if batch.tree_mask is None:
            return replay(batch)
        count[0] += 1
        batch.fill_pending()
        eager = runner.model.compute_logits(runner._hidden(batch)).clone()
        got = replay(batch)
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
        return got

    runner.graphs.replay = checked
    return count


@pytest.mark.parametrize("algorithm,topk,steps,n,page", [("EAGLE", 2, 3, 6, 4), ("EAGLE3", 4, 3, 12, 1)])
def test_draft_trees_replay_cuda_graphs_as_they_run_eagerly(algorithm, topk, steps, n, page, tmp_path):
    """Draft trees (speculative_eagle_topk > 1) in CUDA graphs: the head's tree steps and the target's tree verifies
    replay graphs whose static inputs hold the tree mask, each replay's logits those of the same batch run eagerly;
    every tree step and every drafted tree's verify replays; the outputs are the plain engine's (float32), one request
    at a time and four at once (padded graphs), with graphs and without; nothing leaks. (Whole trees are not compared
    between an engine with graphs and one without: on an H200, 2026-12-06, EAGLE-3's trees with K 4 parted at the 85th
    of a run, outputs unchanged; a random head's candidates score within rounding of each other, and the two engines'
    products need not round alike.)"""
    from tests.parity.test_speculative_eagle import write_head

    path = model_path("tiny-llama")
    prompts = parity_prompts(path)[3:7]
    head = write_head(tmp_path / "head", path, algorithm.lower())
    common = dict(device="cuda", dtype="float32", page_size=page, attention_backend="triton",
                  skip_tokenizer_init=True, max_total_tokens=8192)
    with running_engine(path, **common) as plain:
        want = one_at_a_time(plain, prompts)
    for graphs in (True, False):
        with running_engine(path, **common, disable_cuda_graph=not graphs, speculative_algorithm=algorithm,
                            speculative_draft_model_path=head, speculative_num_steps=steps,
                            speculative_eagle_topk=topk, speculative_num_draft_tokens=n) as llm:
            proposals, drafter = [0], llm.scheduler.spec.tree
            propose = drafter.propose

            def counting(reqs, _propose=propose, _proposals=proposals):
                _proposals[0] += bool(reqs)
                return _propose(reqs)

            drafter.propose = counting
            if graphs:
                assert llm.runner.graphs.tree and llm.draft_runner.graphs.tree
                assert max(llm.draft_runner.graphs.sizes) >= 4 * topk  # K rows per request
                verifies, steps_run = _check_tree_replays(llm.runner), _check_tree_replays(llm.draft_runner)
            assert one_at_a_time(llm, prompts) == want
            batched = [o["output_ids"] for o in llm.generate(input_ids=prompts, sampling_params=GREEDY)]
            assert batched == want
            assert_no_leak(llm)
            if graphs:  # every tree step replayed a graph, and every verify of a drafted tree (a request with no
                # room left to draft verifies an empty tree: more verifies than proposals)
                assert steps_run[0] == (steps - 1) * proposals[0] and verifies[0] >= proposals[0] > 20


def test_flashinfer_verifies_draft_trees_through_page_lists(tmp_path):
    """FlashInfer verifies draft trees (speculative_eagle_topk 2) through each row's page list, eagerly, and the
    head's tree steps likewise: Mistral with head size 64 (a FlashInfer size, no window) in bfloat16, an oracle head
    so paths through second-ranked children are kept. Every generated token's logprob (most from tree rows) stays
    within bfloat16 noise of transformers' float32 teacher-forced one, as Triton's tree verifies do: a row that saw a
    sibling's key or missed an ancestor's would be off by the context it lost. Nothing leaks."""
    pytest.importorskip("flashinfer")
    from tests.parity.test_speculative_eagle import write_head
    from tests.parity.test_speculative_tree import Oracle
    from tests.reference import hf_greedy
    from tests.sliding_models import VOCAB, assert_bf16_noise, build, prompts

    path = build("mistral", tmp_path / "mistral", head_dim=64, sliding_window=None)
    head = write_head(str(tmp_path / "head"), path, "eagle", seed=3)
    refs = hf_greedy(path, prompts(), 16)
    for backend in ("flashinfer", "triton"):
        with running_engine(path, device="cuda", dtype="bfloat16", attention_backend=backend, page_size=16,
                            skip_tokenizer_init=True, mem_fraction_static=0.3, speculative_algorithm="EAGLE",
                            speculative_draft_model_path=head, speculative_num_steps=3, speculative_eagle_topk=2,
                            speculative_num_draft_tokens=11) as llm:
            assert llm.runner.graphs is not None and llm.runner.graphs.tree == (backend == "triton")
            Oracle(llm.scheduler.spec.model.runner, [p + r for p, r in zip(prompts(), refs)], VOCAB)
            outs = llm.generate(input_ids=prompts(), sampling_params={**GREEDY, "max_new_tokens": 16},
                                return_logprob=True)
            stats = llm.scheduler.load()
            assert_no_leak(llm)
        # (refs are float32's: where bfloat16's greedy path leaves them, the oracle drafts wrong tokens)
        assert stats["spec_accepted_tokens"] > 0.5 * stats["spec_verify_rows"] > 0, (backend, stats)
        assert_bf16_noise(path, outs)
