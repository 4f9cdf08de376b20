"""kernels.fp8_gemv, the decode products reading fp8 weights (W8A16: x in its own dtype, the scales applied in the
kernel), against their plain-torch twin: per-channel and block-wise scales, ragged N and K (partial blocks, partial
chunks), one row (fp8_gemv_row, CUDA cores; also with each thread's products summed in groups first) and up to 16
(fp8_gemv, tensor cores), bias, bad input refused."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.quantization.fp8 import quantize
from radixmesh.kernels.fp8_gemv import fp8_gemv, fp8_gemv_row, fp8_linear_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _case(m: int, n: int, k: int, block, dtype, bias: bool):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn((m, k), generator=g).to(DEVICE, dtype)
    q, scale = quantize(torch.randn((n, k), generator=g) / k ** 0.5, block)
    scale = scale.reshape(n) if block is None else scale
    b = torch.randn((n,), generator=g).to(DEVICE, dtype) if bias else None
    return x, q.to(DEVICE), scale.to(DEVICE), b


def _tol(dtype):  # float32 sums in another order; a 16-bit output may round to the twin's neighbour
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("n,k,block,config", [(40, 200, None, (2, 64, 4)), (96, 256, (32, 64), None),
                                              (70, 300, (16, 128), (4, 256, 4)), (17, 1030, None, (8, 1024, 4)),
                                              (256, 384, (128, 128), None),
                                              # each thread's products summed 16 (or 8) at a time first
                                              (40, 200, None, (2, 64, 4, 16)), (70, 300, (16, 128), (4, 256, 4, 16)),
                                              (17, 1030, None, (8, 1024, 4, 16)), (96, 256, (32, 64), (2, 128, 2, 8))])
def test_fp8_gemv_row_matches_its_twin(n, k, block, config, dtype):
    x, q, s, b = _case(1, n, k, block, dtype, bias=n % 2 == 0)
    got = fp8_gemv_row(x, q, s, block, b, config=config)
    assert got.shape == (1, n) and got.dtype == dtype
    torch.testing.assert_close(got, fp8_linear_reference(x, q, s, block, b), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("m,n,k,block", [(2, 40, 200, None), (16, 96, 256, (32, 64)), (5, 70, 300, (16, 128)),
                                         (8, 33, 1030, None), (3, 256, 384, (128, 128))])
def test_fp8_gemv_matches_its_twin(m, n, k, block, dtype):
    x, q, s, b = _case(m, n, k, block, dtype, bias=m % 2 == 1)
    got = fp8_gemv(x, q, s, block, b)
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got, fp8_linear_reference(x, q, s, block, b), **_tol(dtype))


def test_fp8_decode_products_refuse_bad_input():
    x, q, s, _ = _case(2, 64, 128, (32, 64), torch.float32, bias=False)
    with pytest.raises(ValueError, match="x \\[m <= 1"):
        fp8_gemv_row(x, q, s, (32, 64))
    with pytest.raises(ValueError, match="GROUP is a power of two"):
        fp8_gemv_row(x[:1], q, s, (32, 64), config=(2, 128, 4, 12))
    with pytest.raises(ValueError, match="float32 scales \\(2, 2\\)"):
        fp8_gemv(x, q, s[:, :1].contiguous(), (32, 64))
    with pytest.raises(ValueError, match="contiguous fp8 weight"):
        fp8_gemv(x, q.float(), s, (32, 64))
    with pytest.raises(ValueError, match="power-of-two blocks"):
        fp8_gemv(x, q, torch.ones((2, 3), device=DEVICE), (32, 48))
