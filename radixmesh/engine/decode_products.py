"""Which kernel runs each decode-sized product (up to engine.layers.linear.SKINNY_ROWS rows) on this GPU, and with
which tiles.

Neither kernel wins everywhere, and the winner depends on the product's shape. The 8B shape's products chained in a
CUDA graph at one row take 5.29 ms with kernels.gemv under programmatic dependent launch against 5.61 with cuBLAS on
an H100, but 4.36-4.44 against 4.06 on an H200 (benchmarks/results/NOTES.md, 2026-11-24); on the H200, by shape,
kernels.gemv with 32-row tiles takes 10.6 us for o_proj and 28.7 for down_proj against cuBLAS's 13.1 and 32.0 (its
split-K needs a second kernel), while cuBLAS keeps qkv_proj and gate_up_proj (2026-11-28, night). So with
--decode-gemm auto the model runner times, before it captures its graphs, every distinct weight shape of the model
at one row: cuBLAS and kernels.gemv with each of a few tile configurations, each over all of that shape's weights
in one graph; a shape runs kernels.gemv (with its fastest tiles) only when that is clearly faster, so a close call
keeps cuBLAS on every start (the choice changes the products' rounding). Products of one row (a batch-1 decode
step) run gemv_row, kernels.gemv's CUDA-core product, instead: over the 8B shape's products it streams at 1.03x the
copy floor on an H200 against cuBLAS's 1.21x, and it took the batch-1 step from 4.44-4.50 to 3.93 ms (2026-11-29).

Weights held in fp8 (engine.quantization.fp8_load) have no cuBLAS product with 16-bit activations: their one-row
products always run kernels.fp8_gemv.fp8_gemv_row, and the plan times its tiles per fp8 weight shape (FP8_ROW_TILES,
gemv_row's tiles with 1 or 2 times the columns: a byte per element) and keeps the fastest (fp8_row_plan); their
products of 2-16 rows run kernels.fp8_gemv_rows, timed per shape at 2, 4, 8 and 16 rows over its CUDA-core and
tensor-core tiles (FP8_ROWS_TILES), the fastest kept for each row count (fp8_rows_plan). (Block-wise fp8 products of
more than 16 rows run kernels.fp8_gemm with tiles tuned offline per GPU and shipped as data, benchmarks.
tune_fp8_gemm: timing and compiling them at every start took over a minute.)
"""

from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from radixmesh.engine.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                            RowParallelLinear)

log = logging.getLogger(__name__)

MARGIN = 0.97  # kernels.gemv must take at most this share of cuBLAS's time
ROW_GUARD = 1.10  # gemv_row runs a shape's one-row products unless its own timing is above this share of the choice
REPLAYS = 5


