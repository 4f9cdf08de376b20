"""Weights pulled into L2 on a side stream while the memory bus would idle (decode CUDA graphs).

In a small decode step each layer streams its weights once, and between the q/k/v product and the o_proj product
the bus idles while rotary, the KV store and attention run. `WeightPrefetch.start` forks a side stream there that
reads the o_proj weight (kernels.l2_prefetch), and `join` brings it back after o_proj, so a captured graph has the
read as a branch running beside attention. Outputs do not change: the branch only reads.
"""

from __future__ import annotations

import torch

from kernels.l2_prefetch import pull_into_l2


class WeightPrefetch:
    def __init__(self, device: torch.device, mode: str = "load", programs: int = 64):
        self.stream = torch.cuda.Stream(device)
        self.sums = torch.empty(programs, dtype=torch.float32, device=device)
        self.mode = mode

    def start(self, weight: torch.Tensor) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            pull_into_l2(weight, self.sums, self.mode)

    def join(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)
