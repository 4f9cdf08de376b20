"""kernels.fp8_gemv_norm, the one-row fp8 product with the residual add and RMSNorm before it in one launch, against
its twin (the reference add-and-norm, then the reference product) and against the two kernels it stands for:
per-channel and block-wise scales, ragged N and K (K not a power of two), with and without the residual, bias, and
bad input refused (a residual_out aliasing an input would race with the programs still reading it)."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.quantization.fp8 import quantize
from radixmesh.kernels.fp8_gemv import fp8_gemv_row, fp8_linear_reference
from radixmesh.kernels.fp8_gemv_norm import fp8_gemv_row_norm
from radixmesh.kernels.norm import fused_add_rmsnorm, fused_add_rmsnorm_reference, rmsnorm_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def _case(n: int, k: int, block, dtype, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn((1, k), generator=g) * 3).to(DEVICE, dtype)
    d = torch.randn((1, k), generator=g).to(DEVICE, dtype)
    norm = (1 + torch.rand((k,), generator=g)).to(DEVICE, dtype)
    q, scale = quantize(torch.randn((n, k), generator=g) / k ** 0.5, block)
    scale = scale.reshape(n) if block is None else scale
    b = torch.randn((n,), generator=g).to(DEVICE, dtype) if bias else None
    return h, d, norm, q.to(DEVICE), scale.to(DEVICE), b


def _tol(dtype):  # float32 sums in another order (and rstd's last bits); a 16-bit output may round to a neighbour
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,k,block,config,residual", [(40, 200, None, (2, 4), True), (96, 256, (32, 64), None, True),
                                                       (70, 300, (16, 128), (4, 4), True),
                                                       (17, 1030, None, (8, 8), False),
                                                       (64, 384, (32, 128), (2, 2), False)])
def test_fp8_gemv_row_norm_matches_its_twin(n, k, block, config, residual, dtype):
    h, d, norm, q, s, b = _case(n, k, block, dtype, bias=n % 2 == 0, seed=n + k)
    y, summed = fp8_gemv_row_norm(h, d if residual else None, norm, EPS, q, s, block, b, config=config)
    if residual:
        x, want_summed = fused_add_rmsnorm_reference(h, d, norm, EPS)
        assert torch.equal(summed, want_summed)  # the residual sum, rounded to h's dtype, bit for bit
    else:
        x = rmsnorm_reference(h, norm, EPS)
        assert summed is None
    assert y.shape == (1, n) and y.dtype == dtype
    torch.testing.assert_close(y, fp8_linear_reference(x, q, s, block, b), **_tol(dtype))


@pytest.mark.parametrize("block", [None, (32, 64)], ids=["channel", "block"])
def test_fp8_gemv_row_norm_matches_the_two_kernels_it_stands_for(block):
    h, d, norm, q, s, _ = _case(48, 512, block, torch.bfloat16, bias=False, seed=7)
    x, summed = fused_add_rmsnorm(h, d, norm, EPS)
    want = fp8_gemv_row(x, q, s, block)
    y, got_summed = fp8_gemv_row_norm(h, d, norm, EPS, q, s, block)
    assert torch.equal(got_summed, summed)
    torch.testing.assert_close(y, want, **_tol(torch.bfloat16))


def test_fp8_gemv_row_norm_refuses_bad_input():
    h, d, norm, q, s, _ = _case(32, 128, None, torch.float32, bias=False, seed=1)
    with pytest.raises(ValueError, match="must not alias"):
        fp8_gemv_row_norm(h, d, norm, EPS, q, s, None, residual_out=d)
    with pytest.raises(ValueError, match="norm weight"):
        fp8_gemv_row_norm(h, d, norm[:64].contiguous(), EPS, q, s, None)
    with pytest.raises(ValueError, match="norm weight"):
        fp8_gemv_row_norm(h, d, norm.to(torch.bfloat16), EPS, q, s, None)
    with pytest.raises(ValueError, match="residual"):
        fp8_gemv_row_norm(h, d[:, :64].contiguous(), norm, EPS, q, s, None)
    with pytest.raises(ValueError, match="x \\[m <= 1"):
        fp8_gemv_row_norm(torch.cat([h, h]), None, norm, EPS, q, s, None)
