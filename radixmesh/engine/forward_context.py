"""One scoped forward context: how attention metadata reaches the layers without threading it through `forward`."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from radixmesh.engine.batch import ForwardBatch, ForwardMode


@dataclass(slots=True)
class ForwardContext:
    batch: ForwardBatch
    backend: Any  # engine.attention.base.AttentionBackend
    metadata: Any  # what backend.plan(batch) returned
    # CUDA events of host -> device page loads (engine.cache.host_pool.KVMover.take_ready): layer l's attention
    # waits for kv_ready[l] before it writes or reads that layer's KV
    kv_ready: list | None = None
    lora: Any = None  # engine.lora.batch.LoraBatch: the adapters of this forward's tokens (None: the base model)

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Any = None) -> torch.Tensor:
        """Attention of this layer; `rope` (engine.layers.rotary.RopeInputs): q and k are not rotated yet, and the
        backend rotates them (with the KV store in one kernel where it can); None: they attend as they are (Cohere 2's
        global layers), contiguous as `forward` takes them."""
        if self.kv_ready is not None:
            torch.cuda.current_stream().wait_event(self.kv_ready[layer_id])
        if rope is None:
            return self.backend.forward(layer_id, q.contiguous(), k.contiguous(), v.contiguous(), self.batch,
                                        self.metadata)
        return self.backend.forward_rope(layer_id, q, k, v, rope, self.batch, self.metadata)

    def pool_rows(self, layer_id: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Where a decode step's latent rows may be stored by the model's own kernel, then attended with
        `attend_written`: the layer's buffer of a latent pool (KVPool.latent_rows) on a backend that attends rows
        already stored; None otherwise. Waits for the layer's page loads first, as `attend` does."""
        if self.batch.mode is not ForwardMode.DECODE or not self.backend.fuses_rope_store:
            return None
        rows = getattr(self.backend.kv_pool, "latent_rows", None)
        buf = rows(layer_id, dtype) if rows is not None else None
        if buf is not None and self.kv_ready is not None:
            torch.cuda.current_stream().wait_event(self.kv_ready[layer_id])
        return buf

    def attend_written(self, layer_id: int, q: torch.Tensor) -> torch.Tensor:
        """Decode attention of this layer once the step's rows are in the pool (after `pool_rows`)."""
        return self.backend.attend_stored(layer_id, q, self.batch, self.metadata)


_current: ContextVar[ForwardContext | None] = ContextVar("radixmesh_forward_context", default=None)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def current_forward_context() -> ForwardContext | None:
    """The forward context in effect, or None outside a forward."""
    return _current.get()


def get_forward_context() -> ForwardContext:
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError("attention called outside a forward context (ModelRunner.forward sets one)")
    return ctx
