"""A forward's LoRA adapters as its projections apply them: each row's device slot (-1: the base model), and on
CUDA the rows grouped by slot for the Triton kernels (kernels.lora); on CPU the plain-torch twin, cut to each
adapter's rank (peft's arithmetic exactly)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixmesh.engine.layers.triton_ops import use_kernels
from radixmesh.engine.lora.stacks import ModuleLora, SlotStacks


@dataclass(slots=True)
class LoraBatch:
    slots: torch.Tensor  # [tokens] int32 on the model's device: each token's slot, -1 for the base model
    stacks: SlotStacks
    layout: object | None  # kernels.lora.LoraLayout of `slots` where the kernels run; None: the twin runs

    @classmethod
    def build(cls, slots: torch.Tensor, stacks: SlotStacks) -> "LoraBatch":
        """The batch of tokens whose slots are `slots` (device ops only: a CUDA graph captures them)."""
        layout = None
        if use_kernels(slots):
            from radixmesh.kernels.lora import lora_layout

            layout = lora_layout(slots, stacks.flat.shape[0])
        return cls(slots, stacks, layout)

    def apply(self, module: ModuleLora, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` ([tokens, N], the module's product of x [tokens, K]) with each token's adapter added, in place."""
        s = self.stacks
        if self.layout is not None:
            from radixmesh.kernels.lora import lora_apply

            return lora_apply(x, module.a, module.b, s.scalings, self.layout, module.slices, out)
        from radixmesh.kernels.lora import lora_apply_reference

        return lora_apply_reference(x, module.a, module.b, s.scalings, self.slots, module.slices, out, s.ranks)
