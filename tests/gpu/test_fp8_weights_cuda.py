"""fp8 weights on CUDA (issue 52): the kernels compiled at the 8B shape's projections against their twins (the
per-token / per-token-group activation quantization bit for bit, the W8A16 decode products, the block-scaled GEMM,
torch._scaled_mm's row-wise path and its Triton fallback), the one-row product under programmatic dependent launch in
a CUDA graph equal to its eager launch, and the engine with `--fp8-gemm-backend auto` holding a block-wise
checkpoint's projections in fp8, in CUDA graphs, token-exact with the dequantized twin (float32). Mixture-of-experts
layers: kernels.moe_fp8 at Qwen3-30B-A3B's expert shape against its twin, in a CUDA graph equal to its eager call, its
few-token path (kernels.moe_decode_fp8) the same way, and the engine holding tiny-qwen3-moe's fp8 experts in fp8, in
CUDA graphs, token-exact with the checkpoint served dequantized."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.quantization import fp8
from radixmesh.engine.quantization.fp8_linear import Fp8Weights, fp8_linear
from radixmesh.kernels.fp8_gemm import fp8_gemm, fp8_gemm_reference
from radixmesh.kernels.fp8_gemv import fp8_gemv, fp8_gemv_row, fp8_linear_reference
from radixmesh.kernels.fp8_quant import group_quant, group_quant_reference
from tests.conftest import model_path
from tests.cuda_graphs import assert_pdl_graph_equals_eager
from tests.engine_utils import parity_prompts, running_engine
from tests.reference import hf_greedy, hf_token_logprobs

pytestmark = pytest.mark.gpu
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate/up, down of Llama-3.1-8B
BF16 = {"rtol": 1.6e-2, "atol": 1e-2}


def _weight(n: int, k: int, block, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, s = fp8.quantize(torch.randn((n, k), generator=g) / k ** 0.5, block)
    return q.cuda(), (s.reshape(n) if block is None else s).cuda()


@pytest.mark.parametrize("group", [128, None])
def test_activation_quantization_is_bit_exact_with_its_twin(group):
    x = (torch.randn((300, 4096), device="cuda") * 3).to(torch.bfloat16)
    q, s = group_quant(x, group)
    want_q, want_s = group_quant_reference(x, group)
    assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "channel"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_decode_products_at_the_8b_shape(n, k, block):
    w, s = _weight(n, k, block)
    for m in (1, 4, 16):
        x = torch.randn((m, k), device="cuda", dtype=torch.bfloat16)
        got = (fp8_gemv_row if m == 1 else fp8_gemv)(x, w, s, block)
        torch.testing.assert_close(got, fp8_linear_reference(x, w, s, block), **BF16)


@pytest.mark.parametrize("n,k", SHAPES)
def test_prefill_products_at_the_8b_shape(n, k):
    x = torch.randn((300, k), device="cuda", dtype=torch.bfloat16)
    for block in ((128, 128), None):
        w, s = _weight(n, k, block)
        a, a_s = group_quant(x, block[1] if block else None)
        want = fp8_gemm_reference(a, a_s, w, s, block, torch.bfloat16)
        torch.testing.assert_close(fp8_gemm(a, a_s, w, s, block, torch.bfloat16), want, **BF16)
        # fp8_linear: the block GEMM, or torch._scaled_mm (per-channel, bfloat16) and its Triton fallback (float16)
        got = fp8_linear(x, w, s, Fp8Weights(block, scaled_mm=True))
        torch.testing.assert_close(got, want, **BF16)
        half = fp8_linear(x.half(), w, s, Fp8Weights(block, scaled_mm=True))
        torch.testing.assert_close(half.float(), want.float(), **BF16)


@pytest.mark.parametrize("n,k", SHAPES)
def test_every_candidate_block_gemm_tile_at_the_8b_shape(n, k):
    """kernels.fp8_gemm.CANDIDATES, every bucket's tiles (what benchmarks.tune_fp8_gemm may keep) at the bucket's
    rows, block-wise 128 x 128, bfloat16: each matches the twin."""
    from radixmesh.kernels.fp8_gemm import CANDIDATES

    w, s = _weight(n, k, (128, 128))
    for rows, tiles in CANDIDATES.items():
        a, a_s = group_quant(torch.randn((rows - 3, k), device="cuda", dtype=torch.bfloat16), 128)  # (ragged M)
        want = fp8_gemm_reference(a, a_s, w, s, (128, 128), torch.bfloat16)
        for config in tiles:
            torch.testing.assert_close(fp8_gemm(a, a_s, w, s, (128, 128), torch.bfloat16, config=config), want,
                                       **BF16)


def test_the_tuner_writes_tiles_the_products_then_run_with(tmp_path, monkeypatch):
    """benchmarks.tune_fp8_gemm on a small block-wise shape: one entry a row bucket, each a candidate of its bucket
    no slower than MARGIN of the default where it is not the default; the file it writes is what kernels.fp8_gemm
    reads for this GPU, and a product of that shape then runs with the tuned tiles (the twin's result)."""
    import json
    import sys

    from radixmesh.benchmarks import tune_fp8_gemm
    from radixmesh.kernels import fp8_gemm as gemm

    monkeypatch.setattr(sys, "argv", ["tune", "--shapes", "512,1024", "--out", str(tmp_path)])
    tune_fp8_gemm.main()
    path = gemm.config_path(torch.cuda.get_device_name(), tmp_path)
    entries = json.loads(path.read_text())["shapes"]["512,1024,128,128"]
    assert set(entries) == {str(b) for b in gemm.BUCKETS}
    for bucket, entry in entries.items():
        tiles = tuple(entry["tiles"])
        assert tiles in gemm.CANDIDATES[int(bucket)]
        assert tiles == gemm.CANDIDATES[int(bucket)][0] or entry["ms"] <= tune_fp8_gemm.MARGIN * entry["default_ms"]
    monkeypatch.setattr(gemm, "CONFIG_DIR", tmp_path)
    gemm.tuned_tiles.cache_clear()
    try:
        tuned = gemm.tuned_tiles(torch.cuda.current_device())
        assert tuned[(512, 1024, 128, 128, 256)] == tuple(entries["256"]["tiles"])
        w, s = _weight(512, 1024, (128, 128))
        a, a_s = group_quant(torch.randn((200, 1024), device="cuda", dtype=torch.bfloat16), 128)
        torch.testing.assert_close(gemm.fp8_gemm(a, a_s, w, s, (128, 128), torch.bfloat16),
                                   fp8_gemm_reference(a, a_s, w, s, (128, 128), torch.bfloat16), **BF16)
    finally:
        gemm.tuned_tiles.cache_clear()


def test_the_one_row_product_under_pdl_in_a_graph_equals_its_eager_launch():
    from radixmesh.kernels.runtime import pdl_supported

    if not pdl_supported():
        pytest.skip("programmatic dependent launch needs Hopper or later")
    chain = [_weight(n, k, (128, 128), seed=i) for i, (n, k) in enumerate([(4096, 4096), (14336, 4096),
                                                                          (4096, 14336)])]
    x = torch.randn((1, 4096), device="cuda", dtype=torch.bfloat16)

    def run(pdl: bool) -> torch.Tensor:
        y = x
        for w, s in chain:
            y = fp8_gemv_row(y, w, s, (128, 128), pdl=pdl) / 8
        return y

    assert_pdl_graph_equals_eager(run)


@pytest.mark.parametrize("how", [{"block": (32, 64)}, {"modelopt": "file"}], ids=["block", "modelopt"])
def test_the_engine_holds_fp8_weights_in_fp8_and_matches_the_twin_in_cuda_graphs(tmp_path, how):
    """Block-wise fp8, and NVIDIA ModelOpt's per-tensor layout (hf_quant_config.json) held per row."""
    q = fp8.write_checkpoint(model_path("tiny-llama"), str(tmp_path / "fp8"), **how)
    twin = fp8.dequantized_checkpoint(q, str(tmp_path / "twin"))
    prompts = parity_prompts(q)[:3]  # short prompts prefilled in 16-row chunks: every product is W8A16
    refs = hf_greedy(twin, prompts, 12)
    with running_engine(q, device="cuda", dtype="float32", skip_tokenizer_init=True, chunked_prefill_size=16,
                        fp8_gemm_backend="triton") as llm:
        held = [m for m in llm.runner.model.modules() if getattr(m, "fp8", None) is not None]
        assert len(held) == 16 and all(m.weight.dtype == torch.float8_e4m3fn for m in held)
        assert llm.runner.graphs is not None
        outs = llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": 12, "temperature": 0},
                            return_logprob=True)
    assert [o["output_ids"] for o in outs] == refs
    for p, out, ref in zip(prompts, outs, refs):
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(hf_token_logprobs(twin, p, ref), abs=1e-3)


