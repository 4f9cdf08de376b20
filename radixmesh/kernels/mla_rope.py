"""DeepSeek's multi-head latent attention between its projections and its attention kernel, in one launch: each
token's query (every head's absorbed part, then its rope part rotated) and its key (the normed latent, then the shared
rope part rotated), written whole into the [tokens, heads, rank + rope] and [tokens, 1, rank + rope] rows that
kernels.mla_decode reads. In plain torch (`mla_query_key_reference`, engine.models.deepseek's path off the GPU) that
is the rotation of both rope parts and two concatenations, ~16 small launches a layer: on an H100 a batch-1 step of
DeepSeek-V2-Lite's shape ran 1,007 kernels, ~18 a layer of them torch's elementwise, copy and concatenation kernels of
~1.5-2.5 us each (the twenty-ninth session's profile).

Numerics are engine.layers.rotary.apply_rotary's, op for op: interleaved pairs (x0, x1) -> (x0 c - x1 s, x1 c + x0 s)
or rotate-half, each product and the sum rounded to the dtype torch computes them in (float32 where the pairs are
upcast, the table is float32 or the rows are; else the rows' dtype), then the result to the query's dtype. Compiled
without fused multiply-adds, as kernels.rotary, so the kernel equals the twin bit for bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels.runtime import pdl_enter, pdl_options


@triton.jit
def rotate_into(src, dst, cos_row, sin_row, h_ok, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr,
                ROUND: tl.constexpr, MID: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rows `src` ([rows, 1] pointers to each row's rope part) rotated by one token's cos/sin rows and stored at `dst`
    ([rows, 1] pointers, in dst's dtype through MID): interleaved, the pairs' even and odd elements; rotate-half, the
    two halves. Each op rounded to ROUND as torch rounds it."""
    i = tl.arange(0, BLOCK_HALF)
    ok = h_ok & (i < ROPE // 2)[None, :]
    if INTERLEAVED:
        a_at, b_at = 2 * i, 2 * i + 1
    else:
        a_at, b_at = i, i + ROPE // 2
    a = tl.load(src + a_at[None, :], mask=ok, other=0.0).to(tl.float32)
    b = tl.load(src + b_at[None, :], mask=ok, other=0.0).to(tl.float32)
    i_ok = i < ROPE // 2
    ca = tl.load(cos_row + a_at, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    cb = tl.load(cos_row + b_at, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    sa = tl.load(sin_row + a_at, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    sb = tl.load(sin_row + b_at, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    # a' = a c_a + (-b) s_a, b' = b c_b + a s_b (rotate_half and the interleaved swap alike)
    out_a = ((a * ca).to(ROUND).to(tl.float32) + (-b * sa).to(ROUND).to(tl.float32)).to(ROUND).to(tl.float32)
    out_b = ((b * cb).to(ROUND).to(tl.float32) + (a * sb).to(ROUND).to(tl.float32)).to(ROUND).to(tl.float32)
    dtype = dst.dtype.element_ty
    tl.store(dst + a_at[None, :], out_a.to(MID).to(dtype), mask=ok)
    tl.store(dst + b_at[None, :], out_b.to(MID).to(dtype), mask=ok)


@triton.jit
def _mla_query_key_kernel(q_lat_ptr, q_pe_ptr, latent_ptr, k_pe_ptr, cos_ptr, sin_ptr, query_ptr, key_ptr, heads,
                          stride_ql_n, stride_ql_h, stride_qp_n, stride_qp_h, stride_lat, stride_kp, stride_cs,
                          RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr, ROUND: tl.constexpr,
                          MID: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    # program (token, block of heads); the last block of each token writes its key too
    tok = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    h = block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = (h < heads)[:, None]
    r = tl.arange(0, BLOCK_R)
    dtype = query_ptr.dtype.element_ty
    width = RANK + ROPE
    rows = query_ptr + tok * heads * width + h.to(tl.int64)[:, None] * width
    for r0 in tl.static_range(0, RANK, BLOCK_R):  # the absorbed part, copied
        part = tl.load(q_lat_ptr + tok * stride_ql_n + h.to(tl.int64)[:, None] * stride_ql_h + r0 + r[None, :],
                       mask=h_ok & (r0 + r < RANK)[None, :], other=0.0)
        tl.store(rows + r0 + r[None, :], part.to(dtype), mask=h_ok & (r0 + r < RANK)[None, :])
    cos_row, sin_row = cos_ptr + tok * stride_cs, sin_ptr + tok * stride_cs
    q_src = q_pe_ptr + tok * stride_qp_n + h.to(tl.int64)[:, None] * stride_qp_h
    rotate_into(q_src, rows + RANK, cos_row, sin_row, h_ok, ROPE, INTERLEAVED, ROUND, MID, BLOCK_HALF)
    if block == tl.num_programs(1) - 1:
        one = tl.arange(0, 1)
        one_ok = (one < 1)[:, None]
        key = key_ptr + tok * width + one.to(tl.int64)[:, None] * 0
        for r0 in tl.static_range(0, RANK, BLOCK_R):  # (names of their own: a branch may not retype a name)
            lat = tl.load(latent_ptr + tok * stride_lat + r0 + r[None, :] + one[:, None] * 0,
                          mask=one_ok & (r0 + r < RANK)[None, :], other=0.0)
            tl.store(key + r0 + r[None, :], lat.to(dtype), mask=one_ok & (r0 + r < RANK)[None, :])
        k_src = k_pe_ptr + tok * stride_kp + one.to(tl.int64)[:, None] * 0
        rotate_into(k_src, key + RANK, cos_row, sin_row, one_ok, ROPE, INTERLEAVED, ROUND, MID, BLOCK_HALF)


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def rounding(x_dtype: torch.dtype, table_dtype: torch.dtype, interleaved: bool, upcast_pairs: bool) -> torch.dtype:
    """The dtype apply_rotary computes a rotation in: float32 for upcast interleaved pairs, else torch's promotion of
    the rows' and the table's dtypes."""
    return torch.float32 if interleaved and upcast_pairs else torch.promote_types(x_dtype, table_dtype)


def mla_query_key(q_latent: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, upcast_pairs: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """q_latent [n, heads, rank] (the absorbed query), q_pe [n, heads, rope] and k_pe [n, rope] (rope parts, any
    row strides), latent [n, rank] (normed), cos/sin [n, 1, rope] -> (query [n, heads, rank + rope], key [n, 1,
    rank + rope]) in q_latent's dtype, one launch (`mla_query_key_reference` bit for bit)."""
    n, heads, rank = q_latent.shape
    rope = q_pe.shape[-1]
    if (q_pe.shape[:2] != (n, heads) or latent.shape != (n, rank) or k_pe.shape != (n, rope) or rope % 2
            or cos.shape[-1] != rope or sin.shape != cos.shape or cos.shape[0] != n
            or any(t.stride(-1) != 1 for t in (q_latent, q_pe, latent, k_pe))):
        raise ValueError(f"mla_query_key takes q_latent [n, heads, rank], q_pe [n, heads, rope], latent [n, rank], "
                         f"k_pe [n, rope], cos/sin [n, 1, rope] with unit last strides; got {tuple(q_latent.shape)}, "
                         f"{tuple(q_pe.shape)}, {tuple(latent.shape)}, {tuple(k_pe.shape)}, {tuple(cos.shape)}")
    dtype = q_latent.dtype
    query = torch.empty((n, heads, rank + rope), dtype=dtype, device=q_latent.device)
    key = torch.empty((n, 1, rank + rope), dtype=dtype, device=q_latent.device)
    if n == 0:
        return query, key
    cos, sin = cos.reshape(n, rope).contiguous(), sin.reshape(n, rope).contiguous()
    round_to = rounding(q_pe.dtype, cos.dtype, interleaved, upcast_pairs)
    mid = q_pe.dtype if interleaved else round_to  # (interleaved pairs go back to their rows' dtype first)
    block_h = min(16, triton.next_power_of_2(heads))
    _mla_query_key_kernel[(n, triton.cdiv(heads, block_h))](
        q_latent, q_pe, latent, k_pe, cos, sin, query, key, heads, q_latent.stride(0), q_latent.stride(1),
        q_pe.stride(0), q_pe.stride(1), latent.stride(0), k_pe.stride(0), cos.stride(0), RANK=rank, ROPE=rope,
        BLOCK_H=block_h, BLOCK_R=min(512, triton.next_power_of_2(rank)),
        BLOCK_HALF=triton.next_power_of_2(rope // 2), INTERLEAVED=interleaved, ROUND=_TL[round_to], MID=_TL[mid],
        num_warps=4, enable_fp_fusion=False, **pdl_options(query))
    return query, key


def mla_query_key_reference(q_latent: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                            cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, upcast_pairs: bool
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin: both rope parts rotated as engine.layers.rotary.apply_rotary rotates them, then the two
    concatenations (engine.models.deepseek's path off the GPU)."""
    q_pe, k_pe = _rotated_reference(q_pe, cos, sin, interleaved, upcast_pairs), \
        _rotated_reference(k_pe[:, None, :], cos, sin, interleaved, upcast_pairs)
    key = torch.cat([latent, k_pe[:, 0].to(latent.dtype)], dim=-1)[:, None, :]
    return torch.cat([q_latent, q_pe.to(q_latent.dtype)], dim=-1), key.to(q_latent.dtype)


def _rotated_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
                       upcast: bool) -> torch.Tensor:
    if interleaved:  # (x0, x1) -> (-x1, x0) per pair; in float32 with `upcast`, back to x's dtype
        rot = x.float() if upcast else x
        swapped = torch.stack([-rot[..., 1::2], rot[..., ::2]], dim=-1).flatten(-2)
        return (rot * cos + swapped * sin).to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
