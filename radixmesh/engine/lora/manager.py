"""Loaded LoRA adapters, and their part in a forward.

Every loaded adapter (--max-loaded-loras of them) has an id (1 .. max_loaded; 0 is the base model), which its
requests carry (`Req.lora_slot`, `ForwardBatch.lora_slots`), and its weights packed in host memory (pinned on CUDA).
The device holds --max-loras-per-batch slots of weight stacks (engine.lora.stacks); before a forward, the adapters
its requests use are placed in slots (engine.lora.pool: copied in where they are not, over the least recently used
adapter no admitted request uses), and each token carries its slot to the projections (engine.lora.batch). The
planner runs at most --max-loras-per-batch adapters at once, so a batch always finds its slots.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from radixmesh.engine.lora.adapter import load_adapter
from radixmesh.engine.lora.batch import LoraBatch
from radixmesh.engine.lora.pool import SlotPool
from radixmesh.engine.lora.stacks import SlotStacks
from radixmesh.engine.model_config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class HostAdapter:
    name: str
    row: torch.Tensor  # the packed weights (SlotStacks.pack), host memory
    rank: int
    scaling: float


class LoraManager:
    """Adapters by name, `max_loaded` of them in host memory, `device_slots` at once on the model's device."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, max_loaded: int, max_rank: int,
                 targets: frozenset[str] | None, device: torch.device, dtype: torch.dtype, device_slots: int):
        if cfg.mla is not None:
            raise ValueError(f"LoRA adapters of {cfg.architecture} (multi-head latent attention: q_a_proj, "
                             "kv_a_proj_with_mqa, kv_b_proj, ...) are not implemented by radixmesh yet; serve it "
                             "without --enable-lora")
        self.cfg, self.max_rank, self.allowed = cfg, max_rank, targets
        self.max_loaded = max_loaded
        self.device = device
        self.by_name: dict[str, int] = {}
        self.host: dict[int, HostAdapter] = {}
        self.in_use = [0] * (max_loaded + 1)  # requests made and not finished, per adapter id (acquire / release)
        self._lock = threading.Lock()
        device_slots = min(device_slots, max_loaded)  # more could never be used
        self.stacks = SlotStacks(model, cfg, device_slots, max_rank, device, dtype, targets)
        self.pool = SlotPool(device_slots)
        # the adapter ids of admitted (prefilling or running) requests; the engine sets it. Unset: those of
        # unfinished requests (waiting ones too)
        self.admitted: Callable[[], Iterable[int]] | None = None
        # the tensor-parallel leader's journal (engine.model_runner): each load and unload is replayed by the other
        # ranks before their next forward, each packing its own shard of the adapter. Their slot placements need not
        # match the leader's: a rank's forward reads its own slots
        self.journal: list[tuple] | None = None

    # ---- loading (the scheduler's thread) ------------------------------------------------------------------------
    def load(self, name: str, path: str) -> None:
        """Read, check and pack adapter `path` as `name` (ValueError, nothing loaded, when it cannot be)."""
        if name in self.by_name:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        free = sorted(set(range(1, self.max_loaded + 1)) - set(self.by_name.values()))
        if not free:
            raise ValueError(f"{self.max_loaded} LoRA adapters are loaded (--max-loaded-loras): unload one first")
        adapter = load_adapter(name, path, self.cfg, self.max_rank, self.allowed)
        row = self.stacks.pack(adapter, pin=self.device.type == "cuda")
        ident = free[0]
        self.host[ident] = HostAdapter(name, row, adapter.rank, adapter.scaling)
        with self._lock:
            self.by_name[name] = ident
        if self.journal is not None:
            self.journal.append(("lora_load", name, path))
        log.info("LoRA adapter %s loaded from %s (rank %d, %s) as %d", name, path, adapter.rank,
                 ", ".join(sorted(adapter.targets)), ident)

    def unload(self, name: str) -> None:
        """Forget adapter `name` (ValueError while requests made for it have not finished)."""
        with self._lock:
            ident = self.by_name.get(name)
            if ident is None:
                raise ValueError(f"no LoRA adapter named {name!r} is loaded")
            if self.in_use[ident]:
                raise ValueError(f"LoRA adapter {name!r} serves {self.in_use[ident]} unfinished request(s): unload "
                                 "it once they finish")
            del self.by_name[name]
        self.pool.drop(ident)
        del self.host[ident]
        if self.journal is not None:
            self.journal.append(("lora_unload", name))
        log.info("LoRA adapter %s unloaded", name)

    # ---- requests (any thread) -----------------------------------------------------------------------------------
    def acquire(self, name: str) -> int:
        """The id of adapter `name` for a new request, held until `release` (unload waits for none to hold it)."""
        with self._lock:
            ident = self.slot(name)
            self.in_use[ident] += 1
            return ident

    def release(self, ident: int) -> None:
        with self._lock:
            self.in_use[ident] -= 1

    def slot(self, name: str | None) -> int:
        """The id of adapter `name` (0: the base model), ValueError for a name not loaded."""
        if name is None:
            return 0
        ident = self.by_name.get(name)
        if ident is None:
            loaded = ", ".join(sorted(self.by_name)) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {loaded})")
        return ident

    def names(self) -> list[str]:
        return sorted(self.by_name)

    # ---- forwards (the scheduler's thread) -----------------------------------------------------------------------
    def token_slots(self, ids: list[int], lens: list[int]) -> torch.Tensor:
        """Each token's device slot (int32 on the host, pinned on CUDA; -1: the base model) for a forward whose
        request i has `lens[i]` tokens of adapter `ids[i]`; the adapters are placed in their slots first."""
        needed = sorted(set(ids) - {0})
        placement = self.pool.place(needed, self._admitted)
        for ident, slot in placement.loads:
            adapter = self.host[ident]
            self.stacks.place(slot, adapter.row, adapter.rank, adapter.scaling)
        where = placement.slots
        per_request = torch.tensor([where[i] if i else -1 for i in ids], dtype=torch.int32)
        if any(n != 1 for n in lens):
            per_request = per_request.repeat_interleave(torch.tensor(lens))
        return per_request.pin_memory() if self.device.type == "cuda" else per_request

    def batch(self, ids: list[int] | None, lens: list[int]) -> LoraBatch | None:
        """The LoRA batch of an eager forward (None when every request runs the base model)."""
        if ids is None or not any(ids):
            return None
        rows = self.token_slots(ids, lens)
        return LoraBatch.build(rows.to(self.device, non_blocking=True), self.stacks)

    def _admitted(self) -> list[int]:
        if self.admitted is not None:
            return [i for i in self.admitted() if i]
        with self._lock:
            return [i for i, n in enumerate(self.in_use) if n and i]

    def tensors(self) -> list[torch.Tensor]:
        """The device memory it holds (released when the engine shuts down)."""
        return self.stacks.tensors()