def test_online_fp8_in_bfloat16_runs_scaled_mm_prefills_and_stays_near_the_model():
    """--quantization fp8 in bfloat16 on long prompts (prefill on torch._scaled_mm, decode on fp8_gemv_row in
    graphs): the first greedy token of each prompt agrees with the unquantized bfloat16 engine's for most prompts."""
    path = model_path("tiny-llama")
    prompts = parity_prompts(path)
    sp = {"max_new_tokens": 1, "temperature": 0}
    with running_engine(path, device="cuda", dtype="bfloat16", skip_tokenizer_init=True, quantization="fp8",
                        fp8_gemm_backend="triton") as llm:
        assert any(getattr(m, "fp8", None) is not None and m.fp8.scaled_mm for m in llm.runner.model.modules())
        fp8_first = [o["output_ids"][0] for o in llm.generate(input_ids=prompts, sampling_params=sp)]
    with running_engine(path, device="cuda", dtype="bfloat16", skip_tokenizer_init=True) as llm:
        plain_first = [o["output_ids"][0] for o in llm.generate(input_ids=prompts, sampling_params=sp)]
    assert sum(a == b for a, b in zip(fp8_first, plain_first)) >= len(prompts) - 2, (fp8_first, plain_first)


MOE = (128, 2048, 768, 8)  # Qwen3-30B-A3B's experts: how many, hidden, moe_intermediate_size, top-k


