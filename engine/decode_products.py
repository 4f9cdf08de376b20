"""Which kernel runs the decode-sized products (up to engine.layers.linear.SKINNY_ROWS rows) on this GPU.

Neither wins everywhere. The 8B shape's products chained in a CUDA graph at one row take 5.29 ms with kernels.gemv
under programmatic dependent launch against 5.61 with cuBLAS on an H100, but 4.36-4.44 against 4.06 on an H200, and
the whole decode step follows (benchmarks/results/NOTES.md, 2026-11-24). With --decode-gemm auto the model runner
times both on the model's own weights before it captures its graphs, and keeps kernels.gemv only when it is clearly
faster, so a close call keeps cuBLAS on every start (the choice changes the products' rounding).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

log = logging.getLogger(__name__)

MARGIN = 0.97  # kernels.gemv must take at most this share of cuBLAS's time
REPLAYS = 5


def _weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights of the model's decode products, in forward order, then the LM head's (or the tied embedding's)."""
    kinds = (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear)
    out = [m.weight for m in model.modules() if isinstance(m, kinds)]
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


def prefer_gemv(model: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode-sized products should run kernels.gemv (--decode-gemm auto): both timed here."""
    from kernels.gemv import gemv

    weights = [w for w in _weights(model) if w.dtype == dtype and w.is_contiguous()]
    if not weights:
        return False
    g = torch.Generator(device=device).manual_seed(0)
    inputs = {k: torch.randn((1, k), device=device, dtype=dtype, generator=g) for k in {w.shape[1] for w in weights}}
    started = time.monotonic()
    cublas = _graph_ms(lambda x, w: F.linear(x, w), weights, inputs)
    ours = _graph_ms(lambda x, w: gemv(x, w, pdl=True), weights, inputs)
    torch.cuda.empty_cache()
    keep = ours <= MARGIN * cublas
    log.info("decode products at one row: kernels.gemv %.3f ms, cuBLAS %.3f ms for the model's %d weights (timed in "
             "%.2f s): %s", ours, cublas, len(weights), time.monotonic() - started,
             "kernels.gemv" if keep else "cuBLAS")
    return keep
