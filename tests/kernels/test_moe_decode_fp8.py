"""The few-token expert path on fp8 experts (kernels.moe_decode_fp8, W8A16) against its plain-torch twin: per-row and
block scales, float32 and bfloat16, load chunks wider and narrower than a K-block with a ragged last one, an
intermediate size that starts the up rows inside a block row; against the dequantized experts (the same products)
and kernels.moe_fp8's grouped GEMMs (the same products per row; block-wise those quantize the activations); experts
of other ranks (-1); and which token counts fused_experts_fp8 sends here. In Triton's interpreter without CUDA, on
the GPU with it."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.quantization.fp8 import quantize
from radixmesh.kernels.moe import fused_experts_reference, route_reference
from radixmesh.kernels.moe_decode import DecodeTiles
from radixmesh.kernels.moe_decode_fp8 import (FP8_TILES, decode_experts_fp8, decode_experts_fp8_reference,
                                              dequantize_experts)
from radixmesh.kernels.moe_fp8 import fused_experts_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# wide columns (the interpreter runs programs one by one); K chunks of 64 and 32 columns around K-blocks of 32 or 64
CHUNK_64 = DecodeTiles(up_block_n=64, up_block_k=64, up_warps=4, down_block_n=64, down_block_k=64, down_warps=4)
CHUNK_32 = DecodeTiles(up_block_n=32, up_block_k=32, up_warps=4, down_block_n=64, down_block_k=128, down_warps=4)


def _stack(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts' float32 weights [experts, N, K] -> (fp8 codes, float32 scales) as engine.quantization.fp8 writes."""
    parts = [quantize(e, block) for e in w]
    return (torch.stack([p[0] for p in parts]),
            torch.stack([p[1].reshape(-1) if block is None else p[1] for p in parts]))


def _layer(tokens: int, experts: int, top_k: int, hidden: int, inter: int, block, dtype):
    """x, (w13, s13, w2, s2, block), routing weights and ids of one layer."""
    gen = torch.Generator().manual_seed(tokens * 100 + experts * 10 + hidden)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13, s13 = _stack(torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5, block)
    w2, s2 = _stack(torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5, block)
    weights, ids = route_reference(torch.randn(tokens, experts, generator=gen), top_k, True, dtype)
    return x, (w13, s13, w2, s2, block), weights, ids


def _run(x, fp8, weights, ids, **kw) -> torch.Tensor:
    w13, s13, w2, s2, block = fp8
    dev = [t.to(DEVICE) for t in (x, w13, s13, w2, s2)]
    return decode_experts_fp8(*dev, block, weights.to(DEVICE), ids.to(DEVICE), **kw).cpu()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: within its sums' order; bfloat16: the twin's roundings, nearly every element equal."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert (got != want).float().mean().item() <= 0.05


CASES = {  # (tokens, experts, top_k, hidden, inter, block, tiles)
    "row": (2, 6, 3, 96, 64, None, CHUNK_64),  # hidden 96: a chunk and a ragged one
    "block-32x32": (2, 6, 3, 96, 64, (32, 32), CHUNK_64),  # chunks of two K-blocks; the last K-block past hidden
    "block-32x64": (1, 8, 2, 96, 48, (32, 64), CHUNK_32),  # chunks inside a K-block; up rows from 48 (block row 1)
    "gpu-tiles": (1, 4, 2, 64, 16, (32, 32), FP8_TILES["block"]),  # the GPU's default tiles, narrow programs
    "gpu-tiles-row": (1, 4, 2, 64, 16, None, FP8_TILES["row"]),
}


@pytest.mark.parametrize("stacked", [0, 1], ids=["loop", "stacked"])
@pytest.mark.parametrize("case,dtype", [(c, d) for c in CASES for d in (torch.float32, torch.bfloat16)
                                        if not c.startswith("gpu-tiles") or d == torch.float32],
                         ids=lambda v: v if isinstance(v, str) else str(v).rpartition(".")[2])
def test_fp8_decode_experts_match_the_twin(case, dtype, stacked):
    """Both forms of the down launch: the experts one by one, and stacked (their rows one tensor axis)."""
    *shape, block, tiles = CASES[case]
    x, fp8, weights, ids = _layer(*shape, block, dtype)
    got = _run(x, fp8, weights, ids, tiles=tiles._replace(down_stacked=stacked))
    _close(got, decode_experts_fp8_reference(x, *fp8, weights, ids))


