"""A forward's LoRA adapters as its projections apply them: each row's device slot (-1: the base model), and on
CUDA the rows grouped by slot for the Triton kernels (kernels.lora); on CPU the plain-torch twin, cut to each
adapter's rank (peft's arithmetic exactly).

On CUDA a projection's shrink (x A^T, which needs only x) runs on a second stream beside the base product, and the
expand joins the two: in a captured graph the shrink becomes a branch beside the product instead of a kernel on the
step's critical path, where the LoRA kernels are latency-bound chains (H100, 8B shape, 8 adapters at batch 64: +11.8%
over the base step with it, +23.6% without; benchmarks/results/NOTES.md, 2026-12-06). RADIXMESH_LORA_SIDE_STREAM=0
keeps every kernel on the one stream. The shrink's partial sums are
allocated on the side stream and freed after the expand; the next shrink on that stream waits for the main stream
first, so nothing is reused while read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from radixmesh.engine.layers.triton_ops import use_kernels
from radixmesh.engine.lora.stacks import ModuleLora, SlotStacks


SIDE_STREAM_ENV = "RADIXMESH_LORA_SIDE_STREAM"
_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream shrinks run on beside the base products (module docstring), one per device; None: turned off, or
    not CUDA."""
    if os.environ.get(SIDE_STREAM_ENV, "1") == "0" or device.type != "cuda":
        return None
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


@dataclass(slots=True)
class LoraBatch:
    slots: torch.Tensor  # [tokens] int32 on the model's device: each token's slot, -1 for the base model
    stacks: SlotStacks
    layout: object | None  # kernels.lora.LoraLayout of `slots` where the kernels run; None: the twin runs
    side: torch.cuda.Stream | None = None  # where the kernels' shrinks run beside the base products (or not)

    @classmethod
    def build(cls, slots: torch.Tensor, stacks: SlotStacks) -> "LoraBatch":
        """The batch of tokens whose slots are `slots` (device ops only: a CUDA graph captures them)."""
        layout = None
        if use_kernels(slots):
            from radixmesh.kernels.lora import lora_layout

            layout = lora_layout(slots, stacks.flat.shape[0])
        return cls(slots, stacks, layout, side_stream(slots.device) if layout is not None else None)

    def project(self, module: ModuleLora, x: torch.Tensor, base: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The module's product of x (`base()`) with each token's adapter added; with a side stream the shrink runs
        there beside the product (module docstring)."""
        if self.side is None:
            return self.apply(module, x, base())
        from radixmesh.kernels.lora import lora_expand, lora_shrink

        main = torch.cuda.current_stream(x.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            partials = lora_shrink(x, module.a, self.layout)
        out = base()
        main.wait_stream(self.side)
        return lora_expand(partials, module.b, self.stacks.scalings, self.layout, module.slices, out)

    def apply(self, module: ModuleLora, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` ([tokens, N], the module's product of x [tokens, K]) with each token's adapter added, in place."""
        s = self.stacks
        if self.layout is not None:
            from radixmesh.kernels.lora import lora_apply

            return lora_apply(x, module.a, module.b, s.scalings, self.layout, module.slices, out)
        from radixmesh.kernels.lora import lora_apply_reference

        return lora_apply_reference(x, module.a, module.b, s.scalings, self.slots, module.slices, out, s.ranks)
