"""Extend (prefill) attention over a latent KV cache (multi-head latent attention: DeepSeek-V2/V3,
engine.models.deepseek), as kernels.extend_attention computes it for a ragged batch, with the latent's layout of
kernels.mla_decode: every token's key is its whole latent row (`rank + rope` numbers: one KV head every query head
shares) and its value the leading `rank` numbers of the same row. A program takes BLOCK_M new tokens of one request
for one query head: it streams the request's cached latents from the pool (by slot), then its new tokens' latents up
to the diagonal, scoring the `rank` and the `rope` parts as two products (512 + 64 wide, neither padded into a
1024-wide tile) and summing the rows' `rank` part once loaded. Output: each head's `rank` numbers. An fp8 cache's one
scale multiplies the prefix's scores and values (the new tokens come unscaled).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels.mla_decode import latent_query, latent_step
from radixmesh.kernels.runtime import dot_needs_upcast

_LOG2E = 1.4426950408889634


@triton.jit
def _latent_extend_kernel(Q, KvNew, Out, KvBuf, ReqToToken, ReqPoolIdx, PrefixLens, ExtendLens, QoStarts,
                          stride_qt, stride_qh, stride_nt, stride_ot, stride_oh, stride_kt, stride_rt, scale_log2,
                          prefix_scale_log2, kv_scale, num_m_blocks, RANK: tl.constexpr, ROPE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                          PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    m_block = num_m_blocks - 1 - tl.program_id(0)  # the blocks furthest down the diagonal (the most work) first
    head = tl.program_id(1)
    b = tl.program_id(2)
    extend_len = tl.load(ExtendLens + b).to(tl.int32)
    if m_block * BLOCK_M >= extend_len:
        return
    prefix = tl.load(PrefixLens + b).to(tl.int32)
    q_start = tl.load(QoStarts + b).to(tl.int64)
    row = tl.load(ReqPoolIdx + b).to(tl.int64)

    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < extend_len
    r = tl.arange(0, BLOCK_R)
    r_mask = r < RANK
    p = tl.arange(0, BLOCK_P)
    p_mask = p < ROPE
    q_lat, q_pe = latent_query(Q + (q_start + m) * stride_qt + head * stride_qh, m_mask, r, p, r_mask, p_mask, RANK,
                               UPCAST)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for n0 in range(0, prefix, BLOCK_N):  # the cached prefix: every row sees all of it
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < prefix
        slots = tl.load(ReqToToken + row * stride_rt + n, mask=n_mask, other=0).to(tl.int64)
        m_i, l_i, acc = latent_step(q_lat, q_pe, KvBuf + slots * stride_kt, n_mask, m_mask[:, None] & n_mask[None, :],
                                    r, p, r_mask, p_mask, m_i, l_i, acc, prefix_scale_log2, kv_scale, RANK,
                                    Q.dtype.element_ty, PRECISION, UPCAST)
    end = tl.minimum(extend_len, (m_block + 1) * BLOCK_M)
    for n0 in range(0, end, BLOCK_N):  # the new tokens, up to the diagonal
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        visible = m_mask[:, None] & n_mask[None, :] & (n[None, :] <= m[:, None])
        m_i, l_i, acc = latent_step(q_lat, q_pe, KvNew + (q_start + n) * stride_nt, n_mask, visible, r, p, r_mask,
                                    p_mask, m_i, l_i, acc, scale_log2, 1.0, RANK, Q.dtype.element_ty, PRECISION,
                                    UPCAST)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + (q_start + m)[:, None] * stride_ot + head * stride_oh + r[None, :], out.to(Out.dtype.element_ty),
             mask=m_mask[:, None] & r_mask[None, :])


def latent_extend(q: torch.Tensor, kv_new: torch.Tensor, kv_buf: torch.Tensor, rank: int, req_to_token: torch.Tensor,
                  req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                  qo_starts: torch.Tensor, max_extend_len: int, scale: float, kv_scale: float = 1.0,
                  tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """q [num_tokens, heads, rank + rope] (queries in the latent space); kv_new [num_tokens, 1, rank + rope] (the new
    tokens' latents); kv_buf [num_slots, 1, rank + rope] (the pool); req_to_token [rows, row_len]; req_pool_indices,
    prefix_lens, extend_lens, qo_starts [batch]; max_extend_len >= every extend_len. Returns [num_tokens, heads,
    rank] in q's dtype. `kv_scale`: the pool holds latents divided by it (an fp8 cache). `tiles`: (BLOCK_M, BLOCK_N,
    num_warps, num_stages)."""
    num_tokens, num_heads, width = q.shape
    rank, rope = rank, width - rank
    out = q.new_empty((num_tokens, num_heads, rank))
    bsz = int(extend_lens.shape[0])
    if num_tokens == 0 or bsz == 0:
        return out
    # (sm_90, by ptxas: 32 x 16 tiles over 8 warps hold a 512-wide latent in 230 registers, unspilled; 32 x 32 spill a
    # little, 4 warps or 64 rows much)
    block_m, block_n, warps, stages = tiles or ((16, 16, 4, 1) if q.device.type != "cuda" else (32, 16, 8, 2))
    m_blocks = triton.cdiv(max_extend_len, block_m)
    _latent_extend_kernel[(m_blocks, num_heads, bsz)](
        q, kv_new, out, kv_buf, req_to_token, req_pool_indices, prefix_lens, extend_lens, qo_starts,
        q.stride(0), q.stride(1), kv_new.stride(0), out.stride(0), out.stride(1), kv_buf.stride(0),
        req_to_token.stride(0), scale * _LOG2E, scale * kv_scale * _LOG2E, float(kv_scale), m_blocks,
        RANK=rank, ROPE=rope, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        BLOCK_P=max(16, triton.next_power_of_2(rope)), PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=dot_needs_upcast(q.dtype), num_warps=warps, num_stages=stages)
    return out


def latent_extend_reference(q: torch.Tensor, kv_new: torch.Tensor, kv_buf: torch.Tensor, rank: int,
                            req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                            extend_lens: torch.Tensor, qo_starts: torch.Tensor, scale: float,
                            kv_scale: float = 1.0) -> torch.Tensor:
    """Plain-torch twin of `latent_extend`: per request, its cached latents (times `kv_scale`) and its new ones as
    every head's keys, their leading `rank` numbers as the values, causal by position, in float32."""
    out = q.new_empty((q.shape[0], q.shape[1], rank))
    for b in range(int(extend_lens.shape[0])):
        pre, ext, at = int(prefix_lens[b]), int(extend_lens[b]), int(qo_starts[b])
        slots = req_to_token[int(req_pool_indices[b]), :pre].long()
        kv = torch.cat([kv_buf[slots, 0].float() * kv_scale, kv_new[at:at + ext, 0].float()])  # [pre + ext, width]
        scores = torch.einsum("qhd,kd->hqk", q[at:at + ext].float(), kv) * scale
        causal = torch.arange(pre + ext)[None, :] <= (pre + torch.arange(ext))[:, None]
        weights = torch.softmax(scores.masked_fill(~causal.to(scores.device), float("-inf")), dim=-1)
        out[at:at + ext] = torch.einsum("hqk,kr->qhr", weights, kv[:, :rank]).to(q.dtype)
    return out