def _fp8_experts(experts: int, n: int, k: int, block, gen: torch.Generator):
    """Random fp8 codes [experts, n, k] over most of e4m3's range, with scales making the weights ~ k^-0.5."""
    from radixmesh.kernels.fp8_experts import scale_shape

    w = (torch.randn((experts, n, k), device="cuda", generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = (0.5 + torch.rand(scale_shape(w, block), device="cuda", generator=gen)) * k ** -0.5 / 64
    return w, s


@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "channel"])
def test_fp8_experts_at_the_qwen3_30b_a3b_shape_match_the_twin_eager_and_in_a_graph(block):
    """kernels.moe_fp8 in bfloat16 at 1, 8 and 300 tokens against its twin (within bfloat16 rounding: the twin adds
    the top-k rows one at a time in bfloat16); at 8 tokens captured in a CUDA graph, replayed with other tokens and
    routes written into the same tensors, each replay equal to the eager call bit for bit."""
    from radixmesh.kernels.moe import route_reference
    from radixmesh.kernels.moe_fp8 import fused_experts_fp8, fused_experts_fp8_reference

    experts, hidden, inter, top_k = MOE
    gen = torch.Generator(device="cuda").manual_seed(0)
    fp8_experts = (*_fp8_experts(experts, 2 * inter, hidden, block, gen), *_fp8_experts(experts, hidden, inter,
                                                                                         block, gen), block)

    def inputs(tokens: int):
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        logits = torch.randn(tokens, experts, device="cuda", generator=gen)
        return (x, *route_reference(logits, top_k, True, torch.bfloat16))

    for tokens in (1, 8, 300):
        x, weights, ids = inputs(tokens)
        got = fused_experts_fp8(x, *fp8_experts, weights, ids, elsewhere=False, decode_path=False)  # grouped at 1 too
        want = fused_experts_fp8_reference(x, *fp8_experts, weights, ids)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    x, weights, ids = inputs(8)
    fused_experts_fp8(x, *fp8_experts, weights, ids, elsewhere=False)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts_fp8(x, *fp8_experts, weights, ids, elsewhere=False)
    for _ in range(2):
        for dst, src in zip((x, weights, ids), inputs(8)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused_experts_fp8(x, *fp8_experts, weights, ids, elsewhere=False))


