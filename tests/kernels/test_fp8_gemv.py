"""kernels.fp8_gemv, the decode products reading fp8 weights (W8A16: x in its own dtype, the scales applied in the
kernel), against their plain-torch twin: per-channel and block-wise scales, ragged N and K (partial blocks, partial
chunks), one row (fp8_gemv_row, CUDA cores) and up to 16 (fp8_gemv, tensor cores), bias, bad input refused."""

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
                                              (256, 384, (128, 128), None)])
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
    with pytest.raises(ValueError, match="float32 scales \\(2, 2\\)"):
        fp8_gemv(x, q, s[:, :1].contiguous(), (32, 64))
    with pytest.raises(ValueError, match="contiguous fp8 weight"):
        fp8_gemv(x, q.float(), s, (32, 64))
    with pytest.raises(ValueError, match="power-of-two blocks"):
        fp8_gemv(x, q, torch.ones((2, 3), device=DEVICE), (32, 48))


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX's prmt.b32 (default mode): byte d of the result is byte selector[4d+2:4d] of {b, a} (a's bytes 0-3, b's
    4-7), or that byte's top bit spread over all eight when bit 4d+3 is set."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for d in range(4):
        nibble = (selector >> (4 * d)) & 0xF
        byte = src[nibble & 7]
        out |= ((0xFF if byte & 0x80 else 0) if nibble & 8 else byte) << (8 * d)
    return out


def test_the_bit_conversions_arithmetic_gives_every_e4m3_code_times_two_to_the_minus_120():
    """kernels.fp8_gemv.e4m3_bits_f32's PTX, instruction by instruction in Python (its masks, shift and byte
    selectors), over all 256 codes four to a register: every non-NaN code, subnormals and -0 included, becomes exactly
    its value times 2^-120 as float32 bits. (The compiled instructions run on a GPU only:
    test_the_bit_conversion_equals_the_instructions_bit_for_bit_cuda.)"""
    import struct

    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    for first in range(0, 256, 4):
        word = sum((first + i) << (8 * i) for i in range(4))
        m, s = word & 0x7F7F7F7F, (word & 0x80808080) >> 4
        for i, selector in enumerate((0x4088, 0x5188, 0x6288, 0x7388)):
            bits = (_prmt(m, s, selector) << 4) & 0xFFFFFFFF
            got = struct.unpack("<f", struct.pack("<I", bits))[0] * 2.0 ** 120
            want = values[first + i]
            assert got == want or want != want, (first + i, got, want)  # (NaN codes: 0x7f, 0xff)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,block", [(4096, 14336, None), (6144, 4096, (128, 128)), (96, 256, (32, 64))])
def test_the_bit_conversion_equals_the_instructions_bit_for_bit_cuda(n, k, block, monkeypatch):
    """The one-row product with RADIXMESH_FP8_BITS's conversion gives the conversion instructions' output bit for
    bit (the same products and sums, scaled by exact powers of two), per row and block-wise, in bfloat16 and
    float32."""
    from radixmesh.kernels import fp8_gemv as module

    for dtype in (torch.bfloat16, torch.float32):
        x, q, s, b = _case(1, n, k, block, dtype, bias=True)
        monkeypatch.setattr(module, "BITS_CONVERT", False)
        want = fp8_gemv_row(x, q, s, block, b)
        monkeypatch.setattr(module, "BITS_CONVERT", True)
        got = fp8_gemv_row(x, q, s, block, b)
        assert torch.equal(got, want)
        torch.testing.assert_close(got, fp8_linear_reference(x, q, s, block, b), **_tol(dtype))
