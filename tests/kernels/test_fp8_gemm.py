"""kernels.fp8_gemm, the fp8 x fp8 GEMM with block-wise (per-token-group x 2-D block) and row-wise (per-token x
per-channel) scales, against its plain-torch twin: ragged M, N and K (partial tiles, partial blocks), blocks narrower
than the column tile, and the output near the unquantized product. The GEMM's activations are quantized as
kernels.fp8_quant.group_quant does by its plain-torch twin (bit-identical to it: tests/kernels/test_fp8_quant.py; in
Triton's interpreter the kernel would be most of this file's time); fp8_linear below runs group_quant itself."""

from __future__ import annotations

import pytest
import torch

from radixmesh.kernels.fp8_gemm import fp8_gemm, fp8_gemm_reference
from radixmesh.kernels.fp8_quant import group_quant_reference
from radixmesh.engine.quantization.fp8 import quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_near_twin(got: torch.Tensor, want: torch.Tensor, a, a_s, q, w_s, block) -> None:
    """float32 outputs against the float32 twin. Triton's interpreter sums as the twin does (1e-5). A GPU's fp8 MMA
    does not: Hopper adds fp8 products in an accumulator of fewer bits than float32 (about 2^-13 of the running sum
    per addition, the limit DeepSeek-V3's report measured), so there each output is held within 2^-10 of the sum of
    its terms' magnitudes, the bound of such a summation, not within float32's rounding of it."""
    if got.device.type != "cuda":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    magnitudes = fp8_gemm_reference(a.float().abs().to(a.dtype), a_s, q.float().abs().to(q.dtype), w_s, block,
                                    torch.float32)
    excess = (got.float() - want.float()).abs() - (2.0 ** -10 * magnitudes + 1e-6)
    assert excess.max() <= 0, f"{int((excess > 0).sum())} outputs past the bound, worst by {excess.max():.3g}"


def _operands(m: int, n: int, k: int, block, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((m, k), generator=g).to(dtype)
    w = torch.randn((n, k), generator=g) / k ** 0.5
    q, scale = quantize(w, block)
    a, a_s = group_quant_reference(x.to(DEVICE), block[1] if block else None)
    return x, w, a, a_s, q.to(DEVICE), scale.reshape(-1, scale.shape[-1]).squeeze(-1).to(DEVICE) if block is None \
        else scale.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("m,n,k,block", [(1, 64, 128, (64, 64)), (37, 200, 300, (32, 64)), (70, 256, 256, (128, 128)),
                                         (17, 96, 160, (32, 32)), (5, 80, 96, None), (130, 200, 300, None)])
def test_fp8_gemm_matches_its_twin(m, n, k, block, dtype):
    x, w, a, a_s, q, w_s = _operands(m, n, k, block, dtype, seed=m + n + k)
    got = fp8_gemm(a, a_s, q, w_s, block, dtype)
    want = fp8_gemm_reference(a, a_s, q, w_s, block, dtype)
    assert got.shape == (m, n) and got.dtype == dtype
    if dtype == torch.float32:  # float32 sums in another order, one rounding (on a GPU, in fp8 MMA's accumulator)
        assert_near_twin(got, want, a, a_s, q, w_s, block)
    else:
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    exact = x.float() @ w.t()
    assert (got.float().cpu() - exact).abs().mean() < 0.05 * exact.abs().mean()  # fp8 on both sides: ~2-3%


def test_fp8_gemm_refuses_what_it_cannot_compute():
    x, w, a, a_s, q, w_s = _operands(4, 64, 128, (64, 64), torch.float32, seed=0)
    with pytest.raises(ValueError, match="needs w_scales"):
        fp8_gemm(a, a_s, q, w_s[:, :1], (64, 64), torch.float32)
    with pytest.raises(ValueError, match="power-of-two blocks"):
        fp8_gemm(a, a_s, q, w_s, (64, 48), torch.float32)
    with pytest.raises(ValueError, match="fp8_gemm takes"):
        fp8_gemm(a.float(), a_s, q, w_s, (64, 64), torch.float32)


@pytest.mark.parametrize("rows", [1, 8, 40])
@pytest.mark.parametrize("block,scaled_mm", [((32, 64), False), (None, False), (None, True)],
                         ids=["block", "channel", "channel-scaled-mm"])
def test_fp8_linear_picks_a_product_that_matches_its_twin(rows, block, scaled_mm):
    """engine.quantization.fp8_linear by the number of rows: W8A16 up to 16 (the weights' twin exactly), else the
    activations quantized per token (group) and the fp8 GEMM: kernels.fp8_gemm, or torch._scaled_mm for per-channel
    bfloat16 (on CUDA in the engine; here on CPU where this torch has it, which checks the call's layout: row-wise
    scale_a [M, 1], scale_b [1, N], the weight's transpose as mat2)."""
    from radixmesh.engine.quantization.fp8_linear import Fp8Weights, fp8_linear
    from radixmesh.kernels.fp8_gemv import fp8_linear_reference

    dtype = torch.bfloat16 if scaled_mm else torch.float32
    x, _, _, _, q, w_s = _operands(rows, 96, 128, block, dtype, seed=rows)
    x = x.to(DEVICE).reshape(1, rows, 128)  # [batch, tokens, hidden]: products keep the leading dimensions
    bias = torch.randn(96).to(DEVICE, dtype)
    try:
        got = fp8_linear(x, q, w_s, Fp8Weights(block, scaled_mm), bias)
    except (RuntimeError, NotImplementedError) as e:
        if scaled_mm and not x.is_cuda:
            pytest.skip(f"this torch has no CPU torch._scaled_mm: {e}")
        raise
    assert got.shape == (1, rows, 96) and got.dtype == dtype
    flat = x.reshape(rows, 128)
    if rows <= 16:
        want = fp8_linear_reference(flat, q, w_s, block, bias)
    else:
        a, a_s = group_quant_reference(flat, block[1] if block else None)
        want = fp8_gemm_reference(a, a_s, q, w_s, block, torch.float32) + bias.float()
        if dtype == torch.float32:
            return assert_near_twin(got.reshape(rows, 96), want, a, a_s, q, w_s, block)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.reshape(rows, 96).float(), want.float(), **tol)


