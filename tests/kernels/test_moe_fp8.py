"""kernels.moe_fp8, the mixture-of-experts grouped GEMMs on fp8 experts, against their plain-torch twin: per-row
scales (W8A16) and block-wise scales (activations quantized per token and group, 128 x 128 blocks and narrower ones
with partial blocks along N and K), float32 and bfloat16, experts no token picks, other ranks' experts (ids of -1);
and the outputs near the 16-bit experts' (kernels.moe's twin on the dequantized weights). In Triton's interpreter
without CUDA, on the GPU with it."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.quantization.fp8 import dequantize, quantize
from radixmesh.kernels.moe import fused_experts_reference, route_reference
from radixmesh.kernels.moe_fp8 import fused_experts_fp8, fused_experts_fp8_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _stack(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Experts' float32 weights [experts, N, K] -> (fp8 codes, float32 scales, the dequantized weights)."""
    parts = [quantize(e, block) for e in w]
    q = torch.stack([p[0] for p in parts])
    s = torch.stack([p[1].reshape(-1) if block is None else p[1] for p in parts])
    return q, s, torch.stack([dequantize(p[0], p[1], block) for p in parts])


def _operands(tokens: int, experts: int, top_k: int, hidden: int, inter: int, block, dtype, used: int | None = None):
    gen = torch.Generator().manual_seed(tokens * 100 + experts + hidden)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13, s13, d13 = _stack(torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5, block)
    w2, s2, d2 = _stack(torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5, block)
    logits = torch.randn(tokens, experts, generator=gen)
    if used is not None:  # only the first `used` experts can win: the others get no token
        logits[:, used:] = -1e4
    weights, ids = route_reference(logits, top_k, True, dtype)
    return x, (w13, s13, w2, s2), (d13.to(dtype), d2.to(dtype)), weights, ids


CASES = [(1, 4, 2, 128, 128, (128, 128), torch.float32), (9, 6, 3, 96, 64, (32, 64), torch.float32),
         (9, 6, 3, 96, 64, (32, 64), torch.bfloat16), (20, 4, 2, 64, 48, None, torch.float32),
         (3, 6, 3, 96, 160, None, torch.bfloat16)]  # (w13's 320 rows: two column tiles in the interpreter)


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,block,dtype", CASES,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v).rpartition(".")[2])
def test_fp8_experts_match_the_twin_and_stay_near_the_16_bit_experts(tokens, experts, top_k, hidden, inter, block,
                                                                      dtype):
    x, fp8, deq, weights, ids = _operands(tokens, experts, top_k, hidden, inter, block, dtype, used=experts - 1)
    want = fused_experts_fp8_reference(x, *fp8, block, weights, ids)
    got = fused_experts_fp8(*[t.to(DEVICE) for t in (x, *fp8)], block, weights.to(DEVICE), ids.to(DEVICE),
                            decode_path=False).cpu()  # the grouped GEMMs at one token too (not moe_decode_fp8's)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:  # float32 sums in another order; the activations' quantization is the twin's
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # the twin adds the top_k rows one at a time in bfloat16; the kernel sums them in float32
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    exact = fused_experts_reference(x.float(), deq[0].float(), deq[1].float(), weights.float(), ids)
    err = (got.float() - exact).abs().mean() / exact.abs().mean()
    assert err < (0.08 if block else 0.01 if dtype == torch.bfloat16 else 1e-6)  # W8A8: ~3% a GEMM; W8A16: exact


def test_per_row_scales_are_the_dequantized_weights_exactly():
    """W8A16 in float32: the same products as kernels.moe's twin on the dequantized weights."""
    x, fp8, deq, weights, ids = _operands(7, 4, 2, 64, 32, None, torch.float32)
    got = fused_experts_fp8(*[t.to(DEVICE) for t in (x, *fp8)], None, weights.to(DEVICE), ids.to(DEVICE)).cpu()
    torch.testing.assert_close(got, fused_experts_reference(x, *deq, weights, ids), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block", [(32, 64), None], ids=["block", "channel"])
def test_slots_of_another_ranks_experts_add_nothing(block):
    """Expert parallelism: ids of -1 (experts another rank holds) are skipped by the kernels and the twin."""
    x, fp8, _, weights, ids = _operands(10, 6, 2, 64, 32, block, torch.float32)
    fp8 = tuple(t[3:] for t in fp8)  # this rank holds experts 3..5
    local = torch.where(ids >= 3, ids - 3, -1)
    want = fused_experts_fp8_reference(x, *fp8, block, weights, local)
    got = fused_experts_fp8(*[t.to(DEVICE) for t in (x, *fp8)], block, weights.to(DEVICE), local.to(DEVICE)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (want[(local < 0).all(dim=1)] == 0).all() and (want != 0).any()


def test_fp8_experts_refuse_what_they_cannot_compute():
    x, (w13, s13, w2, s2), _, weights, ids = _operands(4, 4, 2, 64, 32, (32, 64), torch.float32)
    with pytest.raises(ValueError, match="float32 scales"):
        fused_experts_fp8(x, w13, s13[:, :1], w2, s2, (32, 64), weights, ids)
    with pytest.raises(ValueError, match="fp8 experts take"):
        fused_experts_fp8(x, w13.float(), s13, w2, s2, (32, 64), weights, ids)
    with pytest.raises(ValueError, match="power-of-two blocks"):
        fused_experts_fp8(x, w13, s13, w2, s2, (32, 16), weights, ids)
