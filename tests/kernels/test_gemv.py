"""The skinny decode product against its plain-torch twin: rows 1..16, odd sizes, bias; bf16 and fp16 (float32 stays
with cuBLAS). On CPU in Triton's interpreter; on CUDA also the Llama-3.1-8B projections."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv import gemv, gemv_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(m, n, k, dtype, device, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((m, k), generator=gen).to(dtype).to(device)
    w = (torch.randn((n, k), generator=gen) / k ** 0.5).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    got, want = gemv(x, w, b), gemv_reference(x, w, b)
    assert got.shape == want.shape and got.dtype == dtype
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err < (1e-2 if dtype == torch.bfloat16 else 2e-3), f"relative error {err:.2e}"


@pytest.mark.parametrize("m,n,k", [(1, 16, 64), (3, 100, 200), (16, 48, 1024), (2, 33, 96), (8, 130, 520)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_twin(m, n, k, dtype):
    _case(m, n, k, dtype, DEVICE, seed=m + n)


def test_bias_and_zero_rows():
    _case(4, 40, 128, torch.bfloat16, DEVICE, bias=True)
    x = torch.empty((0, 64), dtype=torch.bfloat16, device=DEVICE)
    assert gemv(x, torch.ones((8, 64), dtype=torch.bfloat16, device=DEVICE)).shape == (0, 8)


def test_rejects_what_it_cannot_do():
    w = torch.ones((8, 64), dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(torch.ones((17, 64), dtype=torch.bfloat16, device=DEVICE), w)
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(torch.ones((1, 64), dtype=torch.bfloat16, device=DEVICE), w.t().contiguous().t())


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)])
@pytest.mark.parametrize("m", [1, 8])
def test_llama8b_projections_cuda(m, n, k):
    _case(m, n, k, torch.bfloat16, "cuda", seed=n)