@pytest.mark.parametrize("block", [None, (32, 32)], ids=["row", "block"])
def test_the_stacked_fp8_down_launch_equals_the_loop(block):
    """The same products and scales row by row; only the float32 sum over the top_k experts runs in another order
    (float32: within a few ulps; bfloat16: nearly every element equal). Experts of other ranks (-1) add nothing."""
    for dtype in (torch.float32, torch.bfloat16):
        x, fp8, weights, ids = _layer(2, 8, 4, 96, 64, block, dtype)
        ids[0, 1] = ids[1, 0] = -1
        loop = _run(x, fp8, weights, ids, tiles=CHUNK_64._replace(down_stacked=0))
        stacked = _run(x, fp8, weights, ids, tiles=CHUNK_64._replace(down_stacked=1))
        _close(stacked, loop)


@pytest.mark.parametrize("block", [None, (32, 64)], ids=["row", "block"])
def test_the_products_are_the_dequantized_weights(block):
    """W8A16: in float32 the path equals the 16-bit experts' twin on the dequantized weights. Per row so do the
    grouped GEMMs; block-wise those quantize the activations per token group (W8A8) and land measurably farther."""
    x, fp8, weights, ids = _layer(1, 8, 2, 128, 64, block, torch.float32)
    w13, s13, w2, s2, _ = fp8
    exact = fused_experts_reference(x, dequantize_experts(w13, s13, block), dequantize_experts(w2, s2, block),
                                    weights, ids)
    got = _run(x, fp8, weights, ids)
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5)
    grouped = fused_experts_fp8(x.to(DEVICE), *(t.to(DEVICE) for t in fp8[:4]), block, weights.to(DEVICE),
                                ids.to(DEVICE), decode_path=False).cpu()
    err = (grouped - exact).abs().max().item()
    assert err < 1e-5 if block is None else err > 1e-3


@pytest.mark.parametrize("block", [None, (32, 32)], ids=["row", "block"])
def test_experts_of_other_ranks_add_nothing(block):
    """Expert parallelism: ids of -1 load nothing and add nothing; a token with no local expert gets zeros."""
    x, (w13, s13, w2, s2, _), weights, ids = _layer(3, 6, 2, 64, 32, block, torch.float32)
    local_fp8 = (w13[3:], s13[3:], w2[3:], s2[3:], block)  # this rank holds experts 3..5
    local = torch.where(ids >= 3, ids - 3, -1)
    local[0, 0], local[1] = 1, -1  # token 0: one expert here, one elsewhere; token 1: none here
    got = _run(x, local_fp8, weights, local)
    torch.testing.assert_close(got, decode_experts_fp8_reference(x, *local_fp8, weights, local), rtol=1e-5,
                               atol=1e-5)
    assert (got[1] == 0).all() and got[0].abs().sum() > 0


def test_fused_experts_fp8_sends_a_few_tokens_here_and_more_to_the_grouped_gemms():
    """Block-wise the two paths compute different products; fused_experts_fp8 equals, bit for bit, the one its
    token count picks (kernels.moe_decode.use_decode_path: one token of top-2 over 8 experts here, two not)."""
    block = (32, 64)
    for tokens, picked in ((1, "decode"), (2, "grouped")):
        x, fp8, weights, ids = (t.to(DEVICE) if isinstance(t, torch.Tensor) else t
                                for t in _layer(tokens, 8, 2, 64, 32, block, torch.float32))
        fp8 = (*(t.to(DEVICE) for t in fp8[:4]), block)
        paths = {"decode": fused_experts_fp8(x, *fp8, weights, ids, decode_path=True),
                 "grouped": fused_experts_fp8(x, *fp8, weights, ids, decode_path=False)}
        assert not torch.equal(paths["decode"], paths["grouped"])  # else the check below could not tell them apart
        assert torch.equal(fused_experts_fp8(x, *fp8, weights, ids), paths[picked])


def test_fp8_decode_experts_refuse_what_they_cannot_compute():
    x, (w13, s13, w2, s2, block), weights, ids = _layer(1, 4, 2, 64, 32, (32, 32), torch.float32)
    with pytest.raises(ValueError, match="fp8 experts take"):
        decode_experts_fp8(x, w13.float(), s13, w2, s2, block, weights, ids)
    with pytest.raises(ValueError, match="float32 scales"):
        decode_experts_fp8(x, w13, s13[:, :1], w2, s2, block, weights, ids)
    with pytest.raises(ValueError, match="decode_experts_fp8 takes"):
        decode_experts_fp8(x, w13, s13, w2, s2, block, weights[:, :1], ids)
