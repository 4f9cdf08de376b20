"""Attention in plain PyTorch over the paged KV pool (CPU and CUDA).

Each request's keys are gathered from the pool into a padded [batch, max_kv] layout and queries into
[batch, max_q]; one scaled_dot_product_attention call with a causal-by-position mask covers the whole batch.
Grouped-query attention is folded into the query rows: the `group` query heads that share a KV head become
`group` extra rows of that KV head, so keys are never repeated and the fused (memory-efficient) kernel applies.

An fp8 cache (--kv-cache-dtype fp8_*) is read back in the model's dtype times the layer's K and V scales
(KVPool.read); the tokens of the forward itself attend to their own unrounded keys and values.

Under --enable-deterministic-inference (`rows_alone`, engine.batch_invariant) each query row instead attends alone,
over exactly the keys it sees, all read back from the pool (an fp8 cache's rounded ones too): a row's result is the
same in any batch, and in a prefill as in the decode step of its position.

A sliding window is one more term of the mask (one mask per window the layers use, built once per batch); soft-capped
scores (Gemma 2) and attention sinks (GPT-OSS: a logit per head that weighs no value) have no SDPA kernel, so those
layers compute the scores, cap, mask and softmax (the sink a last column, dropped after it) in plain ops, in
transformers' order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from radixmesh.engine.attention.base import AttentionBackend
from radixmesh.engine.batch import ForwardBatch, ForwardMode


@dataclass(slots=True)
class TorchNativeMetadata:
    kv_indices: torch.Tensor  # [batch, max_kv] KV slots of each request's tokens (padding points at stale slots)
    # window (None: none) -> [batch, 1, max_q * group, max_kv] True where a query row may attend a key
    masks: dict[int | None, torch.Tensor]
    token_to_pad: torch.Tensor | None  # [num_tokens] index into the flat [batch * max_q] query layout (None: decode)
    max_q: int
    token_to_key: torch.Tensor | None = None  # [num_tokens] index into the flat [batch * max_kv] key layout


# cuDNN's SDPA rebuilds its execution plan when shapes change, which cost ~1.5 ms of CPU per call (measured on an
# H200: 50 ms of a 57 ms batch-1 decode step of an 8B model); the memory-efficient kernel takes our mask without that.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"
    supports_sliding_window = True
    supports_softcap = True
    supports_sinks = True
    rows_alone = False  # engine.batch_invariant: each query row attends alone (set by the model runner)

    def plan(self, batch: ForwardBatch) -> TorchNativeMetadata:
        dev = batch.seq_lens.device
        max_kv = max(batch.seq_lens_host)
        max_q = 1 if batch.mode is ForwardMode.DECODE else max(batch.extend_lens_host)
        kv_indices = self.req_to_token.device[batch.req_pool_indices, :max_kv]
        if self.rows_alone:  # (each row's keys follow from its position: no masks, no padded layout)
            return TorchNativeMetadata(kv_indices, {}, None, max_q)
        prefix = batch.seq_lens - batch.extend_lens  # [batch]
        q_pos = prefix[:, None] + torch.arange(max_q, device=dev)  # [batch, max_q]
        # a draft tree's decode rows: the window counts back from each row's position (the span's start plus its
        # depth), not from its table index (kernels.decode_attention)
        last = batch.positions[:, None] if batch.tree_mask is not None else None
        masks = {w: self._mask(q_pos, batch.seq_lens, max_kv, w, last) for w in self.shape.distinct_windows()}
        if batch.tree_mask is not None:
            seen = _tree_visible(batch.tree_mask, max_kv)[:, None, None, :]  # decode rows: [batch, 1, 1, max_kv]
            masks = {w: m & seen for w, m in masks.items()}
        token_to_pad = token_to_key = None
        if batch.mode is not ForwardMode.DECODE:
            starts = batch.extend_lens.cumsum(0) - batch.extend_lens
            offset = torch.arange(batch.batch_size, device=dev) * max_q - starts
            token_to_pad = torch.repeat_interleave(offset, batch.extend_lens, output_size=batch.num_tokens)
            token_to_pad += torch.arange(batch.num_tokens, device=dev)
            if self.kv_pool.k[0].dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # an fp8 cache
                rows = token_to_pad // max_q
                token_to_key = rows * max_kv + q_pos.reshape(-1)[token_to_pad]
        return TorchNativeMetadata(kv_indices, masks, token_to_pad, max_q, token_to_key)

    def _mask(self, q_pos: torch.Tensor, seq_lens: torch.Tensor, max_kv: int, window: int | None,
              last: torch.Tensor | None = None) -> torch.Tensor:
        """[batch, 1, max_q * group, max_kv] True where query row (position q_pos) may attend key j: j <= q_pos,
        and j > q_pos - window under a window (`last` given: j > last - window). Padded query rows (past a request's
        last token) see at least its last key, so no softmax row is all -inf."""
        bsz, max_q = q_pos.shape
        keys = torch.arange(max_kv, device=q_pos.device)[None, None, :]
        mask = keys <= q_pos[:, :, None]  # [batch, max_q, max_kv]
        if window is not None:
            if last is None:
                last = torch.minimum(q_pos, (seq_lens - 1)[:, None])  # padded rows: as the request's last token
            mask &= keys > (last - window)[:, :, None]
        group = self.shape.num_heads // self.shape.num_kv_heads
        if max_q > 1 and group > 1:  # rows ordered (query position, head within group)
            mask = mask[:, :, None, :].expand(-1, -1, group, -1).reshape(bsz, max_q * group, max_kv)
        return mask[:, None]

    def forward(self, layer_id, q, k, v, batch, metadata: TorchNativeMetadata) -> torch.Tensor:
        pool = self.kv_pool
        pool.write(layer_id, batch.out_cache_loc, k, v)
        if self.rows_alone:
            return self._rows_alone(layer_id, q, batch, metadata)
        bsz, max_q = batch.batch_size, metadata.max_q
        num_heads, head_dim = q.shape[1], q.shape[2]
        if metadata.token_to_pad is None:
            q_pad = q.view(bsz, 1, num_heads, head_dim)
        else:
            q_pad = q.new_zeros(bsz * max_q, num_heads, head_dim)
            q_pad[metadata.token_to_pad] = q
            q_pad = q_pad.view(bsz, max_q, num_heads, head_dim)
        kv_heads = self.shape.num_kv_heads
        group = num_heads // kv_heads
        # [batch, max_q, kv_heads, group, head_dim] -> [batch, kv_heads, max_q * group, head_dim]
        rows = q_pad.view(bsz, max_q, kv_heads, group, head_dim).transpose(1, 2).reshape(bsz, kv_heads, -1, head_dim)
        # [batch, max_kv, kv_heads, head_dim], in q's dtype (an fp8 cache is read back to it, times its scales)
        keys, values = pool.read(layer_id, metadata.kv_indices, q.dtype)
        if metadata.token_to_key is not None:  # an fp8 cache: the tokens computed now attend to their own keys and
            # values unrounded, as the Triton extend kernel does (only the cached prefix is read back from fp8)
            keys.view(-1, *keys.shape[2:])[metadata.token_to_key] = k.to(q.dtype)
            values.view(-1, *values.shape[2:])[metadata.token_to_key] = v.to(q.dtype)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        mask = metadata.masks[self.shape.window(layer_id)]
        sinks = self.sinks(layer_id)
        if self.shape.softcap is None and sinks is None:
            with sdpa_kernel(_SDPA_BACKENDS):
                out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=self.shape.scale)
        else:
            if sinks is not None:  # a row (query position, head within group) of KV head g takes head g * group + i's
                sinks = sinks.view(kv_heads, 1, group).expand(-1, max_q, -1).reshape(1, kv_heads, max_q * group, 1)
            out = _plain_attention(rows, keys, values, mask, self.shape.scale, self.shape.softcap, sinks)
        out = out.view(bsz, kv_heads, max_q, group, head_dim).transpose(1, 2).reshape(bsz * max_q, num_heads, head_dim)
        return out if metadata.token_to_pad is None else out[metadata.token_to_pad]


    def _rows_alone(self, layer_id: int, q: torch.Tensor, batch: ForwardBatch,
                    metadata: TorchNativeMetadata) -> torch.Tensor:
        """Each query row (a token at position p) over keys max(0, p - window + 1) .. p of its request, read back
        from the pool, in `_plain_attention`'s order; under engine.batch_invariant's products. (No tree masks: draft
        trees are refused with the flag.)"""
        keys, values = self.kv_pool.read(layer_id, metadata.kv_indices, q.dtype)  # [batch, max_kv, kv_heads, d]
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [batch, kv_heads, max_kv, d]
        window, sinks = self.shape.window(layer_id), self.sinks(layer_id)
        kv_heads = self.shape.num_kv_heads
        group = q.shape[1] // kv_heads
        if sinks is not None:  # row i of KV head g is head g * group + i
            sinks = sinks.view(1, kv_heads, group, 1)
        extends = batch.extend_lens_host if batch.mode is not ForwardMode.DECODE else [1] * batch.batch_size
        out = torch.empty_like(q)
        token = 0
        for b, (seq_len, extend) in enumerate(zip(batch.seq_lens_host, extends)):
            for pos in range(seq_len - extend, seq_len):
                start = 0 if window is None else max(0, pos - window + 1)
                seen = slice(start, pos + 1)
                rows = q[token].view(1, kv_heads, group, -1)
                out[token] = _plain_attention(rows, keys[b:b + 1, :, seen], values[b:b + 1, :, seen], None,
                                              self.shape.scale, self.shape.softcap, sinks).view(q.shape[1:])
                token += 1
        return out


def _tree_visible(tree: torch.Tensor, max_kv: int) -> torch.Tensor:
    """[batch, max_kv] True where a draft tree's decode row sees key j: before its span tree[0], or bit j - tree[0]
    of tree[1] (batch.ForwardBatch.tree_mask)."""
    rel = torch.arange(max_kv, device=tree.device)[None, :] - tree[0][:, None]
    bits = (tree[1][:, None] >> rel.clamp(0, 63)) & 1
    return (rel < 0) | (bits != 0)


def _plain_attention(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention with soft-capped scores and/or sinks, in transformers' order: scores in the model's dtype, capped,
    masked, each row's sink (`sinks` [1, kv_heads, r, 1]) a last column, softmax in float32, the sink's column
    dropped, back to the model's dtype. rows [b, kv_heads, r, d]; keys, values [b, kv_heads, k, d]; mask
    [b, 1, r, k] (None: every key)."""
    scores = torch.matmul(rows, keys.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(scores.dtype).expand(scores.shape[0], -1, -1, -1)], -1)
    probs = scores.softmax(-1, dtype=torch.float32)
    return torch.matmul((probs[..., :-1] if sinks is not None else probs).to(rows.dtype), values)
