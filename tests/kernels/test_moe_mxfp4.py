"""Experts held in MXFP4 (kernels.moe_mxfp4): the few-token launches and the grouped GEMMs over the 4-bit codes
against kernels.moe over the same experts dequantized (every MXFP4 value is exact in bf16: the products differ only in
their summation order), with GPT-OSS's biases and clamped SwiGLU, another rank's experts (ids of -1) and the
layout's checks. In Triton's interpreter without CUDA, on the GPU with it."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from radixmesh.engine.quantization.mxfp4 import dequantize, quantize
from radixmesh.kernels.moe import fused_experts, fused_experts_reference, route_reference
from radixmesh.kernels.moe_extras import ExpertExtras
from radixmesh.kernels.moe_mxfp4 import (_row_times_words, dequantize_experts, fused_experts_mxfp4,
                                         fused_experts_mxfp4_reference)

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


@pytest.mark.parametrize("tokens", [1, 3], ids=["one", "few"])
def test_the_word_products_equal_the_microscaled_ones(tokens):
    """The few-token launches on CUDA cores (ScaledTiles.words: the codes read as 32-bit words and widened by shifts
    and masks) against tl.dot_scaled's and the twin, with biases, the clamp and another rank's expert (-1), at the
    K widths of chunks that do and do not divide the row (hidden 96 = 12 words, inter 160 = 20), the chunks unrolled
    and in a loop."""
    from radixmesh.kernels.moe_mxfp4 import ScaledTiles, _decode

    x, mx, weights, ids, extras = _layer(tokens, 8, 2, 96, 160, torch.bfloat16, seed=10 + tokens)
    ids[0, 1] = -1
    on = [t.to(DEVICE) for t in (x, *mx, weights, ids)]
    dot = _decode(*on, _on(extras), ScaledTiles(32, 256, 64, 256, 4, 3, 0)).cpu()
    for words in (ScaledTiles(words=1), ScaledTiles(words=2), ScaledTiles(4, 64, 8, 64, 4, 1, 1),
                  ScaledTiles(4, 64, 8, 64, 4, 2, 1, loop=1)):
        got = _decode(*on, _on(extras), words).cpu()
        torch.testing.assert_close(got.float(), dot.float(), rtol=1e-2, atol=1e-2)
        twin = fused_experts_mxfp4_reference(x, *mx, weights, ids, extras)
        torch.testing.assert_close(got.float(), twin.float(), rtol=2e-2, atol=2e-2)


def test_how_many_pairs_take_the_few_token_launches_is_set_by_the_environment(monkeypatch):
    """RADIXMESH_MXFP4_TILES's max_pairs moves the limit between the few-token launches and the grouped GEMMs for
    bfloat16 rows (benchmarks.moe_decode --mxfp4 shows where it lies on a GPU); unset, kernels.moe_decode's rule or
    16 pairs, whichever allows more (gpt-oss-20b's 32 experts, top 4: 4 tokens; 128 experts: the rule's 8); float32
    rows keep the rule (2 tokens of 32 experts); a bad value is refused by name."""
    from radixmesh.kernels import moe_mxfp4

    taken = []
    monkeypatch.setattr(moe_mxfp4, "_decode", lambda x, *a: taken.append(x.shape[0]) or torch.zeros_like(x))
    monkeypatch.setattr(moe_mxfp4, "grouped_experts", lambda x, *a: taken.append(-x.shape[0]) or torch.zeros_like(x))

    def route(tokens: int, dtype=torch.bfloat16, experts: int = 32) -> list[int]:
        x, mx, weights, ids, _ = _layer(tokens, experts, 4, 64, 32, dtype)
        taken.clear()
        fused_experts_mxfp4(x, *mx, weights, ids)
        return taken

    assert route(4) == [4] and route(5) == [-5] and route(8, experts=128) == [8] and route(9, experts=128) == [-9]
    assert route(2, torch.float32) == [2] and route(3, torch.float32) == [-3]
    monkeypatch.setenv("RADIXMESH_MXFP4_TILES", '{"max_pairs": 8}')
    assert route(2) == [2] and route(3) == [-3] and route(3, torch.float32) == [-3]
    monkeypatch.setenv("RADIXMESH_MXFP4_TILES", '{"max_pairs": "many"}')
    with pytest.raises(ValueError, match="RADIXMESH_MXFP4_TILES"):
        route(1)


@triton.jit
def _words_rows_kernel(x_ptr, q_ptr, s_ptr, out_ptr, K: tl.constexpr, N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PTX: tl.constexpr, LOOP: tl.constexpr):
    k = tl.program_id(0)  # x row k: one-hot at input k, so out[k, n] = w[n, k]
    n = tl.arange(0, N)
    out = _row_times_words(x_ptr + k * K, q_ptr + n[:, None] * (K // 2), s_ptr + n[:, None] * (K // 32),
                           (n < N)[:, None], K, N, BLOCK_K, PTX, LOOP)
    tl.store(out_ptr + k * N + n, out)


@pytest.mark.parametrize("block_k, ptx, loop", [(64, False, True), (128, False, False),
                                                pytest.param(64, True, True, marks=pytest.mark.gpu),
                                                pytest.param(128, True, False, marks=pytest.mark.gpu)])
def test_every_code_and_scale_through_the_word_products(block_k, ptx, loop):
    """All 256 bytes under scales from 2^-27 to 2^33 through _row_times_words against one-hot bfloat16 rows: each
    output is one weight, the checkpoint reader's bit for bit (each product is exact, times 2^-14 until the end).
    The halves widened by inline PTX only on a GPU (Triton's interpreter cannot run it)."""
    q = (torch.arange(16 * 64) % 256).to(torch.uint8).reshape(16, 64)  # 16 rows of 128 weights
    s = (100 + torch.arange(64)).to(torch.uint8).reshape(16, 4)
    x = torch.eye(128, dtype=torch.bfloat16)
    out = torch.empty(128, 16, dtype=torch.float32, device=DEVICE)
    _words_rows_kernel[(128,)](x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), out, K=128, N=16, BLOCK_K=block_k, PTX=ptx,
                               LOOP=loop)
    assert torch.equal(out.cpu().t(), dequantize_experts(q, s, torch.float32))


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