def _weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights of the model's decode products, in forward order, then the LM head's (or the tied embedding's).
    Besides the projections (ColumnParallelLinear's too: DeepSeek's q and latent projections, which cuBLAS ran at
    one row in ~13.5 us a layer of V2-Lite's step on an H100), a module that says `decode_product = True` (a
    mixture-of-experts router: its [experts, hidden] product runs once a layer) is planned alike; a projection that
    says `decode_product = False` (DeepSeek's kv_b_proj: decode reads it in the absorbed kernels) is not."""
    kinds = (QKVParallelLinear, MergedColumnParallelLinear, ColumnParallelLinear, RowParallelLinear)
    out = [m.weight for m in model.modules() if getattr(m, "decode_product", isinstance(m, kinds))]
    head = getattr(model, "lm_head", None)
    out.append(model.model.embed_tokens.weight if head is None else head.weight)
    return out


def _graph_ms(product, weights: list[torch.Tensor], inputs: dict[int, torch.Tensor]) -> float:
    """Median GPU ms of one replay of a graph that runs `product` over every weight, one after another."""
    def run():
        for w in weights:
            product(inputs[w.shape[1]], w)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compiles and warms up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2]


# Tiles tried besides kernels.gemv's defaults, (BLOCK_N, BLOCK_K, warps, stages, L2-pulled columns): the fastest
# for o_proj and down_proj on an H200 (benchmarks.pdl_chain --per-role, 2026-11-28)
CANDIDATES = ((32, 512, 4, 4, 2048), (16, 512, 2, 4, 2048))


def candidates(n: int, k: int) -> list[tuple[int, int, int, int, int]]:
    """kernels.gemv's default tiles for an [n, k] weight, then CANDIDATES fitted to k (as the defaults are)."""
    from radixmesh.kernels.gemv import default_config

    cap = 1 << max(k - 1, 0).bit_length()  # next power of two
    out = [default_config(n, k)]
    for block_n, block_k, warps, stages, pull in CANDIDATES:
        config = (block_n, max(64, min(block_k, cap)), warps, stages, min(pull, cap))
        if config not in out:
            out.append(config)
    return out


# (BLOCK_N, BLOCK_K, num_warps[, GROUP]) tried for fp8_gemv_row; the first is its default (kernels.fp8_gemv.ROW_CONFIG).
# The grouped tiles sum each thread's 16 consecutive products first: at sm_90 they take a third to a half of the
# registers of their full-accumulator twins (benchmarks.row_issue), so more programs fit an SM (twentieth session).
FP8_ROW_TILES = ((2, 2048, 4), (2, 4096, 4), (4, 2048, 4), (2, 4096, 8), (8, 1024, 4),
                 (2, 2048, 4, 16), (4, 2048, 4, 16), (8, 1024, 4, 16), (2, 1024, 2, 16))


def _fp8_layers(model: nn.Module) -> dict[tuple[int, int], list[nn.Module]]:
    """The model's layers whose weights are held in fp8, by weight shape (stacked experts run kernels.moe_fp8)."""
    layers: dict[tuple[int, int], list[nn.Module]] = {}
    for m in model.modules():
        if getattr(m, "fp8", None) is not None and m.weight.dim() == 2:
            layers.setdefault(tuple(m.weight.shape), []).append(m)
    return layers


def _fastest(product, candidates, weights: list[torch.Tensor], inputs: dict[int, torch.Tensor]
             ) -> tuple[tuple | None, float]:
    """The candidate config `product(x, w, config=...)` runs fastest over `weights` in one graph, and its ms (None,
    inf where none fits this GPU)."""
    from triton.runtime.errors import OutOfResources

    best, best_ms = None, float("inf")
    for config in candidates:
        try:
            ms = _graph_ms(functools.partial(product, config=config), weights, inputs)
        except OutOfResources:  # tiles too large for this GPU's registers or shared memory
            continue
        if ms < best_ms:
            best, best_ms = config, ms
    return best, best_ms


def fp8_row_plan(model: nn.Module, device: torch.device, dtype: torch.dtype) -> dict[tuple[int, int], tuple]:
    """Per shape of the model's fp8-held weights: the fp8_gemv_row tiles fastest over all that shape's weights in
    one graph at one row (kernels.fp8_gemv.set_row_plan takes it). Empty without fp8 weights."""
    from radixmesh.kernels.fp8_gemv import fp8_gemv_row

    g = torch.Generator(device=device).manual_seed(0)
    chosen, lines = {}, []
    for shape, mods in _fp8_layers(model).items():
        by_weight = {id(m.weight): m for m in mods}
        inputs = {shape[1]: torch.randn((1, shape[1]), device=device, dtype=dtype, generator=g)}

        def product(x, w, config):
            m = by_weight[id(w)]
            return fp8_gemv_row(x, w, m.weight_scale, m.fp8.block, pdl=True, config=config)
        best, best_ms = _fastest(product, FP8_ROW_TILES, [m.weight for m in mods], inputs)
        if best is not None:
            chosen[shape] = best
            lines.append(f"{shape[0]}x{shape[1]} (x{len(mods)}): {best} {best_ms * 1e3 / len(mods):.1f} us")
    if lines:
        log.info("fp8 one-row products by weight shape: %s", "; ".join(lines))
    return chosen


# (BLOCK_N, BLOCK_K, num_warps, mode[, K splits]) tried for kernels.fp8_gemv_rows by padded row count; the first of
# each is its default (kernels.fp8_gemv_rows.ROWS_CONFIG). The CUDA-core tiles ("cores") at 2 and 4 rows only, beyond
# which their multiply-adds cannot keep up with the weights' stream; each compiles per K and row count. The
# tensor-core tiles ("dot") compile once for every K and row count; they split K where the column blocks are too few
# for the SMs (kernels.fp8_gemv_rows.dot_splits), and one tile is also tried unsplit.
FP8_ROWS_TILES = {2: ((4, 512, 2, "cores"), (4, 1024, 4, "cores"), (32, 256, 4, "dot"), (16, 256, 1, "dot")),
                  4: ((32, 256, 4, "dot"), (4, 512, 2, "cores"), (32, 256, 4, "dot", 1), (64, 256, 4, "dot")),
                  8: ((32, 256, 4, "dot"), (32, 256, 4, "dot", 1), (16, 256, 1, "dot"), (64, 256, 4, "dot")),
                  16: ((32, 256, 4, "dot"), (32, 256, 4, "dot", 1), (16, 256, 1, "dot"), (64, 256, 4, "dot"))}


def fp8_rows_plan(model: nn.Module, device: torch.device, dtype: torch.dtype
                  ) -> dict[tuple[int, int, int], tuple]:
    """Per shape of the model's fp8-held weights and padded row count (2, 4, 8, 16): the kernels.fp8_gemv_rows
    config fastest over all that shape's weights in one graph at that many rows (kernels.fp8_gemv_rows.set_rows_plan
    takes it). Empty without fp8 weights."""
    from radixmesh.kernels.fp8_gemv_rows import fp8_gemv_rows

    g = torch.Generator(device=device).manual_seed(0)
    chosen, lines = {}, []
    for (n, k), mods in _fp8_layers(model).items():
        by_weight = {id(m.weight): m for m in mods}

        def product(x, w, config):
            m = by_weight[id(w)]
            return fp8_gemv_rows(x, w, m.weight_scale, m.fp8.block, pdl=True, config=config)
        times = []
        for rows, tiles in FP8_ROWS_TILES.items():
            inputs = {k: torch.randn((rows, k), device=device, dtype=dtype, generator=g)}
            best, best_ms = _fastest(product, tiles, [m.weight for m in mods], inputs)
            if best is not None:
                chosen[(n, k, rows)] = best
                times.append(f"{rows} rows {best} {best_ms * 1e3 / len(mods):.1f} us")
        lines.append(f"{n}x{k} (x{len(mods)}): " + ", ".join(times))
    if lines:
        log.info("fp8 products of 2-16 rows by weight shape: %s", "; ".join(lines))
    return chosen


def plan(model: nn.Module, device: torch.device, dtype: torch.dtype
         ) -> tuple[dict[tuple[int, int], tuple | None], dict[tuple[int, int], tuple]]:
    """Per weight shape of the model's decode products: the kernels.gemv tiles to run it with, or None for cuBLAS;
    and the shapes whose one-row products run gemv_row instead, with its tiles (--decode-gemm auto;
    kernels.runtime.use_pdl takes both). Sets the fp8-held weights' tiles for the process (fp8_row_plan,
    fp8_rows_plan). gemv_row runs every shape unless, timed on the shape's own weights, it is clearly slower
    (ROW_GUARD) than the kernel chosen for more rows: on an H200 it was faster on every shape (qkv 12.6 against
    cuBLAS's 15.9 us, down_proj 27.6 against kernels.gemv's 28.7; 2026-11-29) and inside the step by 0.5 ms, so the
    choice leans to it and does not flip between starts on a close call; the guard is for a GPU where it is plainly
    the wrong kernel."""
    from triton.runtime.errors import OutOfResources

    from radixmesh.kernels.gemv import ROW_CONFIG, gemv, gemv_row

    by_shape: dict[tuple[int, int], list[torch.Tensor]] = {}
    for w in _weights(model):
        if w.dtype == dtype and w.is_contiguous():
            by_shape.setdefault(tuple(w.shape), []).append(w)
    g = torch.Generator(device=device).manual_seed(0)
    inputs = {k: torch.randn((1, k), device=device, dtype=dtype, generator=g) for _, k in by_shape}
    started, chosen, rows, lines = time.monotonic(), {}, {}, []
    for shape, weights in by_shape.items():
        cublas = _graph_ms(lambda x, w: F.linear(x, w), weights, inputs)
        best, best_ms = None, cublas
        for config in candidates(*shape):
            try:
                ms = _graph_ms(lambda x, w, c=config: gemv(x, w, pdl=True, config=c), weights, inputs)
            except OutOfResources:  # tiles too large for this GPU's shared memory
                continue
            if ms <= MARGIN * cublas and ms < best_ms:
                best, best_ms = config, ms
        chosen[shape] = best
        try:
            row_ms = _graph_ms(lambda x, w: gemv_row(x, w, pdl=True), weights, inputs)
        except OutOfResources:  # a K too long for its registers on this GPU
            row_ms = float("inf")
        if row_ms <= ROW_GUARD * best_ms:
            rows[shape] = ROW_CONFIG
        lines.append(f"{shape[0]}x{shape[1]} (x{len(weights)}): cuBLAS {cublas * 1e3 / len(weights):.1f} us"
                     + ("" if best is None else f", kernels.gemv {best} {best_ms * 1e3 / len(weights):.1f} us")
                     + f", gemv_row {row_ms * 1e3 / len(weights):.1f} us" + ("" if shape in rows else " (not used)"))
    from radixmesh.kernels.fp8_gemv import set_row_plan
    from radixmesh.kernels.fp8_gemv_rows import set_rows_plan

    set_row_plan(fp8_row_plan(model, device, dtype))
    set_rows_plan(fp8_rows_plan(model, device, dtype))
    torch.cuda.empty_cache()
    log.info("decode products at one row, by weight shape (timed in %.2f s): %s; one-row products on "
             "kernels.gemv.gemv_row %s", time.monotonic() - started, "; ".join(lines), ROW_CONFIG)
    return chosen, rows
