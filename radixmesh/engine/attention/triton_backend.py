"""Attention through the Triton kernels of `kernels/`: paged decode with split-KV and extend over a cached prefix.

Works on CUDA, and on CPU only inside Triton's interpreter (TRITON_INTERPRET=1, for tests). Decode batches can run
in CUDA graphs: the kernels read lengths and table rows from the batch's device tensors, and the split count depends
only on the batch size. A layer's sliding window, the soft-cap, its attention sinks and an fp8 cache's K and V scales
are constants of the model, passed to each launch (so captured with it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixmesh.engine.attention.base import AttentionBackend
from radixmesh.engine.attention.registry import TRITON_MAX_HEAD_DIM
from radixmesh.engine.batch import ForwardBatch, ForwardMode
from radixmesh.kernels.decode_attention import decode_attention, num_kv_splits, partial_buffers
from radixmesh.kernels.extend_attention import extend_attention
from radixmesh.kernels.mla_decode import head_blocks, latent_decode
from radixmesh.kernels.mla_extend import latent_extend
from radixmesh.kernels.runtime import interpreting


@dataclass(slots=True)
class DecodeMetadata:
    num_splits: int
    partials: tuple[torch.Tensor, torch.Tensor] | None  # kernels.decode_attention.partial_buffers


@dataclass(slots=True)
class ExtendMetadata:
    prefix_lens: torch.Tensor  # [batch] int64 tokens already in the pool before this forward
    qo_starts: torch.Tensor  # [batch] int64 first flat token of each request
    max_extend_len: int


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True
    fuses_rope_store = True
    supports_sliding_window = True
    supports_softcap = True
    supports_sinks = True

    def __init__(self, shape, kv_pool, req_to_token):
        super().__init__(shape, kv_pool, req_to_token)
        device = kv_pool.k[0].device
        if device.type != "cuda" and not interpreting():
            raise ValueError("attention_backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for testing); "
                             "use 'torch_native' on CPU")
        if shape.head_dim > TRITON_MAX_HEAD_DIM and shape.value_dim is None and not interpreting():
            raise ValueError(f"attention_backend 'triton' tiles heads of up to {TRITON_MAX_HEAD_DIM} dimensions (and "
                             f"latent caches), this model's heads have {shape.head_dim}; use attention_backend "
                             "'torch_native'")
        self.device = device

    def _decode_metadata(self, bs: int) -> DecodeMetadata:
        s = self.shape
        latent = s.value_dim is not None  # (kernels.mla_decode: a program per 16 query heads, outputs of value_dim)
        splits = num_kv_splits(bs, head_blocks(s.num_heads) if latent else s.num_kv_heads, self.device)
        partials = partial_buffers(bs, s.num_heads, splits, s.value_dim if latent else s.head_dim, self.device) \
            if splits > 1 else None
        return DecodeMetadata(splits, partials)

    def plan(self, batch: ForwardBatch) -> DecodeMetadata | ExtendMetadata:
        if batch.mode is ForwardMode.DECODE:
            return self._decode_metadata(batch.batch_size)
        starts = batch.extend_lens.cumsum(0) - batch.extend_lens
        return ExtendMetadata(batch.seq_lens - batch.extend_lens, starts, max(batch.extend_lens_host))

    def forward(self, layer_id, q, k, v, batch, metadata) -> torch.Tensor:
        pool = self.kv_pool
        pool.write(layer_id, batch.out_cache_loc, k, v)
        if isinstance(metadata, DecodeMetadata):
            return self.attend_stored(layer_id, q, batch, metadata)
        s = self.shape
        if s.value_dim is not None:  # a latent cache: k (= v) holds the new tokens' latents
            return latent_extend(q, k, pool.k[layer_id], s.value_dim, self.req_to_token.table(layer_id),
                                 batch.req_pool_indices, metadata.prefix_lens, batch.extend_lens, metadata.qo_starts,
                                 metadata.max_extend_len, s.scale, kv_scale=pool.k_scale[layer_id])
        return extend_attention(q, k, v, pool.k[layer_id], pool.v[layer_id], self.req_to_token.table(layer_id),
                                batch.req_pool_indices, metadata.prefix_lens, batch.extend_lens, metadata.qo_starts,
                                metadata.max_extend_len, s.scale, window=s.window(layer_id), softcap=s.softcap,
                                k_scale=pool.k_scale[layer_id], v_scale=pool.v_scale[layer_id],
                                sinks=self.sinks(layer_id))

    def attend_stored(self, layer_id, q, batch, metadata: DecodeMetadata) -> torch.Tensor:
        pool, s = self.kv_pool, self.shape
        if s.value_dim is not None:
            return latent_decode(q, pool.k[layer_id], s.value_dim, self.req_to_token.table(layer_id),
                                 batch.req_pool_indices, batch.seq_lens, s.scale, metadata.num_splits,
                                 partials=metadata.partials, kv_scale=pool.k_scale[layer_id], tree=batch.tree_mask)
        return decode_attention(q, pool.k[layer_id], pool.v[layer_id], self.req_to_token.table(layer_id),
                                batch.req_pool_indices, batch.seq_lens, s.scale, metadata.num_splits,
                                partials=metadata.partials, window=s.window(layer_id), softcap=s.softcap,
                                tree=batch.tree_mask, k_scale=pool.k_scale[layer_id], v_scale=pool.v_scale[layer_id],
                                positions=batch.positions, sinks=self.sinks(layer_id))

    # ---- CUDA graphs ----------------------------------------------------------------------------------------
    def init_cuda_graph(self, max_bs: int) -> None:
        """Nothing shared: each captured size owns its small stage-1 scratch (bs * splits stays near constant)."""

    def capture_metadata(self, bs: int, batch: ForwardBatch) -> DecodeMetadata:
        return self._decode_metadata(bs)

    def replay_metadata(self, bs: int, batch: ForwardBatch, metadata: DecodeMetadata) -> None:
        """Lengths and rows are read on the device: nothing to plan on the host."""
