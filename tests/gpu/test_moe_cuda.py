"""Mixture-of-experts models on CUDA: `--moe-runner-backend auto` picks kernels.moe's grouped GEMMs there, decode runs
in CUDA graphs (padded rows included), and the tiny Qwen3-MoE stays token-exact with transformers in float32
(logprobs within 1e-3); the expert counters count each request's tokens, never a graph's padding rows. Batch-1 decode
runs kernels.moe_decode's few-token path: in the engine, and at the Qwen3-30B-A3B layer shape in a CUDA graph. A tiny
OLMoE, GLM-4.5, MiniMax-M2, dots.llm1 and ERNIE 4.5 MoE run the same kernels under their own attention (and their
routing)."""

from __future__ import annotations

import pytest

from radixmesh.engine.models.moe import SparseMoeBlock
from tests.conftest import model_path
from tests.engine_utils import assert_no_leak, greedy_like_transformers, parity_prompts, running_engine
from tests.reference import hf_greedy, hf_token_logprobs

pytestmark = pytest.mark.gpu
MAX_NEW = 12


def test_qwen3_moe_in_cuda_graphs_matches_transformers_and_counts_only_real_tokens():
    path = model_path("tiny-qwen3-moe")
    prompts = parity_prompts(path)[:3]  # a batch of 3 replays the graph of 4: one padding row
    with running_engine(path, device="cuda", dtype="float32", skip_tokenizer_init=True, disable_radix_cache=True,
                        enable_expert_distribution_metrics=True) as llm:
        assert llm.args.moe_runner_backend == "triton" and llm.runner.graphs is not None
        outs = greedy_like_transformers(llm, path, prompts, MAX_NEW)
        # the last token is sampled, never forwarded
        forwarded = sum(len(p) + len(o["output_ids"]) - 1 for p, o in zip(prompts, outs))
        dist = llm.expert_distribution()
        assert all(sum(row) == 2 * forwarded for row in dist["tokens"]), dist  # top_k 2, no padding row counted
        assert_no_leak(llm)


def test_batch_one_decode_on_the_few_token_path_in_cuda_graphs_matches_transformers():
    """One request at a time: every decode step replays the graph of batch 1, whose experts run kernels.moe_decode
    (two of four experts: use_decode_path) after kernels.moe_gate (norm, router and routing in one launch), the
    prefill kernels.moe's grouped GEMMs; token-exact with transformers in float32, logprobs within 1e-3, expert counts
    exact."""
    from radixmesh.kernels.moe_decode import use_decode_path

    path = model_path("tiny-qwen3-moe")
    prompts = parity_prompts(path)[1:3]
    assert use_decode_path(1, 2, 4) and not use_decode_path(2, 2, 4)
    refs = hf_greedy(path, prompts, MAX_NEW)
    # overlap scheduling off: a request stopping on EOS would forward the EOS too, a token `forwarded` leaves out
    with running_engine(path, device="cuda", dtype="float32", skip_tokenizer_init=True, disable_radix_cache=True,
                        disable_overlap_schedule=True, enable_expert_distribution_metrics=True) as llm:
        assert llm.runner.graphs is not None
        outs = [llm.generate(input_ids=p, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0},
                             return_logprob=True) for p in prompts]
        assert [o["output_ids"] for o in outs] == refs
        for p, out, ref in zip(prompts, outs, refs):
            got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
            assert got == pytest.approx(hf_token_logprobs(path, p, ref), abs=1e-3)
        forwarded = sum(len(p) + len(o["output_ids"]) - 1 for p, o in zip(prompts, outs))
        dist = llm.expert_distribution()
        assert all(sum(row) == 2 * forwarded for row in dist["tokens"]), dist
        # every sparse layer's post-attention norm, router and routing ran as kernels.moe_gate (its counter exists
        # once it has, and is back at zero after each launch)
        blocks = [m for m in llm.runner.model.modules() if isinstance(m, SparseMoeBlock)]
        assert blocks and all(b.gate_counter is not None and int(b.gate_counter.item()) == 0 for b in blocks)
        assert_no_leak(llm)


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_the_few_token_path_at_the_qwen3_30b_a3b_layer_shape_in_a_cuda_graph(tokens):
    """128 experts of hidden 2048 and intermediate 768, top-8, bf16, the default tiles (and programmatic dependent
    launch where the GPU has it): captured once, replayed with other tokens and routes written into the same tensors;
    each replay equals the eager call bit for bit and the twin and the grouped GEMMs within bf16 rounding."""
    import torch

    from radixmesh.kernels.moe import fused_experts, route_reference
    from radixmesh.kernels.moe_decode import decode_experts, decode_experts_reference

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    dt, experts, hidden, inter, top_k = torch.bfloat16, 128, 2048, 768, 8
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen, dtype=dt) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", generator=gen, dtype=dt) * inter ** -0.5

    def inputs():
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dt)
        return (x, *route_reference(torch.randn(tokens, experts, device="cuda", generator=gen), top_k, True, dt))

    x, weights, ids = inputs()
    decode_experts(x, w13, w2, weights, ids)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_experts(x, w13, w2, weights, ids)
    for _ in range(2):
        for dst, src in zip((x, weights, ids), inputs()):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, decode_experts(x, w13, w2, weights, ids))
        want = decode_experts_reference(x, w13, w2, weights, ids)
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
        grouped = fused_experts(x, w13, w2, weights, ids, elsewhere=False, decode_path=False)
        torch.testing.assert_close(out.float(), grouped.float(), rtol=2e-2, atol=2e-2)


