"""Loaded LoRA adapters on the model's device, and their part in a forward.

Every loaded adapter holds a slot (1 .. max_loaded; slot 0 is the base model) of per-projection weight stacks on
the device: for each fused projection (q/k/v, gate/up) and each plain one (o, down), A [slots, max_rank, in] and B
[slots, out, max_rank] per peft projection, zero past an adapter's rank. A request names its adapter; its tokens
carry the slot, and each adapted projection adds, per run of consecutive tokens of one adapter (a batch's
requests are contiguous), (x A^T) B^T * scaling to its output slice, with A and B cut to the adapter's own rank: in
float32 exactly peft's arithmetic. This is the plain-torch path (one product pair per run and projection); CUDA
graphs are off while LoRA is enabled.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch
from torch import nn

from radixmesh.engine.lora.adapter import PROJECTIONS, load_adapter, projection_shapes
from radixmesh.engine.model_config import ModelConfig

log = logging.getLogger(__name__)

# our fused modules: attribute path in a decoder layer -> the peft projections it holds, in output order
FUSED = {("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"), ("self_attn", "o_proj"): ("o_proj",),
         ("mlp", "gate_up_proj"): ("gate_proj", "up_proj"), ("mlp", "down_proj"): ("down_proj",)}


class ModuleLora:
    """One fused projection's adapter weights: for each peft projection in it, its output slice and weight stacks."""

    def __init__(self, parts: dict[str, slice], fan_in: int, slots: int, rank: int, device: torch.device,
                 dtype: torch.dtype):
        self.parts = parts
        self.a = {p: torch.zeros((slots, rank, fan_in), dtype=dtype, device=device) for p in parts}
        self.b = {p: torch.zeros((slots, s.stop - s.start, rank), dtype=dtype, device=device) for p, s in parts.items()}


@dataclass(slots=True)
class LoraBatch:
    """A forward's adapters: runs (first token, end token, slot) of tokens of one adapter (slot 0 runs left out)."""

    runs: list[tuple[int, int, int]]
    manager: "LoraManager"

    def apply(self, module: ModuleLora, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        m = self.manager
        for start, end, slot in self.runs:
            rank, scaling, targets = m.ranks[slot], m.scalings[slot], m.targets[slot]
            xs = x[start:end]
            for proj, where in module.parts.items():
                if proj in targets:
                    a, b = module.a[proj][slot, :rank], module.b[proj][slot, :, :rank]
                    out[start:end, where] += (xs @ a.T) @ b.T * scaling
        return out


class LoraManager:
    """Adapters by name in `max_loaded` device slots, attached to `model`'s projections (`module.lora`)."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, max_loaded: int, max_rank: int,
                 targets: frozenset[str] | None, device: torch.device, dtype: torch.dtype):
        self.cfg, self.max_rank, self.allowed = cfg, max_rank, targets
        self.max_loaded = max_loaded
        slots = max_loaded + 1
        self.by_name: dict[str, int] = {}
        self.in_use = [0] * slots  # requests made and not finished, per slot (acquire / release)
        self._lock = threading.Lock()
        self.ranks = [0] * slots
        self.scalings = [0.0] * slots
        self.targets: list[frozenset[str]] = [frozenset()] * slots
        shapes = projection_shapes(cfg)
        self.modules: dict[tuple[int, str], ModuleLora] = {}  # (layer, peft projection) -> the module holding it
        for i, layer in enumerate(model.model.layers):
            for (block, attr), projs in FUSED.items():
                linear = getattr(getattr(layer, block), attr)
                parts, at = {}, 0
                for p in projs:
                    width = shapes[p][1]
                    parts[p] = slice(at, at + width)
                    at += width
                if at != linear.weight.shape[0]:
                    raise ValueError("LoRA needs the whole model on one device (tensor parallelism is not supported "
                                     "with --enable-lora yet)")
                linear.lora = ModuleLora(parts, linear.weight.shape[1], slots, max_rank, device, dtype)
                for p in projs:
                    self.modules[(i, p)] = linear.lora

    def load(self, name: str, path: str) -> None:
        """Read, check and place adapter `path` as `name` (ValueError, nothing loaded, when it cannot be)."""
        if name in self.by_name:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        free = sorted(set(range(1, self.max_loaded + 1)) - set(self.by_name.values()))
        if not free:
            raise ValueError(f"{self.max_loaded} LoRA adapters are loaded (--max-loaded-loras): unload one first")
        adapter = load_adapter(name, path, self.cfg, self.max_rank, self.allowed)
        slot = free[0]
        for key, module in self.modules.items():
            proj = key[1]
            module.a[proj][slot].zero_()
            module.b[proj][slot].zero_()
            if key in adapter.weights:
                a, b = adapter.weights[key]
                module.a[proj][slot, :adapter.rank].copy_(a)
                module.b[proj][slot, :, :adapter.rank].copy_(b)
        self.ranks[slot], self.scalings[slot] = adapter.rank, adapter.scaling
        self.targets[slot] = adapter.targets
        with self._lock:
            self.by_name[name] = slot
        log.info("LoRA adapter %s loaded from %s (rank %d, %s) in slot %d", name, path, adapter.rank,
                 ", ".join(sorted(adapter.targets)), slot)

    def unload(self, name: str) -> None:
        """Free adapter `name`'s slot (ValueError while requests made for it have not finished)."""
        with self._lock:
            slot = self.by_name.get(name)
            if slot is None:
                raise ValueError(f"no LoRA adapter named {name!r} is loaded")
            if self.in_use[slot]:
                raise ValueError(f"LoRA adapter {name!r} serves {self.in_use[slot]} unfinished request(s): unload "
                                 "it once they finish")
            del self.by_name[name]
        self.ranks[slot], self.scalings[slot] = 0, 0.0
        self.targets[slot] = frozenset()
        log.info("LoRA adapter %s unloaded", name)

    def acquire(self, name: str) -> int:
        """The slot of adapter `name` for a new request, held until `release` (unload waits for none to hold it)."""
        with self._lock:
            slot = self.slot(name)
            self.in_use[slot] += 1
            return slot

    def release(self, slot: int) -> None:
        with self._lock:
            self.in_use[slot] -= 1

    def slot(self, name: str | None) -> int:
        """The slot of adapter `name` (0: the base model), ValueError for a name not loaded."""
        if name is None:
            return 0
        slot = self.by_name.get(name)
        if slot is None:
            loaded = ", ".join(sorted(self.by_name)) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {loaded})")
        return slot

    def names(self) -> list[str]:
        return sorted(self.by_name)

    def batch(self, slots: list[int], lens: list[int]) -> LoraBatch | None:
        """The runs of a forward whose request i has `lens[i]` tokens of adapter slot `slots[i]`."""
        runs: list[tuple[int, int, int]] = []
        at = 0
        for slot, n in zip(slots, lens):
            if slot and n:
                if runs and runs[-1][2] == slot and runs[-1][1] == at:
                    runs[-1] = (runs[-1][0], at + n, slot)
                else:
                    runs.append((at, at + n, slot))
            at += n
        return LoraBatch(runs, self) if runs else None


assert set(p for projs in FUSED.values() for p in projs) == set(PROJECTIONS)
