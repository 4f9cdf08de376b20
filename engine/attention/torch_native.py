"""Attention in plain PyTorch over the paged KV pool (CPU and CUDA).

Each request's keys are gathered from the pool into a padded [batch, max_kv] layout and queries into
[batch, max_q]; one scaled_dot_product_attention call with a causal-by-position mask covers the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.batch import ForwardBatch, ForwardMode


@dataclass(slots=True)
class TorchNativeMetadata:
    kv_indices: torch.Tensor  # [batch, max_kv] KV slots of each request's tokens (padding points at stale slots)
    mask: torch.Tensor  # [batch, 1, max_q, max_kv] True where query may attend key
    token_to_pad: torch.Tensor | None  # [num_tokens] index into the flat [batch * max_q] query layout (None: decode)
    max_q: int


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"

    def plan(self, batch: ForwardBatch) -> TorchNativeMetadata:
        dev = batch.seq_lens.device
        max_kv = max(batch.seq_lens_host)
        max_q = 1 if batch.mode is ForwardMode.DECODE else max(batch.extend_lens_host)
        kv_indices = self.req_to_token.device[batch.req_pool_indices, :max_kv]
        prefix = batch.seq_lens - batch.extend_lens  # [batch]
        q_pos = prefix[:, None] + torch.arange(max_q, device=dev)  # [batch, max_q]
        # Padded query rows get q_pos >= 0, so key 0 stays visible and no softmax row is all -inf.
        mask = torch.arange(max_kv, device=dev)[None, None, :] <= q_pos[:, :, None]
        token_to_pad = None
        if batch.mode is not ForwardMode.DECODE:
            starts = batch.extend_lens.cumsum(0) - batch.extend_lens
            offset = torch.arange(batch.batch_size, device=dev) * max_q - starts
            token_to_pad = torch.repeat_interleave(offset, batch.extend_lens, output_size=batch.num_tokens)
            token_to_pad += torch.arange(batch.num_tokens, device=dev)
        return TorchNativeMetadata(kv_indices, mask[:, None], token_to_pad, max_q)

    def forward(self, layer_id, q, k, v, batch, metadata: TorchNativeMetadata) -> torch.Tensor:
        pool = self.kv_pool
        pool.write(layer_id, batch.out_cache_loc, k, v)
        bsz, max_q = batch.batch_size, metadata.max_q
        num_heads, head_dim = q.shape[1], q.shape[2]
        if metadata.token_to_pad is None:
            q_pad = q.view(bsz, 1, num_heads, head_dim)
        else:
            q_pad = q.new_zeros(bsz * max_q, num_heads, head_dim)
            q_pad[metadata.token_to_pad] = q
            q_pad = q_pad.view(bsz, max_q, num_heads, head_dim)
        keys = pool.k[layer_id][metadata.kv_indices].transpose(1, 2)  # [batch, kv_heads, max_kv, head_dim]
        values = pool.v[layer_id][metadata.kv_indices].transpose(1, 2)
        out = F.scaled_dot_product_attention(q_pad.transpose(1, 2), keys, values, attn_mask=metadata.mask,
                                             scale=self.shape.scale, enable_gqa=num_heads != keys.shape[1])
        out = out.transpose(1, 2).reshape(bsz * max_q, num_heads, head_dim)
        return out if metadata.token_to_pad is None else out[metadata.token_to_pad]
