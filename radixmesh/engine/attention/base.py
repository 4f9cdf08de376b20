"""The attention-backend interface.

A backend is built once per runner over the KV pool and the request-to-token table. Per batch, `plan` turns the page
tables into backend metadata (index buffers, masks, kernel plans) once; per layer, `forward` writes the new tokens'
K and V into the pool and attends over every cached token of each request.

Backends that can run inside a captured CUDA graph (decode batches only) set `supports_cuda_graph` and implement the
three graph hooks: `init_cuda_graph` once (static buffers for the largest batch), `capture_metadata` once per
captured batch size (what it returns is baked into that graph), and `replay_metadata` before every replay (host-side
planning only: it may fill the static buffers, never reallocate them).

Beyond plain causal attention a shape may ask for a sliding window per layer, soft-capped scores (Gemma 2/3,
Mistral, Qwen2 windows) and attention sinks (GPT-OSS: a learned logit per head in each softmax's denominator, the
layers' weights handed over once with `attach_sinks`); a backend that does not compute one says so
(`supports_sliding_window`, `supports_softcap`, `supports_sinks`) and is refused for such a model when it is built,
never run without it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from radixmesh.engine.batch import ForwardBatch, ForwardMode
from radixmesh.engine.cache.kv_pool import KVPool
from radixmesh.engine.cache.req_to_token import ReqToTokenPool


@dataclass(frozen=True, slots=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # scores are q.k * scale
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap) before the softmax
    # One entry per layer, or none at all (no layer slides): the query at position p of a layer with window w sees
    # keys at positions p - w < j <= p (itself and the w - 1 before it, transformers' rule); None: every key up to p.
    windows: tuple[int | None, ...] = ()
    # the queries' dtype (the model's), where the KV cache's may differ (an fp8 cache); None: the cache's
    dtype: torch.dtype | None = None
    # a latent KV cache (multi-head latent attention, engine.models.deepseek): one KV head whose value is the leading
    # `value_dim` numbers of its key, in one buffer; backends may return just those numbers of each head's output
    value_dim: int | None = None
    sinks: bool = False  # each layer has a sink per query head (AttentionBackend.attach_sinks gives them)

    def window(self, layer_id: int) -> int | None:
        return self.windows[layer_id] if self.windows else None

    def distinct_windows(self) -> tuple[int | None, ...]:
        """The windows the layers have, each once (None first)."""
        return tuple(sorted(set(self.windows) or {None}, key=lambda w: -1 if w is None else w))


class AttentionBackend(ABC):
    name: str = ""
    supports_cuda_graph: bool = False
    # Decode reads the new tokens' K and V back from the pool (forward() is pool.write, then attend_stored()): so
    # rotary and the KV store can be one kernel (forward_rope).
    fuses_rope_store: bool = False
    supports_sliding_window: bool = False  # honours AttentionShape.windows
    supports_softcap: bool = False  # honours AttentionShape.softcap
    supports_sinks: bool = False  # honours AttentionShape.sinks

    def __init__(self, shape: AttentionShape, kv_pool: KVPool, req_to_token: ReqToTokenPool):
        if any(w is not None for w in shape.windows) and not self.supports_sliding_window:
            raise ValueError(f"attention backend {self.name!r} has no sliding-window attention, which this model's "
                             "layers use; pick another --attention-backend")
        if shape.softcap is not None and not self.supports_softcap:
            raise ValueError(f"attention backend {self.name!r} has no attention logit soft-capping, which this "
                             "model uses; pick another --attention-backend")
        if shape.sinks and not self.supports_sinks:
            raise ValueError(f"attention backend {self.name!r} has no attention sinks, which this model's layers "
                             "use; pick another --attention-backend (triton or torch_native)")
        self.shape = shape
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.layer_sinks: list[torch.Tensor] | None = None  # AttentionShape.sinks: each layer's [heads] (attach_sinks)

    def attach_sinks(self, sinks: list[torch.Tensor]) -> None:
        """Each layer's sinks ([this rank's query heads], the model's weights: fixed addresses, so CUDA graphs read
        them in place), for a shape with `sinks`."""
        self.layer_sinks = sinks

    def sinks(self, layer_id: int) -> torch.Tensor | None:
        """The layer's sinks, or None for a shape without them."""
        return self.layer_sinks[layer_id] if self.shape.sinks else None

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> Any:
        """Build the metadata every layer of this batch uses. Called once per forward, before the first layer."""

    @abstractmethod
    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                metadata: Any) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim].
        Writes k, v into the KV pool at batch.out_cache_loc; returns [num_tokens, num_heads, head_dim]."""

    def forward_rope(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Any,
                     batch: ForwardBatch, metadata: Any) -> torch.Tensor:
        """`forward` with q and k not rotated yet (`rope`: engine.layers.rotary.RopeInputs); k, v may be strided.
        Decode on a backend that `fuses_rope_store` rotates q and k and writes k and v into the pool in one kernel
        where the pool runs kernels (KVPool.write_rotated), then attends."""
        if self.fuses_rope_store and batch.mode is ForwardMode.DECODE:
            q = self.kv_pool.write_rotated(layer_id, batch.out_cache_loc, q, k, v, rope)
            return self.attend_stored(layer_id, q, batch, metadata)
        q, k = rope.apply(q, k)
        return self.forward(layer_id, q, k, v.contiguous(), batch, metadata)

    def attend_stored(self, layer_id: int, q: torch.Tensor, batch: ForwardBatch, metadata: Any) -> torch.Tensor:
        """For a backend that `fuses_rope_store`: decode attention once this step's K and V are in the pool."""
        raise NotImplementedError

    # ---- CUDA graphs (decode) -------------------------------------------------------------------------------
    def init_cuda_graph(self, max_bs: int) -> None:
        """Allocate the static buffers graphs of up to `max_bs` decode requests use."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot run in a CUDA graph")

    def capture_metadata(self, bs: int, batch: ForwardBatch) -> Any:
        """Metadata for the graph of padded batch size `bs`; `batch` holds the graph's static input tensors."""
        raise NotImplementedError

    def replay_metadata(self, bs: int, batch: ForwardBatch, metadata: Any) -> None:
        """Before a replay: `batch`'s device tensors already hold this step's values (padding rows have seq_len 1,
        the padding table row and slot 0); `batch.seq_lens_host` lists all `bs` lengths, padding included."""
        raise NotImplementedError
