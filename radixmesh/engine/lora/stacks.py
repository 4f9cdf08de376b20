"""LoRA weights in device slots: one flat buffer row per slot holding an adapter's A and B for every adapted module,
and the per-module views the projections read (`linear.lora`, a ModuleLora).

A slot's row holds, module after module in model order, A [P * R, K] then B [N, R]: the module fuses P peft
projections (q/k/v: 3, gate/up: 2, o and down: 1), R is --max-lora-rank, K the module's input and N its output
features. An adapter is packed once into a host row of the same layout (pinned on CUDA) when it is loaded, so placing
it in a slot is one copy, and the buffer never moves: a CUDA graph captured once reads whichever adapter a slot holds.
A's rows past an adapter's rank, B's columns past it and the projections it does not adapt are zero: they add nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from radixmesh.engine.lora.adapter import PROJECTIONS, LoraAdapter, adaptable
from radixmesh.engine.model_config import ModelConfig

# our fused modules: attribute path in a decoder layer -> the peft projections it holds, in output order
FUSED = {("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"), ("self_attn", "o_proj"): ("o_proj",),
         ("mlp", "gate_up_proj"): ("gate_proj", "up_proj"), ("mlp", "down_proj"): ("down_proj",)}
assert set(p for projs in FUSED.values() for p in projs) == set(PROJECTIONS)


def _rank_parts(linear: nn.Module, projs: tuple[str, ...]
                ) -> tuple[dict[str, slice], dict[str, tuple[int, int, int]]]:
    """(each peft projection's output columns in `linear`, this rank's cut of its adapter), from the rows (or, in a
    row-parallel layer, the input columns) of each projection the tensor-parallel layer holds (`lora_parts`)."""
    held = linear.lora_parts()
    if None in held:  # a row-parallel layer: every output row, this rank's input columns
        (p,) = projs
        return {p: slice(0, linear.weight.shape[0])}, {p: (1, held[None].start, held[None].length)}
    return ({p: held[p].dest for p in projs}, {p: (0, held[p].start, held[p].length) for p in projs})


class ModuleLora:
    """One fused projection's adapter weights in every slot: views of the slot buffer."""

    def __init__(self, parts: dict[str, slice], a: torch.Tensor, b: torch.Tensor):
        self.parts = parts  # peft projection -> its output columns
        self.slices = tuple((s.start, s.stop - s.start) for s in parts.values())  # (start, width) in output order
        self.a = a  # [slots, P * R, K]: projection p's A in rows p * R .. p * R + rank
        self.b = b  # [slots, N, R]


@dataclass(frozen=True, slots=True)
class _Entry:
    """Where one module's weights sit in a slot's row."""

    layer: int
    parts: dict[str, slice]
    fan_in: int
    fan_out: int
    offset: int  # of A; B follows it
    # this tensor-parallel rank's cut of each projection's adapter: (dim of the weight, start, length), dim 0: the
    # output rows (a column-parallel module: B's rows), 1: the input columns (a row-parallel one: A's columns)
    cuts: dict[str, tuple[int, int, int]]

    def views(self, rows: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A [n, P * R, K] and B [n, N, R] of `rows` [n, slot size]."""
        a_size = len(self.parts) * rank * self.fan_in
        a = rows[:, self.offset:self.offset + a_size].view(-1, len(self.parts) * rank, self.fan_in)
        b_end = self.offset + a_size + self.fan_out * rank
        return a, rows[:, self.offset + a_size:b_end].view(-1, self.fan_out, rank)


class SlotStacks:
    """`slots` device slots of adapter weights attached to `model`'s projections (those holding one of `targets`,
    None: all), with each slot's scaling (on the device, float32, read by the kernels) and rank (on the host, read
    by the plain-torch twin)."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, slots: int, rank: int, device: torch.device,
                 dtype: torch.dtype, targets: frozenset[str] | None = None):
        self.rank, self.dtype = rank, dtype
        self.entries: list[_Entry] = []
        self.where: dict[tuple[int, str], tuple[_Entry, int]] = {}  # (layer, peft projection) -> module, its part
        size = 0
        linears = []
        for i, layer in enumerate(model.model.layers):
            for (block, attr), projs in FUSED.items():
                if targets is not None and not targets & set(projs):
                    continue  # no adapter may adapt it (--lora-target-modules): it runs no LoRA kernels
                if not adaptable(cfg, i, projs[0]):
                    continue  # a mixture of experts' sparse layer: its MLP is the experts
                linear = getattr(getattr(layer, block), attr)
                parts, cuts = _rank_parts(linear, projs)
                at = linear.weight.shape[0]
                entry = _Entry(i, parts, linear.weight.shape[1], at, size, cuts)
                size += (len(projs) * linear.weight.shape[1] + at) * rank
                self.entries.append(entry)
                linears.append(linear)
                for j, p in enumerate(projs):
                    self.where[(i, p)] = (entry, j)
        self.size = size
        self.flat = torch.zeros((slots, size), dtype=dtype, device=device)  # never reallocated (CUDA graphs)
        self.scalings = torch.zeros(slots, dtype=torch.float32, device=device)
        self.ranks = [0] * slots
        for entry, linear in zip(self.entries, linears):
            linear.lora = ModuleLora(entry.parts, *entry.views(self.flat, rank))

    def pack(self, adapter: LoraAdapter, pin: bool) -> torch.Tensor:
        """The adapter as one slot's row [size] on the host in the model's dtype (pinned when `pin`)."""
        row = torch.zeros((1, self.size), dtype=self.dtype, pin_memory=pin)
        r = adapter.rank
        for key, (a, b) in adapter.weights.items():
            entry, part = self.where[key]
            dim, start, length = entry.cuts[key[1]]
            a, b = (a, b[start:start + length]) if dim == 0 else (a[:, start:start + length], b)
            a_view, b_view = entry.views(row, self.rank)
            a_view[0, part * self.rank:part * self.rank + r].copy_(a)
            b_view[0, entry.parts[key[1]], :r].copy_(b)
        return row[0]

    def place(self, slot: int, row: torch.Tensor, rank: int, scaling: float) -> None:
        """Copy a packed adapter into `slot` (stream-ordered after the forwards queued before: one that still reads
        the slot's previous adapter reads it whole)."""
        self.flat[slot].copy_(row, non_blocking=True)
        self.scalings[slot].fill_(scaling)
        self.ranks[slot] = rank

    def tensors(self) -> list[torch.Tensor]:
        return [self.flat, self.scalings]
