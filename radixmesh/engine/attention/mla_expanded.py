"""Multi-head latent attention's prefill in its expanded form: each head's keys and values rebuilt from the cached
latents through kv_b_proj, then ordinary causal attention (engine.models.deepseek computes decode, and by default
prefill too, in the latent space).

Per pair of query and key and per head, the latent form multiplies over the latent and its rotated part for the score
(kv_lora_rank + qk_rope_head_dim: 576 numbers for DeepSeek-V3) and over the latent again for the output (512): 1,088
products. The expanded form multiplies over qk_head_dim (192) and v_head_dim (128, padded here to 192 so that one
kernel takes both): 384. It pays for rebuilding each context token's keys and values first (kv_lora_rank x
(qk_nope_head_dim + v_head_dim) products a head and token), so it is chosen per batch where the pairs' saving
outweighs that (`pays`): a prompt of more than ~190 new tokens. The latents stay what the cache holds (written
once, as in the latent form); new tokens attend to their own latents unrounded, an fp8 cache's prefix is read back
times its scale, as the latent kernels do.

`RADIXMESH_MLA_PREFILL`: `latent` (the default until a GPU measures the expanded form), `expanded` (always, for
every extend batch without a draft tree), `auto` (where `pays`).
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F

from radixmesh.engine.batch import ForwardBatch, ForwardMode

MODES = ("latent", "expanded", "auto")


def mode() -> str:
    value = os.environ.get("RADIXMESH_MLA_PREFILL", "latent")
    if value not in MODES:
        raise ValueError(f"RADIXMESH_MLA_PREFILL must be one of {', '.join(MODES)}, got {value!r}")
    return value


def pays(batch: ForwardBatch, rank: int, rope: int, nope: int, v_dim: int) -> bool:
    """Whether the expanded form multiplies less than the latent form over this batch's requests (per head)."""
    saved = (rank + rope) + rank - 2 * (nope + rope)  # per query-key pair (values padded to qk_head_dim)
    pairs = sum(n * s for n, s in zip(batch.extend_lens_host, batch.seq_lens_host))
    return pairs * saved > sum(batch.seq_lens_host) * rank * (nope + v_dim)


def wanted(batch: ForwardBatch, rank: int, rope: int, nope: int, v_dim: int) -> bool:
    """Whether this forward's prefill runs in the expanded form (module docstring)."""
    if batch.mode is not ForwardMode.EXTEND or batch.tree_mask is not None:
        return False
    how = mode()
    return how == "expanded" or (how == "auto" and pays(batch, rank, rope, nope, v_dim))


def expanded_attention(ctx, layer_id: int, q: torch.Tensor, key: torch.Tensor, rank: int,
                       expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """q [n, heads, nope + rope] (the rope part rotated), key [n, 1, rank + rope] (the new tokens' latents and
    rotated key parts, what the cache holds); `expand(latents [m, rank])` -> (k_nope [m, heads, nope], v [m, heads,
    v_dim]). Writes the new latents into the pool, then attends each request's new tokens over its whole context
    (`ctx`: engine.forward_context.ForwardContext). Returns [n, heads, v_dim]."""
    backend, batch = ctx.backend, ctx.batch
    if ctx.kv_ready is not None:  # (host loads of this layer's pages: as ForwardContext.attend waits)
        torch.cuda.current_stream().wait_event(ctx.kv_ready[layer_id])
    pool = backend.kv_pool
    pool.write(layer_id, batch.out_cache_loc, key, key)
    table = backend.req_to_token.table(layer_id)
    heads, qk = q.shape[1], q.shape[2]
    outs, start = [], 0
    for b, (new, total) in enumerate(zip(batch.extend_lens_host, batch.seq_lens_host)):
        mine = key[start:start + new, 0]
        prefix = total - new
        if prefix:
            slots = table[batch.req_pool_indices[b], :prefix]
            cached, _ = pool.read(layer_id, slots, q.dtype)
            latents = torch.cat([cached[:, 0], mine.to(q.dtype)])
        else:
            latents = mine.to(q.dtype)
        k_nope, v = expand(latents[:, :rank])
        k_pe = latents[:, None, rank:].expand(-1, heads, -1)
        keys = torch.cat([k_nope, k_pe], dim=-1)  # [total, heads, qk]
        values = F.pad(v, (0, qk - v.shape[-1])) if v.shape[-1] < qk else v
        out = _causal(q[start:start + new].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                      backend.shape.scale)
        outs.append(out.transpose(0, 1)[..., :v.shape[-1]])
        start += new
    return torch.cat(outs)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [heads, new, d] attends k, v [heads, total, d]: query i (at position total - new + i) sees keys up to its
    own position. (Given as one batch of 4-D tensors: torch's flash and memory-efficient kernels refuse 3-D ones, and
    its plain fallback holds every score: heads x 8,192 x 8,192 of them for DeepSeek-V2-Lite's 8k prompt, which the
    first GPU run ran out of memory on.)"""
    from torch.nn.attention.bias import causal_lower_right

    new, total = q.shape[1], k.shape[1]
    q, k, v = q[None], k[None], v[None]
    if new == total:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[0]
    # (causal from the bottom right: the flash and memory-efficient kernels take it without a mask tensor)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(new, total), scale=scale)[0]
