"""Extend (prefill) attention over a ragged batch: each request's new tokens attend to its cached prefix in the paged
KV pool and, causally, to the new tokens themselves.

Request b has `prefix_lens[b]` tokens already in the pool (reached through `req_to_token`, any page size) and
`extend_lens[b]` new tokens, stored contiguously from `qo_starts[b]` in q, k_new and v_new (the flat token axis of a
ForwardBatch). New token i of a request sits at position prefix + i and sees every prefix token and new tokens
0..i. One program handles BLOCK_M new tokens of one request for one query head: it first streams the prefix from the
pool (gathered by slot), then the new tokens up to the diagonal from the contiguous k_new / v_new.

Under a sliding window of w tokens (a per-layer constant) the query at position p sees only keys at positions
p - w + 1 .. p (transformers' rule: key > query - w): a program starts both walks at its first row's window, and
masks per row within it. Scores may be soft-capped, and a head's attention sink (GPT-OSS) joins each row's softmax
denominator at the end (kernels.online_softmax).

An fp8 cache (--kv-cache-dtype fp8_*) holds the prefix's keys divided by a per-layer `k_scale` and its values divided
by `v_scale`; the new tokens come unscaled from k_new / v_new. The prefix walk scores with scale * k_scale (exact:
q . (k * ks) * scale = (q . k) * (scale * ks)) and weighs its values by p * v_scale (V_SCALED; 1.0 costs nothing).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from radixmesh.kernels.online_softmax import accumulate, sink_normalizer, softmax_step
from radixmesh.kernels.runtime import dot_needs_upcast

_LOG2E = 1.4426950408889634


@triton.jit
def _extend_kernel(Q, KNew, VNew, Out, KBuf, VBuf, ReqToToken, ReqPoolIdx, PrefixLens, ExtendLens, QoStarts, Sinks,
                   stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_ot, stride_oh,
                   stride_kt, stride_kh, stride_vt, stride_vh, stride_rt, scale_log2, prefix_scale_log2, v_scale,
                   cap_log2, window, num_m_blocks, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                   CAPPED: tl.constexpr, WINDOWED: tl.constexpr, V_SCALED: tl.constexpr, SINK: tl.constexpr):
    # Blocks furthest down the diagonal do the most work: launch them first (program 0 of axis 0 goes first).
    m_block = num_m_blocks - 1 - tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    extend_len = tl.load(ExtendLens + b).to(tl.int32)
    if m_block * BLOCK_M >= extend_len:
        return
    prefix = tl.load(PrefixLens + b).to(tl.int32)
    q_start = tl.load(QoStarts + b).to(tl.int64)
    row = tl.load(ReqPoolIdx + b).to(tl.int64)
    kv_head = head // GROUP

    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < extend_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(Q + (q_start + m)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Positions are prefix + m. Without a window every query sees the whole prefix; with one, row m sees keys after
    # prefix + m - window, and no row of the block sees a key before its first row's window.
    prefix_from = 0
    new_from = 0
    if WINDOWED:
        lowest = prefix + m_block * BLOCK_M - window + 1
        prefix_from = tl.maximum(lowest, 0)
        new_from = tl.maximum(lowest - prefix, 0)
    for n0 in range(prefix_from, prefix, BLOCK_N):  # the cached prefix
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < prefix
        slots = tl.load(ReqToToken + row * stride_rt + n, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(KBuf + slots[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=kv_mask,
                    other=0.0).to(Q.dtype.element_ty)  # (an fp8 cache: its values in the model's dtype)
        visible = n_mask[None, :]
        if WINDOWED:
            visible = visible & (n[None, :] > (prefix + m - window)[:, None])
        p, alpha, m_i, l_i = softmax_step(q, k, visible, m_i, l_i, prefix_scale_log2, cap_log2, PRECISION, UPCAST,
                                          CAPPED, WINDOWED)
        v = tl.load(VBuf + slots[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=kv_mask,
                    other=0.0).to(Q.dtype.element_ty)
        if V_SCALED:  # the cached values are stored divided by v_scale (the normalizer l_i keeps the plain p)
            p = p * v_scale
        acc = accumulate(acc, p, alpha, v, PRECISION, UPCAST)

    end = tl.minimum(extend_len, (m_block + 1) * BLOCK_M)
    for n0 in range(new_from, end, BLOCK_N):  # the new tokens, up to the diagonal
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(KNew + (q_start + n)[:, None] * stride_knt + kv_head * stride_knh + d[None, :], mask=kv_mask,
                    other=0.0)
        # Without a window, block 0 shows key 0 to every row, so no row's max is -inf after it; with one, a row may
        # see nothing in a block before its window (softmax_step's SPARSE), and always sees itself.
        visible = n_mask[None, :] & (n[None, :] <= m[:, None])
        if WINDOWED:
            visible = visible & (n[None, :] > (m - window)[:, None])
        p, alpha, m_i, l_i = softmax_step(q, k, visible, m_i, l_i, scale_log2, cap_log2, PRECISION, UPCAST, CAPPED,
                                          WINDOWED)
        v = tl.load(VNew + (q_start + n)[:, None] * stride_vnt + kv_head * stride_vnh + d[None, :], mask=kv_mask,
                    other=0.0)
        acc = accumulate(acc, p, alpha, v, PRECISION, UPCAST)

    if SINK:  # (a padding row that saw no key: factor 0, denominator 1)
        factor, l_i = sink_normalizer(m_i, l_i, tl.load(Sinks + head))
        acc = acc * factor[:, None]
    elif WINDOWED:  # padding rows past the request's end may have seen no key: keep them finite (never stored)
        l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(Out + (q_start + m)[:, None] * stride_ot + head * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])


def _tiles_from_env() -> tuple[int, int, int, int] | None:
    spec = os.environ.get(TILES_ENV, "")
    if not spec:
        return None
    try:
        tiles = tuple(int(x) for x in spec.split(","))
    except ValueError:
        tiles = ()
    if len(tiles) != 4 or min(tiles) < 1:
        raise ValueError(f"{TILES_ENV}={spec!r}: want BLOCK_M,BLOCK_N,NUM_WARPS,NUM_STAGES")
    return tiles


# BLOCK_M,BLOCK_N,NUM_WARPS,NUM_STAGES for 16-bit CUDA runs (benchmarks.extend_tiles sweeps them)
TILES_ENV = "RADIXMESH_EXTEND_TILES"
_ENV_TILES = _tiles_from_env()


def _blocks(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for this head size."""
    if device.type != "cuda":
        return 16, 16, 4, 1  # the interpreter: small tiles keep CPU tests quick
    if _ENV_TILES is not None and dtype != torch.float32:
        return _ENV_TILES
    if head_dim <= 64:
        return 128, 64, 4, 3
    if head_dim <= 128 and dtype != torch.float32:
        # Hopper: 64-row tiles and 4 warps beat 128 x 64 with 8 warps at every extend shape measured on an H200
        # (-3.6..-9.8%: one 8192-token prefill, 8 x 1024, 4 x 2048 over 4096 cached, 16 x 512 over 2304, 32 x 512
        # over 1152; benchmarks.extend_tiles, results/2026-11-28-h200-extend-tiles.json)
        return (64, 64, 4, 3) if torch.cuda.get_device_capability(device)[0] >= 9 else (128, 64, 8, 3)
    return 64, 32, 4, 2


