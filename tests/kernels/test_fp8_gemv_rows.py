"""kernels.fp8_gemv_rows, the W8A16 product of 2-16 rows reading each fp8 weight element once, against its plain-torch
twin (kernels.fp8_gemv.fp8_linear_reference): both modes (float32 on the CUDA cores, the tensor cores), per-channel
and block-wise scales, ragged N and K (partial blocks, partial chunks), 2, 5, 8 and 16 rows, bias. With integer
values and power-of-two scales every sum is exact, so there the outputs equal the twin's bit for bit whatever the
summation order; with random values float32 agrees to 1e-5 and a 16-bit output may be the twin's rounding neighbour
(one rounding of a float32 sum summed in another order: within 2^-7 of the value in bfloat16). Also the configs'
fitting to blocks and K, the plan's lookup, and engine.quantization.fp8_linear's choice by row count."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.quantization.fp8 import quantize
from radixmesh.engine.quantization.fp8_linear import Fp8Weights, fp8_linear
from radixmesh.kernels import fp8_gemv_rows as rows
from radixmesh.kernels.fp8_gemv import fp8_gemv_row, fp8_linear_reference
from radixmesh.kernels.fp8_gemv_rows import CORES, DOT, fp8_gemv_rows, padded_rows, rows_config, set_rows_plan
from radixmesh.kernels.fp8_quant import FP8

from tests.kernels.test_fp8_gemv import DEVICE, DTYPES, _case  # the one-row kernel's operands, seeded alike


def _tol(dtype):
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 2 ** -7}


# (rows, n, k, block, config): each mode at each row count's padding, ragged n and k, several chunks and K-blocks
# (K split in 3 and 2: partial sums added by the second kernel)
CASES = [(2, 40, 200, None, (8, 256, 1, CORES)), (5, 70, 300, (16, 128), (16, 256, 1, CORES)),
         (16, 50, 264, None, (16, 256, 1, CORES)), (8, 33, 1030, None, (16, 256, 1, DOT, 1)),
         (16, 96, 300, (32, 64), (32, 128, 1, DOT, 1)), (5, 64, 256, (16, 128), (16, 64, 1, DOT, 1)),
         (2, 72, 520, (32, 128), (32, 512, 1, DOT, 1)), (8, 33, 1030, None, (16, 128, 1, DOT, 3)),
         (4, 96, 600, (32, 128), (32, 128, 1, DOT, 2))]


@pytest.mark.parametrize("m,n,k,block,config,dtype",
                         [(*case, dtype) for case in CASES for dtype in DTYPES[:2]]
                         + [(*CASES[1], torch.float16), (*CASES[3], torch.float16)])
def test_fp8_gemv_rows_matches_its_twin(m, n, k, block, config, dtype):
    x, q, s, b = _case(m, n, k, block, dtype, bias=m % 2 == 0)
    got = fp8_gemv_rows(x, q, s, block, b, config=config)
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got, fp8_linear_reference(x, q, s, block, b), **_tol(dtype))


def _integers(m: int, n: int, k: int, block, dtype):
    """x and fp8 weights of small integers, power-of-two scales and an integer bias: every product and partial sum
    is an integer below 2^24 times a power of two, exact in float32 in any order."""
    g = torch.Generator().manual_seed(n + k)
    x = torch.randint(-8, 9, (m, k), generator=g).to(DEVICE, dtype)
    q = torch.randint(-8, 9, (n, k), generator=g).float().to(FP8).to(DEVICE)
    shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
    s = (2.0 ** torch.randint(-3, 4, shape, generator=g)).to(DEVICE)
    b = torch.randint(-64, 65, (n,), generator=g).to(DEVICE, dtype)
    return x, q, s, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,n,k,block,config", [(2, 40, 1030, None, (8, 256, 1, CORES)),
                                                (8, 70, 300, (16, 128), (16, 256, 1, CORES)),
                                                (16, 33, 520, None, (16, 128, 1, DOT, 1)),
                                                (5, 96, 300, (32, 64), (32, 64, 1, DOT, 3))])
def test_exact_sums_equal_the_twin_bit_for_bit(m, n, k, block, config, dtype):
    x, q, s, b = _integers(m, n, k, block, dtype)
    got = fp8_gemv_rows(x, q, s, block, b, config=config)
    assert torch.equal(got, fp8_linear_reference(x, q, s, block, b))


def test_configs_fit_blocks_k_and_the_plan(monkeypatch):
    monkeypatch.setattr(rows, "interpreting", lambda: False)  # the compiled kernels' tiles (the interpreter widens)
    assert [padded_rows(m) for m in (2, 3, 4, 5, 8, 9, 16)] == [2, 4, 4, 8, 8, 16, 16]
    assert rows_config(2, 4096, 4096, None) == (*rows.ROWS_CONFIG[2], 1)
    assert rows_config(9, 4096, 4096, None) == (*rows.ROWS_CONFIG[16], 0)  # the split chosen at launch
    assert rows_config(8, 4096, 4096, (128, 128), (32, 256, 4, DOT)) == (32, 128, 4, DOT, 0)  # a chunk per K-block
    assert rows_config(8, 4096, 4096, (16, 128), (32, 256, 4, DOT, 2)) == (16, 128, 4, DOT, 2)  # in a block row
    assert rows_config(8, 4096, 4096, (8, 128), (32, 256, 4, DOT)) == (8, 256 * 4, 4, CORES, 1)  # under 16 columns
    assert rows_config(2, 4096, 4096, (128, 128), (4, 128, 2, CORES)) == (4, 512, 2, CORES, 1)  # 8 columns a thread
    assert rows_config(2, 40, 200, None, (8, 512, 4, DOT)) == (16, 256, 4, DOT, 0)  # K's next power of two
    set_rows_plan({(4096, 4096, 8): (64, 512, 4, DOT, 2)})
    try:
        assert rows_config(5, 4096, 4096, None) == (64, 512, 4, DOT, 2)
        assert rows_config(4, 4096, 4096, None) == (*rows.ROWS_CONFIG[4], 0)  # another padded row count
    finally:
        set_rows_plan({})


def test_k_is_split_until_every_sm_has_its_programs():
    # the 8B shape's products on 132 SMs, 32-column blocks, 1024 columns a loop iteration
    assert [rows.dot_splits(n, k, 32, 1024, 132) for n, k in ((6144, 4096), (4096, 4096), (28672, 4096),
                                                                (4096, 14336))] == [2, 4, 1, 4]
    assert rows.dot_splits(1024, 4096, 32, 1024, 132) == 4  # at most one split an iteration
    assert rows.dot_splits(1024, 14336, 32, 1024, 132) == 8  # a power of two
    assert rows.dot_splits(96, 128, 16, 128, 8) == 1


def test_the_planners_candidates_start_with_the_defaults_and_run_as_given(monkeypatch):
    from radixmesh.engine.decode_products import FP8_ROWS_TILES

    monkeypatch.setattr(rows, "interpreting", lambda: False)
    assert set(FP8_ROWS_TILES) == set(rows.ROWS_CONFIG) == {2, 4, 8, 16}
    for m, tiles in FP8_ROWS_TILES.items():
        assert tiles[0] == rows.ROWS_CONFIG[m] and len(set(tiles)) == len(tiles)
        for config in tiles:  # at the 8B shapes, per-channel: timed as named
            splits = config[4] if len(config) > 4 else 1 if config[3] == CORES else 0
            assert all(rows_config(m, n, k, None, config) == (*config[:4], splits)
                       for n, k in ((4096, 4096), (4096, 14336)))


def test_the_plan_keeps_each_row_counts_fastest_config(monkeypatch):
    """engine.decode_products.fp8_rows_plan over a model of two fp8 layers of one shape: every candidate runs (the
    kernels here, in the interpreter or on the GPU; the graph timing replaced by a table of times), and the plan
    keeps the fastest per padded row count. (On a GPU it failed while its inputs were made on the CPU.)"""
    from torch import nn

    from radixmesh.engine import decode_products

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            _, q, s, _ = _case(1, 16, 128, (16, 128), torch.float32, bias=False)
            self.weight = nn.Parameter(q, requires_grad=False)
            self.register_buffer("weight_scale", s)
            self.fp8 = Fp8Weights((16, 128), scaled_mm=False)

    model = nn.Sequential(Layer(), Layer())  # one weight shape, two weights
    fastest = {2: (16, 256, 1, "dot"), 4: (4, 512, 2, "cores"), 8: (64, 256, 4, "dot"), 16: (16, 256, 1, "dot")}
    ran = []

    def graph_ms(product, weights, inputs):  # runs the products as the graph would, then "times" them
        for w in weights:
            x = inputs[w.shape[1]]
            layer = next(m for m in model if m.weight is w)
            torch.testing.assert_close(product(x, w), fp8_linear_reference(x, w, layer.weight_scale, (16, 128)))
            ran.append(x.shape[0])
        return 1.0 if product.keywords["config"] == fastest[x.shape[0]] else 2.0

    monkeypatch.setattr(decode_products, "_graph_ms", graph_ms)
    plan = decode_products.fp8_rows_plan(model, torch.device(DEVICE), torch.float32)  # the layers' device
    assert plan == {(16, 128, m): config for m, config in fastest.items()}
    assert sorted(set(ran)) == [2, 4, 8, 16]
    assert len(ran) == 2 * sum(len(t) for t in decode_products.FP8_ROWS_TILES.values())


def test_fp8_linear_takes_the_one_row_and_the_rows_kernels():
    x, q, s, _ = _case(4, 96, 256, (32, 64), torch.float32, bias=False)
    how = Fp8Weights((32, 64), scaled_mm=False)
    assert torch.equal(fp8_linear(x[:1], q, s, how), fp8_gemv_row(x[:1], q, s, (32, 64)))
    got = fp8_linear(x.reshape(2, 2, 256), q, s, how)
    assert got.shape == (2, 2, 96) and torch.equal(got.reshape(4, 96), fp8_gemv_rows(x, q, s, (32, 64)))
    assert fp8_gemv_rows(x[:0], q, s, (32, 64)).shape == (0, 96)


def test_bad_input_refused():
    x, q, s, _ = _case(17, 64, 128, (32, 64), torch.float32, bias=False)
    with pytest.raises(ValueError, match="x \\[m <= 16"):
        fp8_gemv_rows(x, q, s, (32, 64))
    with pytest.raises(ValueError, match="contiguous fp8 weight"):
        fp8_gemv_rows(x[:4], q.float(), s, (32, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "channel"])
def test_rows_at_the_8b_shape_in_a_graph(block):
    """Both modes (the CUDA cores where the planner tries them), K split and not, at the 8B shape's projections and
    2-16 rows against the twin, and under PDL in a CUDA graph equal to the eager launch."""
    configs = {2: [(4, 512, 2, CORES), (32, 256, 4, DOT)], 4: [(4, 512, 2, CORES), (32, 256, 4, DOT, 1)],
               8: [(32, 256, 4, DOT)], 16: [(32, 256, 4, DOT), (64, 256, 4, DOT, 1)]}
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        q, s = quantize(torch.randn((n, k)) / k ** 0.5, block)
        q, s = q.cuda(), (s.reshape(n) if block is None else s).cuda()
        for m, tiles in configs.items():
            x = torch.randn((m, k), device="cuda", dtype=torch.bfloat16)
            want = fp8_linear_reference(x, q, s, block)
            for config in tiles:
                eager = fp8_gemv_rows(x, q, s, block, config=config)
                torch.testing.assert_close(eager, want, rtol=1.6e-2, atol=1e-2)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = fp8_gemv_rows(x, q, s, block, pdl=True, config=config)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, eager), (n, k, m, config)
