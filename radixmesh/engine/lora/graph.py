"""LoRA in CUDA graphs: each decode row's device slot lives in a static buffer that the captured forward reads (its
grouping of rows by slot is captured too), so one graph per batch size serves whatever adapters a batch mixes; rows
past the batch (padding) and batches without adapters read -1, the base model."""

from __future__ import annotations

import torch

from radixmesh.engine.batch import ForwardBatch
from radixmesh.engine.layers.triton_ops import use_kernels
from radixmesh.engine.lora.batch import LoraBatch


class GraphLora:
    def __init__(self, manager, max_bs: int, device: torch.device):
        """`manager`: the engine.lora.manager.LoraManager whose slots the graphs read."""
        self.manager = manager
        self.slots = torch.full((max_bs,), -1, dtype=torch.int32, device=device)
        self._filled = 0  # rows that may hold a slot other than -1

    def batch(self, bs: int) -> LoraBatch:
        """The LoRA batch a graph of `bs` rows captures (built inside the capture: its grouping is replayed)."""
        return LoraBatch.build(self.slots[:bs], self.manager.stacks)

    def fill(self, batch: ForwardBatch) -> None:
        """Before a graph replays `batch`: its adapters placed in their slots (copied in where needed), each row's
        slot written to the static buffer, -1 past the batch."""
        bs = batch.batch_size
        if batch.lora_slots is None:
            if self._filled:
                self.slots[:self._filled].fill_(-1)
                self._filled = 0
            return
        rows = self.manager.token_slots(batch.lora_slots, batch.extend_lens_host)
        self.slots[:bs].copy_(rows, non_blocking=True)
        if self._filled > bs:
            self.slots[bs:self._filled].fill_(-1)
        self._filled = bs


def graphs_supported(device: torch.device) -> bool:
    """Whether a CUDA graph can hold LoRA on `device`: its kernels run there (the twin reads slots on the host)."""
    return use_kernels(torch.empty(0, device=device))
