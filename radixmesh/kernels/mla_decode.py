"""Paged decode attention over a latent KV cache (multi-head latent attention: DeepSeek-V2/V3, engine.models.deepseek).

Every token of a layer holds one latent row `kv[slot]` of `rank + rope` numbers: its key is the whole row and its
value the leading `rank` numbers of it (one buffer; one KV head every query head shares). A query head is a row of the
same width, already carried into the latent space by the model. So a program loads a block of latent rows once and
uses it twice: the scores of its heads against the whole rows (the `rank` part and the `rope` part as two products, so
neither width is padded to a power of two together: 512 + 64 stays 512 + 64, not 1024), then the weighted sum of
the rows' `rank` part.

Stage 1 runs one program per (request, block of BLOCK_H heads, split) and walks its split of the request's tokens
with an online softmax, as kernels.decode_attention's stage 1 does; with one split it writes the output itself, else
a partial output of `rank` numbers and its log-sum-exp per head, which kernels.decode_attention's stage 2 merges (the
same split rule: the split count depends only on the batch size, so a CUDA graph stays valid for any lengths). An fp8
latent cache's scale (one per layer: K and V are one buffer) multiplies the score scale and the output once. A draft
tree's verify rows (engine.speculative.tree) see only the keys their span's bits show, as in kernels.decode_attention
(whose mask rule they share).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels.decode_attention import _LOG2E, _tree_visible, merge_splits, split_scratch
from radixmesh.kernels.online_softmax import accumulate
from radixmesh.kernels.runtime import dot_needs_upcast, pdl_options

# Query heads a program takes: the rows of its tiles (tl.dot needs 16)
BLOCK_H = 16


@triton.jit
def latent_query(rows, row_mask, r, p, r_mask, p_mask, RANK: tl.constexpr, UPCAST: tl.constexpr):
    """Query rows in the latent space (`rows`: each row's first element [ROWS]): their `rank` part [ROWS, BLOCK_R]
    and their `rope` part [ROWS, BLOCK_P]."""
    q_lat = tl.load(rows[:, None] + r[None, :], mask=row_mask[:, None] & r_mask[None, :], other=0.0)
    q_pe = tl.load(rows[:, None] + RANK + p[None, :], mask=row_mask[:, None] & p_mask[None, :], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    return q_lat, q_pe


@triton.jit
def latent_step(q_lat, q_pe, rows, n_mask, visible, r, p, r_mask, p_mask, m_i, l_i, acc, scale_log2, weight,
                RANK: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One block of latent rows (`rows`: each row's first element [BLOCK_N], `n_mask` the real ones; `visible`
    [ROWS, BLOCK_N]: the pairs that attend) folded into the online softmax of the query rows: the scores of the
    `rank` and the `rope` parts as two products, the rows' `rank` part summed, weighed by `weight` (an fp8 prefix's
    scale; the normalizer keeps the plain weights). A row that sees nothing yet keeps zero weights, not NaN."""
    lat = tl.load(rows[:, None] + r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(DTYPE)
    pe = tl.load(rows[:, None] + RANK + p[None, :], mask=n_mask[:, None] & p_mask[None, :], other=0.0).to(DTYPE)
    if UPCAST:
        lat = lat.to(tl.float32)
        pe = pe.to(tl.float32)
    s = tl.dot(q_lat, tl.trans(lat), input_precision=PRECISION)
    s += tl.dot(q_pe, tl.trans(pe), input_precision=PRECISION)
    s = tl.where(visible, s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    w = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return m_new, l_i * alpha + tl.sum(w, 1), accumulate(acc, w * weight, alpha, lat, PRECISION, UPCAST)


@triton.jit
def _latent_stage1(Q, KV, ReqToToken, ReqPoolIdx, SeqLens, TreeStart, TreeBits, Out, PartialO, PartialLse,
                   stride_qt, stride_qh,
                   stride_kt, stride_rt, stride_ot, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                   scale_log2, v_scale, HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                   V_SCALED: tl.constexpr, TREE: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    # the length and the slot table are the step's inputs (no kernel of the step writes them): read before the wait
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    row = tl.load(ReqPoolIdx + b).to(tl.int64)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if start >= seq_len:  # an empty split: stage 2 reads only the splits the length fills
        return
    if PDL:
        tl.extra.cuda.gdc_wait()  # from here on the kernel before (the latent's store) has finished

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < HEADS
    r = tl.arange(0, BLOCK_R)
    r_mask = r < RANK
    p = tl.arange(0, BLOCK_P)
    p_mask = p < ROPE
    q_lat, q_pe = latent_query(Q + b * stride_qt + heads * stride_qh, h_mask, r, p, r_mask, p_mask, RANK, UPCAST)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    if TREE:
        tree_start = tl.load(TreeStart + b).to(tl.int32)
        tree_bits = tl.load(TreeBits + b)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        if TREE:  # (keys a tree row does not see are not loaded either)
            n_mask = n_mask & _tree_visible(n, tree_start, tree_bits)
        slots = tl.load(ReqToToken + row * stride_rt + n, mask=n_mask, other=0).to(tl.int64)
        # (an fp8 cache: its values in the model's dtype; its scale multiplies scale_log2, and the output below)
        m_i, l_i, acc = latent_step(q_lat, q_pe, KV + slots * stride_kt, n_mask, n_mask[None, :], r, p, r_mask,
                                    p_mask, m_i, l_i, acc, scale_log2, 1.0, RANK, Q.dtype.element_ty, PRECISION,
                                    UPCAST)

    if V_SCALED:  # an fp8 cache's latent is stored divided by its scale (the partial sums merge linearly)
        acc = acc * v_scale
    out_mask = h_mask[:, None] & r_mask[None, :]
    if TREE:  # a split wholly inside a row's tree span may see no key: its weight is zero, not NaN
        l_i = tl.where(l_i > 0, l_i, 1.0)
    if NUM_SPLITS == 1:
        tl.store(Out + b * stride_ot + heads[:, None] * stride_oh + r[None, :],
                 (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=out_mask)
    else:
        tl.store(PartialLse + b * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i), mask=h_mask)
        tl.store(PartialO + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + r[None, :],
                 acc / l_i[:, None], mask=out_mask)


def head_blocks(num_heads: int) -> int:
    """Stage-1 programs a (request, split) takes: one per BLOCK_H query heads."""
    return triton.cdiv(num_heads, BLOCK_H)


def latent_decode(q: torch.Tensor, kv_buf: torch.Tensor, rank: int, req_to_token: torch.Tensor,
                  req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float, num_splits: int,
                  partials: tuple[torch.Tensor, torch.Tensor] | None = None, kv_scale: float = 1.0,
                  block_n: int = 32, tree: torch.Tensor | None = None) -> torch.Tensor:
    """q [batch, heads, rank + rope] (queries in the latent space); kv_buf [num_slots, 1, rank + rope] (a layer's
    latents); req_to_token [rows, row_len]; req_pool_indices, seq_lens [batch] (every seq_len >= 1). Returns
    [batch, heads, rank] in q's dtype: each head's softmax(q . kv * scale) over the request's latents, times their
    leading `rank` numbers. `partials` (partial_buffers(batch, heads, num_splits, rank)) lets CUDA graphs keep
    fixed scratch; `kv_scale`: the cache holds latents divided by it (an fp8 cache); `tree` [2, batch] int64: each
    row's masked span (kernels.decode_attention's)."""
    bsz, num_heads, width = q.shape
    rope = width - rank
    out = q.new_empty((bsz, num_heads, rank))
    if bsz == 0:
        return out
    po, lse = split_scratch(out, num_splits, rank, partials)
    block_r = max(16, triton.next_power_of_2(rank))
    _latent_stage1[(bsz, head_blocks(num_heads), num_splits)](
        q, kv_buf, req_to_token, req_pool_indices, seq_lens, tree[0] if tree is not None else seq_lens,
        tree[1] if tree is not None else seq_lens, out, po, lse, q.stride(0), q.stride(1),
        kv_buf.stride(0), req_to_token.stride(0), out.stride(0), out.stride(1), po.stride(0), po.stride(1),
        po.stride(2), lse.stride(0), lse.stride(1), scale * kv_scale * _LOG2E, float(kv_scale),
        HEADS=num_heads, RANK=rank, ROPE=rope, BLOCK_H=BLOCK_H, BLOCK_N=block_n, BLOCK_R=block_r,
        BLOCK_P=max(16, triton.next_power_of_2(rope)), NUM_SPLITS=num_splits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=dot_needs_upcast(q.dtype),
        V_SCALED=kv_scale != 1.0, TREE=tree is not None, num_warps=4, num_stages=2, **pdl_options(q))
    merge_splits(po, lse, out, seq_lens, None, num_splits, block_n, block_r)
    return out


def latent_decode_reference(q: torch.Tensor, kv_buf: torch.Tensor, rank: int, req_to_token: torch.Tensor,
                            req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            kv_scale: float = 1.0, tree: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch twin of `latent_decode`: per request, its latents (times `kv_scale`; those its tree span shows,
    given `tree`) as the keys of every head and their leading `rank` numbers as the values, in float32."""
    out = q.new_empty((q.shape[0], q.shape[1], rank))
    for b in range(q.shape[0]):
        index = torch.arange(int(seq_lens[b]))
        if tree is not None:
            start, bits = int(tree[0, b]), int(tree[1, b])
            index = index[[i < start or bool((bits >> (i - start)) & 1) for i in index.tolist()]]
        slots = req_to_token[int(req_pool_indices[b]), index].long()
        kv = kv_buf[slots, 0].float() * kv_scale  # [len, rank + rope]
        weights = torch.softmax(q[b].float() @ kv.T * scale, dim=-1)  # [heads, len]
        out[b] = (weights @ kv[:, :rank]).to(q.dtype)
    return out
