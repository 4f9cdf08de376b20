"""A CUDA-graph check the kernel tests share."""

from __future__ import annotations

from typing import Callable

import torch


def assert_pdl_graph_equals_eager(run: Callable[[bool], torch.Tensor], replays: int = 3) -> torch.Tensor:
    """`run(pdl)` launched eagerly without programmatic dependent launch, then captured with it in a CUDA graph (after
    a launch that compiles outside the capture) and replayed `replays` times: each replay bit for bit the eager
    result, which is returned."""
    eager = run(False)
    graph = torch.cuda.CUDAGraph()
    run(True)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = run(True)
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    return eager
