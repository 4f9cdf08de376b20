"""The SiLU-and-mul inside a one-row gate/up product's launch (kernels.activation.row_block, store_row_block):
kernels.gemv.gemv_row, kernels.fp8_gemv.fp8_gemv_row and kernels.fp8_gemv_norm.fp8_gemv_row_norm with `gated=True`
against the two launches they stand for (the product, then kernels.activation.silu_and_mul), bit for bit, and against
the plain-torch twins; ragged sizes (a pair count no tile divides, K not a power of two), bias, and bad input refused."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.quantization.fp8 import quantize
from radixmesh.kernels.activation import silu_and_mul, silu_and_mul_reference
from radixmesh.kernels.fp8_gemv import fp8_gemv_row, fp8_linear_reference
from radixmesh.kernels.fp8_gemv_norm import fp8_gemv_row_norm
from radixmesh.kernels.gemv import gemv_reference, gemv_row
from radixmesh.kernels.norm import fused_add_rmsnorm_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def _x(k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((1, k), generator=g).to(DEVICE, dtype)


def _weight(inter: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn((2 * inter, k), generator=g) / k ** 0.5 * 2


def _tol(dtype):  # the twin sums in another order; a 16-bit activation may round to a neighbour and carry it
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("inter,k,config,bias", [(40, 96, (2, 64, 4), False), (37, 200, (8, 128, 4), True),
                                                 (64, 256, (4, 256, 8), False), (5, 72, (16, 64, 4), True)])
def test_gemv_row_gated_is_the_product_then_the_activation(inter, k, config, bias, dtype):
    x = _x(k, dtype, seed=inter + k)
    w = _weight(inter, k, seed=inter).to(DEVICE, dtype)
    b = torch.randn((2 * inter,), generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype) if bias else None
    got = gemv_row(x, w, b, config=config, gated=True)
    assert got.shape == (1, inter) and got.dtype == dtype
    assert torch.equal(got, silu_and_mul(gemv_row(x, w, b, config=config)))  # the two launches, bit for bit
    torch.testing.assert_close(got, silu_and_mul_reference(gemv_reference(x, w, b)), **_tol(dtype))
    out = torch.empty((1, inter), dtype=dtype, device=DEVICE)
    assert gemv_row(x, w, b, out=out, config=config, gated=True) is out and torch.equal(out, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("inter,k,config", [(40, 96, None), (37, 200, (4, 128, 4)), (48, 512, (2, 256, 4, 16))])
def test_fp8_gemv_row_gated_is_the_product_then_the_activation(inter, k, config, dtype):
    x = _x(k, dtype, seed=k)
    q, s = quantize(_weight(inter, k, seed=k), None)
    q, s = q.to(DEVICE), s.reshape(2 * inter).to(DEVICE)
    b = torch.randn((2 * inter,), generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    got = fp8_gemv_row(x, q, s, None, b, config=config, gated=True)
    assert got.shape == (1, inter) and got.dtype == dtype
    assert torch.equal(got, silu_and_mul(fp8_gemv_row(x, q, s, None, b, config=config)))
    torch.testing.assert_close(got, silu_and_mul_reference(fp8_linear_reference(x, q, s, None, b)), **_tol(dtype))


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "first-layer"])
def test_fp8_gemv_row_norm_gated_is_its_ungated_product_then_the_activation(residual):
    k, inter, dtype = 160, 24, torch.bfloat16
    g = torch.Generator().manual_seed(11)
    h = (torch.randn((1, k), generator=g) * 3).to(DEVICE, dtype)
    d = torch.randn((1, k), generator=g).to(DEVICE, dtype) if residual else None
    norm = (1 + torch.rand((k,), generator=g)).to(DEVICE, dtype)
    q, s = quantize(_weight(inter, k, seed=11), None)
    q, s = q.to(DEVICE), s.reshape(2 * inter).to(DEVICE)
    got, summed = fp8_gemv_row_norm(h, d, norm, EPS, q, s, None, config=(4, 4), gated=True)
    want, want_summed = fp8_gemv_row_norm(h, d, norm, EPS, q, s, None, config=(4, 4))
    assert got.shape == (1, inter) and torch.equal(got, silu_and_mul(want))
    if residual:
        assert torch.equal(summed, want_summed) and torch.equal(summed, fused_add_rmsnorm_reference(h, d, norm, EPS)[1])


def test_a_gated_product_refuses_what_it_cannot_pair():
    x = _x(64, torch.float32, seed=1)
    w = _weight(8, 64, seed=1).to(DEVICE)
    with pytest.raises(ValueError, match="gated one-row product"):
        gemv_row(x, w[:15].contiguous(), gated=True)  # an odd row count: no gate/up pairs
    with pytest.raises(ValueError, match="gated one-row product"):
        gemv_row(x, w, config=(1, 64, 4), gated=True)  # one row a program splits a pair
    with pytest.raises(ValueError, match="out must be \\[1, 8\\]"):
        gemv_row(x, w, out=torch.empty((1, 16), device=DEVICE), gated=True)
    q, s = quantize(w.cpu(), (8, 32))
    with pytest.raises(ValueError, match="per-row scales"):
        fp8_gemv_row(x, q.to(DEVICE), s.to(DEVICE), (8, 32), gated=True)  # gate and up rows in other block rows
    norm = torch.ones(64, device=DEVICE)
    with pytest.raises(ValueError, match="per-row scales"):
        fp8_gemv_row_norm(x, None, norm, EPS, q.to(DEVICE), s.to(DEVICE), (8, 32), gated=True)