@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "channel"])
def test_fp8_few_token_experts_at_the_qwen3_30b_a3b_shape_match_the_twin_eager_and_in_a_graph(block):
    """kernels.moe_decode_fp8 (W8A16) in bfloat16 at 1, 2 and 4 tokens (the counts fused_experts_fp8 sends it at 128
    experts, top-8) against its twin: the same roundings, so nearly every element equal; captured at 1 and 4 tokens
    under programmatic dependent launch, replayed with other tokens and routes (an expert of another rank among
    them), each replay equal to the eager call bit for bit."""
    from radixmesh.kernels.moe import route_reference
    from radixmesh.kernels.moe_decode import use_decode_path
    from radixmesh.kernels.moe_decode_fp8 import decode_experts_fp8_reference
    from radixmesh.kernels.moe_fp8 import fused_experts_fp8

    experts, hidden, inter, top_k = MOE
    gen = torch.Generator(device="cuda").manual_seed(1)
    fp8_experts = (*_fp8_experts(experts, 2 * inter, hidden, block, gen), *_fp8_experts(experts, hidden, inter,
                                                                                         block, gen), block)

    def inputs(tokens: int):
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        weights, ids = route_reference(torch.randn(tokens, experts, device="cuda", generator=gen), top_k, True,
                                       torch.bfloat16)
        ids[0, -1] = -1  # another rank's expert: adds nothing
        return x, weights, ids

    for tokens in (1, 2, 4):
        assert use_decode_path(tokens, top_k, experts)
        x, weights, ids = inputs(tokens)
        got = fused_experts_fp8(x, *fp8_experts, weights, ids)
        want = decode_experts_fp8_reference(x, *fp8_experts, weights, ids)
        torch.testing.assert_close(got.float(), want.float(), **BF16)
        assert (got != want).float().mean().item() <= 0.05
    for tokens in (1, 4):
        x, weights, ids = inputs(tokens)
        fused_experts_fp8(x, *fp8_experts, weights, ids)  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_experts_fp8(x, *fp8_experts, weights, ids)
        for _ in range(2):
            for dst, src in zip((x, weights, ids), inputs(tokens)):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, fused_experts_fp8(x, *fp8_experts, weights, ids))


@pytest.mark.parametrize("kind,batch", [("block", 3), ("channel", 3), ("block", 1)])
def test_the_engine_holds_moe_experts_in_fp8_in_cuda_graphs(tmp_path, kind, batch):
    """tiny-qwen3-moe's fp8 checkpoint (blocks of 32 x 128, or per channel) with --fp8-gemm-backend triton: every
    layer's experts held in fp8 and run by kernels.moe_fp8 (--moe-runner-backend auto: triton) in CUDA graphs,
    token-exact with the same checkpoint served dequantized (float32); logprobs within 1e-2 block-wise (the experts'
    activations in fp8 in the grouped GEMMs), 1e-3 per channel (the same products). One prompt: every decode step's
    experts take the few-token path (kernels.moe_decode_fp8) in the graphs."""
    from radixmesh.engine.layers.moe import FusedMoE

    q = fp8.write_checkpoint(model_path("tiny-qwen3-moe"), str(tmp_path / "fp8"),
                             **({"block": (32, 128)} if kind == "block" else {}))
    # the twin is a checkpoint of its own: on an fp8 GPU `auto` holds the fp8 one in fp8 too
    twin = fp8.dequantized_checkpoint(q, str(tmp_path / "twin"))
    prompts = parity_prompts(q)[:batch]
    sp = {"max_new_tokens": 12, "temperature": 0}

    def serve(path: str, dtype: torch.dtype) -> list[dict]:
        with running_engine(path, device="cuda", dtype="float32", skip_tokenizer_init=True, chunked_prefill_size=16,
                            fp8_gemm_backend="triton") as llm:
            experts = [m for m in llm.runner.model.modules() if isinstance(m, FusedMoE)]
            assert len(experts) == 3 and llm.runner.graphs is not None
            assert {p.weight.dtype for m in experts for p in (m.w13, m.w2)} == {dtype}
            return llm.generate(input_ids=prompts, sampling_params=sp, return_logprob=True, top_logprobs_num=2)

    outs, refs = serve(q, torch.float8_e4m3fn), serve(twin, torch.float32)
    for i, (out, ref) in enumerate(zip(outs, refs)):  # where they part: the step, both tokens, the twin's top-2 gap
        got, want = out["output_ids"], ref["output_ids"]
        at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        tops = ref["meta_info"]["output_top_logprobs"]
        assert got == want, (f"prompt {i}: fp8 experts {got} against the dequantized twin {want}; first apart at step "
                             f"{at}, where the twin's top two logprobs were {tops[at] if at is not None else None}")
    for out, ref in zip(outs, refs):
        got, want = ([lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in (out, ref))
        assert got == pytest.approx(want, abs=1e-2 if kind == "block" else 1e-3)