@pytest.mark.parametrize("rows", [37, 200])
def test_every_candidate_block_tile_matches_the_twin(rows):
    """kernels.fp8_gemm.CANDIDATES (the tiles benchmarks.tune_fp8_gemm tries for block-wise weights) for the bucket
    of `rows`: each gives the twin's product (ragged M, N and K; BLOCK_N capped at the block's bn)."""
    from radixmesh.kernels.fp8_gemm import CANDIDATES, gemm_bucket

    block = (64, 64)
    x, w, a, a_s, q, w_s = _operands(rows, 200, 300, block, torch.float32, seed=rows)
    want = fp8_gemm_reference(a, a_s, q, w_s, block, torch.float32)
    for config in CANDIDATES[gemm_bucket(rows)]:
        assert_near_twin(fp8_gemm(a, a_s, q, w_s, block, torch.float32, config=config), want, a, a_s, q, w_s, block)


def test_tuned_tiles_are_read_from_data_and_picked_by_weight_shape_and_row_bucket(tmp_path):
    """A GPU's tuned file (what benchmarks.tune_fp8_gemm writes, named by the GPU) is read by (n, k, scale block,
    row bucket); a product takes its bucket's tiles for a block-wise weight of that shape and block, the defaults
    elsewhere."""
    import json

    from radixmesh.kernels.fp8_gemm import BUCKETS, CANDIDATES, config_path, gemm_bucket, gemm_config, read_tuned

    assert [gemm_bucket(m) for m in (17, 32, 33, 100, 256, 257, 1025, 9000)] == [32, 32, 64, 128, 256, 1024, 8192, 8192]
    assert set(CANDIDATES) == set(BUCKETS) and all(CANDIDATES[b][0] == gemm_config(b, 1, 1, (128, 128))[:2]
                                                   + gemm_config(b, 1, 1, (128, 128))[3:] for b in BUCKETS)
    path = config_path("NVIDIA H100 80GB HBM3", tmp_path)
    assert path.name == "fp8-gemm-nvidia-h100-80gb-hbm3.json"
    assert read_tuned(path) == {}  # no file: nothing tuned
    path.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "shapes": {"4096,14336,128,128": {
        "256": {"tiles": [64, 128, 4, 4], "ms": 0.1, "default_ms": 0.12},
        "128": {"tiles": [128, 128, 8, 3], "ms": 0.07, "default_ms": 0.07}}}}))
    tuned = read_tuned(path)
    assert tuned == {(4096, 14336, 128, 128, 256): (64, 128, 4, 4), (4096, 14336, 128, 128, 128): (128, 128, 8, 3)}
    assert gemm_config(200, 4096, 14336, (128, 128), tuned=tuned) == (64, 128, 128, 4, 4)  # its bucket's tiles
    assert gemm_config(40, 4096, 14336, (128, 128), tuned=tuned) == (64, 128, 128, 4, 3)  # a bucket not tuned
    assert gemm_config(200, 4096, 4096, (128, 128), tuned=tuned) == (128, 128, 128, 8, 3)  # another shape
    assert gemm_config(200, 4096, 14336, (64, 128), tuned=tuned) == (128, 64, 128, 8, 3)  # another scale block:
    # not tuned (the default, BLOCK_N capped at its bn)
    assert gemm_config(200, 4096, 14336, None, tuned=tuned) == (128, 128, 128, 8, 3)  # row-wise weights: never
    assert gemm_config(200, 4096, 14336, (128, 128), (16, 64, 4, 4), tuned) == (16, 64, 128, 4, 4)  # asked