def extend_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_buf: torch.Tensor,
                     v_buf: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     prefix_lens: torch.Tensor, extend_lens: torch.Tensor, qo_starts: torch.Tensor,
                     max_extend_len: int, scale: float, out: torch.Tensor | None = None,
                     tiles: tuple[int, int, int, int] | None = None, window: int | None = None,
                     softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim]; k_new, v_new [num_tokens, num_kv_heads, head_dim] (the new tokens);
    k_buf, v_buf [num_slots, num_kv_heads, head_dim] (the pool); req_to_token [rows, row_len]; req_pool_indices,
    prefix_lens, extend_lens, qo_starts [batch]; max_extend_len >= every extend_len (host int).
    `tiles` (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the choice for this head size and dtype.
    `window`: a query sees only the keys of the last `window` positions up to its own; `softcap`: scores become
    softcap * tanh(scores / softcap). `k_scale`, `v_scale`: the pool holds keys and values divided by them (an fp8
    cache's per-layer scales; k_new and v_new are unscaled). `sinks` [num_heads]: each head's attention sink (a logit
    in the softmax's denominator). Returns [num_tokens, num_heads, head_dim] in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    bsz = int(extend_lens.shape[0])
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0 or bsz == 0:
        return out
    block_m, block_n, warps, stages = tiles or _blocks(head_dim, q.dtype, q.device)
    m_blocks = triton.cdiv(max_extend_len, block_m)
    _extend_kernel[(m_blocks, num_heads, bsz)](
        q, k_new, v_new, out, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens, extend_lens, qo_starts,
        sinks if sinks is not None else prefix_lens, q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1),
        out.stride(0), out.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0), scale * _LOG2E, scale * k_scale * _LOG2E, float(v_scale), (softcap or 0.0) * _LOG2E,
        window or 0, m_blocks,
        GROUP=num_heads // k_buf.shape[1], HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=dot_needs_upcast(q.dtype), CAPPED=bool(softcap), WINDOWED=bool(window), V_SCALED=v_scale != 1.0,
        SINK=sinks is not None, num_warps=warps,
        num_stages=stages)
    return out


def extend_attention_reference(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_buf: torch.Tensor,
                               v_buf: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                               prefix_lens: torch.Tensor, extend_lens: torch.Tensor, qo_starts: torch.Tensor,
                               scale: float, window: int | None = None, softcap: float | None = None,
                               k_scale: float = 1.0, v_scale: float = 1.0,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch twin of `extend_attention`: per request, prefix keys from the pool (times `k_scale`, values times
    `v_scale`) plus the new keys, causal by position (and within `window`, given one), scores soft-capped when
    `softcap` is given, softmax in float32 with each head's sink (given `sinks`)."""
    from radixmesh.kernels.decode_attention import with_sinks_softmax

    group = q.shape[1] // k_buf.shape[1]
    out = torch.empty_like(q)
    for b in range(int(extend_lens.shape[0])):
        pre, ext, at = int(prefix_lens[b]), int(extend_lens[b]), int(qo_starts[b])
        slots = req_to_token[int(req_pool_indices[b]), :pre].long()
        keys = torch.cat([k_buf[slots].float() * k_scale, k_new[at:at + ext].float()]).repeat_interleave(group, dim=1)
        values = torch.cat([v_buf[slots].float() * v_scale, v_new[at:at + ext].float()]).repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[at:at + ext].float(), keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        key_pos, q_pos = torch.arange(pre + ext)[None, :], (pre + torch.arange(ext))[:, None]
        visible = key_pos <= q_pos  # [ext, pre + ext]
        if window:
            visible &= key_pos > q_pos - window
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        out[at:at + ext] = torch.einsum("hqk,khd->qhd", with_sinks_softmax(scores, sinks), values).to(q.dtype)
    return out