def test_olmoe_in_cuda_graphs_matches_transformers(tmp_path):
    """A tiny OLMoE (whole-projection q/k norms, clip_qkv) written by transformers, in CUDA graphs on the grouped
    GEMMs and the few-token path (batch 3 and batch 1): token-exact in float32, logprobs within 1e-3."""
    _family_in_cuda_graphs_like_transformers("olmoe_clipped", tmp_path)


def test_qwen2_moe_in_cuda_graphs_matches_transformers(tmp_path):
    """A tiny Qwen2-MoE: its shared expert, gated by the sigmoid of its own one-row product, joined to the routed
    experts in kernels.moe_shared's one launch; as the OLMoE test above."""
    _family_in_cuda_graphs_like_transformers("qwen2_moe", tmp_path)


@pytest.mark.parametrize("name", ["glm4_moe", "minimax_m2", "dots1", "ernie4_5_moe"])
def test_bias_routed_families_in_cuda_graphs_match_transformers(tmp_path, name):
    """A tiny GLM-4.5 (group-limited sigmoid routing in kernels.moe.route_grouped, a shared expert, q/k/v biases,
    half-rotary heads), a tiny MiniMax-M2 (sigmoid routing with the block's bias, whole-projection q/k norms), a
    tiny dots.llm1 (four groups, two chosen; a sliding last layer) and a tiny ERNIE 4.5 MoE (softmax scores with a
    bias, interleaved RoPE in float32), as the OLMoE test above."""
    _family_in_cuda_graphs_like_transformers(name, tmp_path)


def _family_in_cuda_graphs_like_transformers(name: str, tmp_path) -> None:
    from tests.parity.test_moe_parity import PROMPTS, write_family

    path = write_family(name, tmp_path)
    refs = hf_greedy(path, PROMPTS, MAX_NEW)
    with running_engine(path, device="cuda", dtype="float32", skip_tokenizer_init=True) as llm:
        assert llm.args.moe_runner_backend == "triton" and llm.runner.graphs is not None
        for batch in (PROMPTS, PROMPTS[:1]):
            outs = llm.generate(input_ids=batch, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0},
                                return_logprob=True)
            assert [o["output_ids"] for o in outs] == refs[:len(batch)]
            for p, out, ref in zip(batch, outs, refs):
                got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
                assert got == pytest.approx(hf_token_logprobs(path, p, ref), abs=1e-3)
        assert_no_leak(llm)
