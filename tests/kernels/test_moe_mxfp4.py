"""Experts held in MXFP4 (kernels.moe_mxfp4): the few-token launches and the grouped GEMMs over the 4-bit codes
against kernels.moe over the same experts dequantized (every MXFP4 value is exact in bf16: the products differ only in
their summation order), with GPT-OSS's biases and clamped SwiGLU, another rank's experts (ids of -1) and the
layout's checks. In Triton's interpreter without CUDA, on the GPU with it."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.quantization.mxfp4 import dequantize, quantize
from radixmesh.kernels.moe import fused_experts, fused_experts_reference, route_reference
from radixmesh.kernels.moe_extras import ExpertExtras
from radixmesh.kernels.moe_mxfp4 import dequantize_experts, fused_experts_mxfp4, fused_experts_mxfp4_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks, scales = quantize(w)
    return blocks.reshape(*w.shape[:-1], w.shape[-1] // 2), scales


def _layer(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    q13, s13 = _mxfp4(torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5)
    q2, s2 = _mxfp4(torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5)
    weights, ids = route_reference(torch.randn(tokens, experts, generator=gen), top_k, True, dtype)
    extras = ExpertExtras((0.3 * torch.randn(experts, 2 * inter, generator=gen)).to(dtype),
                          (0.3 * torch.randn(experts, hidden, generator=gen)).to(dtype), 1.702, 0.6)
    return x, (q13, s13, q2, s2), weights, ids, extras


def _on(extras: ExpertExtras) -> ExpertExtras:
    return ExpertExtras(extras.b13.to(DEVICE), extras.b2.to(DEVICE), extras.swiglu_alpha, extras.swiglu_limit)


@pytest.mark.parametrize("tokens, decode_path", [(1, True), (3, True), (40, False)], ids=["one", "few", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_mxfp4_experts_equal_their_dequantized_twin(tokens, decode_path, dtype):
    x, mx, weights, ids, extras = _layer(tokens, 8, 2, 64, 96, dtype, seed=tokens)
    ids[0, 1] = -1  # another rank's expert: adds nothing
    on = [t.to(DEVICE) for t in (x, *mx, weights, ids)]
    got = fused_experts_mxfp4(*on, decode_path=decode_path, extras=_on(extras)).cpu()
    w13, w2 = dequantize_experts(mx[0], mx[1], dtype), dequantize_experts(mx[2], mx[3], dtype)
    want = fused_experts(*[t.to(DEVICE) for t in (x, w13, w2, weights, ids)], decode_path=decode_path,
                         extras=_on(extras)).cpu()
    twin = fused_experts_mxfp4_reference(x, *mx, weights, ids, extras)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got.float(), twin.float(), rtol=max(tol, 1e-4), atol=max(tol, 1e-4))
    assert torch.equal(twin, fused_experts_reference(x, w13, w2, weights, ids, extras))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["decoded", "scaled-product"])
def test_every_code_and_scale_decodes_as_the_checkpoint_reader_does(dtype):
    """All 256 bytes (both nibbles of each) under scales from 2^-27 to 2^33, read by the grouped GEMM against one-hot
    activation rows: each output is one decoded weight, equal to the checkpoint reader's
    (engine.quantization.mxfp4.dequantize) bit for bit; float32 rows through the kernel's own decoding, bfloat16 ones
    through Triton's microscaled product (every value is exact in bfloat16)."""
    from radixmesh.kernels.moe import BLOCK_M, Tiles, align_by_expert
    from radixmesh.kernels.moe_mxfp4 import _grouped, scaled

    q = (torch.arange(16 * 32) % 256).to(torch.uint8).reshape(1, 16, 32)  # 16 rows of 64 weights
    s = (100 + torch.arange(32) * 2).to(torch.uint8).reshape(1, 16, 2)
    a = torch.eye(64, dtype=dtype)  # 64 tokens, token k one-hot at input k
    assert scaled(a) == (dtype == torch.bfloat16)
    ids = torch.zeros(64, 1, dtype=torch.int64)
    slots, blocks = align_by_expert(ids.to(DEVICE), 1, BLOCK_M)
    got = _grouped(a.to(DEVICE), q.to(DEVICE), s.to(DEVICE), slots, blocks, 64, 1, None, True, BLOCK_M,
                   Tiles(block_n=16, block_k=64)).cpu()  # [64 tokens, 16 rows]: got[k, n] = w[n, k]
    assert torch.equal(got.t(), dequantize_experts(q, s, dtype)[0])
    assert torch.equal(got.t(), dequantize(q.reshape(1, 16, 2, 16), s, dtype)[0])  # the loader's reader


def test_the_layout_is_checked():
    x, (q13, s13, q2, s2), weights, ids, _ = _layer(2, 4, 2, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="MXFP4 experts are q13"):
        fused_experts_mxfp4(x, q13, s13[:, :, :1], q2, s2, weights, ids)
    with pytest.raises(ValueError, match="MXFP4 experts are q13"):
        fused_experts_mxfp4(x, q13.to(torch.int16), s13, q2, s2, weights, ids)
