"""DeepSeek's absorbed products for a decode batch of a few rows: each head's query carried into the latent space
through its block of `kv_b_proj` (q_latent[h] = W_uk[h]^T q_nope[h], then, in the same launch, the query and key rows
kernels.mla_decode reads, as kernels.mla_rope writes them), and each head's attention output carried back out through
its value block (v[h] = W_uv[h] o[h][:rank]), written as the [rows, heads * v_dim] input o_proj takes.

In torch these are two batched products over the heads (torch.bmm, cuBLAS): at one row they ran ~8-10 us each on an
H100, where each reads 2 MB of weights (DeepSeek-V2-Lite's 16 heads x 128 x 512 in bfloat16; ~0.7 us at the copy
rate): with the float32 router's product they were ~530 us of a 3.74-ms step (the twenty-ninth session's profile,
benchmarks/results/NOTES.md). Here a program takes one head's block of W (the query side: BLOCK_R latent columns of
all its nope rows; the value side: BLOCK_V value rows of all its latent columns), holds it in registers and runs the
batch's rows through it one after another, float32 sums rounded once to the rows' dtype (`*_reference`: the twins).

Under programmatic dependent launch a program lets its dependents launch, then waits (the weights never change, but
pulling them before the wait competes with the small kernel before: benchmarks/results/NOTES.md, the twenty-second
session); `early=True` loads the block before the wait instead, for the A/B (RADIXMESH_MLA_ABSORB_EARLY=1)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels.mla_rope import _TL, mla_query_key_reference, rotate_into, rounding
from radixmesh.kernels.runtime import pdl_on

# Rows a launch takes (a decode batch); more rows run torch.bmm, whose tiles reuse each weight across rows.
MAX_ROWS = 8
QUERY_BLOCK_R = 32  # latent columns a query-side program holds: [nope, 32] of W_uk
VALUE_BLOCK_V = 4  # value rows a value-side program holds: [4, rank] of W_uv


@triton.jit
def _weights_and_wait(w_at, w_ok, PDL: tl.constexpr, EARLY: tl.constexpr):
    """Under PDL: let dependents launch, then wait for the kernel before; the head's block of W loaded (float32)
    after the wait, or before it with EARLY (no kernel writes it)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if EARLY:
        w = tl.load(w_at, mask=w_ok, other=0.0).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()
        w = tl.load(w_at, mask=w_ok, other=0.0).to(tl.float32)
    return w


@triton.jit
def _absorb_query_kernel(q_nope_ptr, w_ptr, q_pe_ptr, latent_ptr, k_pe_ptr, cos_ptr, sin_ptr, query_ptr, key_ptr,
                         loc_ptr, norm_w_ptr, eps, rows, heads, stride_qn_n, stride_qn_h, stride_qp_n, stride_qp_h,
                         stride_lat, stride_kp, stride_cs, stride_wh, stride_key, NOPE: tl.constexpr,
                         RANK: tl.constexpr, ROPE: tl.constexpr, AT_SLOTS: tl.constexpr, NORM: tl.constexpr,
                         BLOCK_RANK: tl.constexpr,
                         BLOCK_NOPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
                         INTERLEAVED: tl.constexpr, ROUND: tl.constexpr, MID: tl.constexpr, PDL: tl.constexpr,
                         EARLY: tl.constexpr):
    # program (head, block of latent columns); block 0's programs rotate each head's query rope part; head 0's
    # programs write their columns of the key rows (the latent, normed here with NORM), block 0's its rope part too.
    # The key rows: row t of key_ptr, or with AT_SLOTS row loc[t] (a latent pool's slots: the KV store in this launch)
    h = tl.program_id(0)
    rb = tl.program_id(1)
    d = tl.arange(0, BLOCK_NOPE)
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < RANK
    w_at = w_ptr + h.to(tl.int64) * stride_wh + d[:, None] * RANK + r[None, :]
    w_ok = (d < NOPE)[:, None] & r_ok[None, :]
    w = _weights_and_wait(w_at, w_ok, PDL, EARLY)
    dtype = query_ptr.dtype.element_ty
    one = tl.arange(0, 1).to(tl.int64)[:, None] * 0  # ([1, 1]: the rope helper's one row)
    one_ok = one == 0
    for t in range(rows):
        tok = tl.cast(t, tl.int64)
        q = tl.load(q_nope_ptr + tok * stride_qn_n + h * stride_qn_h + d, mask=d < NOPE, other=0.0).to(tl.float32)
        row = query_ptr + (tok * heads + h) * (RANK + ROPE)
        tl.store(row + r, tl.sum(w * q[:, None], axis=0).to(dtype), mask=r_ok)
        cos_row, sin_row = cos_ptr + tok * stride_cs, sin_ptr + tok * stride_cs
        if rb == 0:
            rotate_into(q_pe_ptr + tok * stride_qp_n + h * stride_qp_h + one, row + RANK + one, cos_row, sin_row,
                        one_ok, ROPE, INTERLEAVED, ROUND, MID, BLOCK_HALF)
        if h == 0:
            if AT_SLOTS:
                key_row = key_ptr + tl.load(loc_ptr + tok).to(tl.int64) * stride_key
            else:
                key_row = key_ptr + tok * stride_key
            lat = tl.load(latent_ptr + tok * stride_lat + r, mask=r_ok, other=0.0)
            if NORM:  # kv_a_layernorm here, as kernels.norm computes it: the row's statistics, then this block
                whole = tl.arange(0, BLOCK_RANK)
                x = tl.load(latent_ptr + tok * stride_lat + whole, mask=whole < RANK, other=0.0).to(tl.float32)
                rstd = tl.rsqrt(tl.sum(x * x, axis=0) / RANK + eps)
                normed = (lat.to(tl.float32) * rstd).to(latent_ptr.dtype.element_ty).to(tl.float32)
                lat = normed * tl.load(norm_w_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
            tl.store(key_row + r, lat.to(key_ptr.dtype.element_ty), mask=r_ok)
            if rb == 0:
                rotate_into(k_pe_ptr + tok * stride_kp + one, key_row + RANK + one, cos_row, sin_row, one_ok, ROPE,
                            INTERLEAVED, ROUND, MID, BLOCK_HALF)


@triton.jit
def _absorb_value_kernel(o_ptr, w_ptr, out_ptr, rows, stride_on, stride_oh, stride_wh, stride_out,
                         NOPE: tl.constexpr, RANK: tl.constexpr, V_DIM: tl.constexpr, BLOCK_V: tl.constexpr,
                         BLOCK_RANK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    # program (head, block of value rows): v[t, h * V_DIM + j] = sum_r W_uv[h, j, r] o[t, h, r]
    h = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    r = tl.arange(0, BLOCK_RANK)
    j_ok = j < V_DIM
    w_at = w_ptr + h.to(tl.int64) * stride_wh + (NOPE + j)[:, None] * RANK + r[None, :]
    w_ok = j_ok[:, None] & (r < RANK)[None, :]
    w = _weights_and_wait(w_at, w_ok, PDL, EARLY)
    dtype = out_ptr.dtype.element_ty
    for t in range(rows):
        tok = tl.cast(t, tl.int64)
        o = tl.load(o_ptr + tok * stride_on + h * stride_oh + r, mask=r < RANK, other=0.0).to(tl.float32)
        tl.store(out_ptr + tok * stride_out + h * V_DIM + j, tl.sum(w * o[None, :], axis=1).to(dtype), mask=j_ok)


def _up_weight(weight: torch.Tensor, heads: int, nope: int, v_dim: int, rank: int) -> torch.Tensor:
    """kv_b_proj's weight [heads * (nope + v_dim), rank] as [heads, nope + v_dim, rank] (a view; checked)."""
    if weight.shape != (heads * (nope + v_dim), rank) or not weight.is_contiguous():
        raise ValueError(f"kv_b_proj's weight must be a contiguous [{heads} x ({nope} + {v_dim}), {rank}], got "
                         f"{tuple(weight.shape)} strides {weight.stride()}")
    return weight.view(heads, nope + v_dim, rank)


def absorbed_query_key(q_nope: torch.Tensor, weight: torch.Tensor, v_dim: int, q_pe: torch.Tensor,
                       latent: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       interleaved: bool, upcast_pairs: bool, early: bool = False,
                       cache: torch.Tensor | None = None, loc: torch.Tensor | None = None,
                       norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q_nope [n, heads, nope] (n <= MAX_ROWS), kv_b_proj's weight [heads * (nope + v_dim), rank] of q_nope's dtype
    and the rest as kernels.mla_rope.mla_query_key takes them -> (query [n, heads, rank + rope], key [n, 1, rank +
    rope]): the absorbed query (float32 sums, `absorbed_query_key_reference`) beside the rotated rope parts (bit for
    bit mla_query_key's), one launch. With `cache` (a latent pool's layer, [slots, 1, rank + rope] of q_nope's dtype)
    and `loc` ([n] slots) the key rows go into the cache at those slots instead (the KV store in the same launch),
    and None is returned for the key. `norm` (kv_a_layernorm's weight [rank] and epsilon): `latent` is not normed yet
    and the key rows take it normed as kernels.norm.rmsnorm norms it (the norm's launch saved)."""
    n, heads, nope = q_nope.shape
    rank = weight.shape[-1]
    w = _up_weight(weight, heads, nope, v_dim, rank)
    rope = q_pe.shape[-1]
    if (n > MAX_ROWS or weight.dtype != q_nope.dtype or q_pe.shape[:2] != (n, heads) or latent.shape != (n, rank)
            or k_pe.shape != (n, rope) or rope % 2 or cos.shape[-1] != rope or sin.shape != cos.shape
            or cos.shape[0] != n or any(t.stride(-1) != 1 for t in (q_nope, q_pe, latent, k_pe))):
        raise ValueError(f"absorbed_query_key takes q_nope [n <= {MAX_ROWS}, heads, nope] of the weight's dtype, q_pe "
                         f"[n, heads, rope], latent [n, rank], k_pe [n, rope], cos/sin [n, 1, rope] with unit last "
                         f"strides; got {tuple(q_nope.shape)} {q_nope.dtype}, weight {weight.dtype}, "
                         f"{tuple(q_pe.shape)}, {tuple(latent.shape)}, {tuple(k_pe.shape)}, {tuple(cos.shape)}")
    dtype = q_nope.dtype
    query = torch.empty((n, heads, rank + rope), dtype=dtype, device=q_nope.device)
    if cache is None:
        key = torch.empty((n, 1, rank + rope), dtype=dtype, device=q_nope.device)
    elif (cache.dim() != 3 or cache.shape[1:] != (1, rank + rope) or cache.dtype != dtype or cache.stride(-1) != 1
          or loc is None or loc.shape != (n,) or loc.stride(0) != 1):
        raise ValueError(f"a latent cache for absorbed_query_key is [slots, 1, {rank + rope}] of {dtype} with slots "
                         f"[{n}]; got {tuple(cache.shape)} {cache.dtype}, slots "
                         f"{None if loc is None else tuple(loc.shape)}")
    if norm is not None and (norm[0].shape != (rank,) or norm[0].device != latent.device):
        raise ValueError(f"absorbed_query_key's norm weight must be [{rank}] on {latent.device}, got "
                         f"{tuple(norm[0].shape)} on {norm[0].device}")
    if n == 0:
        return query, (key if cache is None else None)
    cos, sin = cos.reshape(n, rope).contiguous(), sin.reshape(n, rope).contiguous()
    round_to = rounding(q_pe.dtype, cos.dtype, interleaved, upcast_pairs)
    mid = q_pe.dtype if interleaved else round_to
    pdl = pdl_on(query)
    block_r = min(QUERY_BLOCK_R, triton.next_power_of_2(rank))
    _absorb_query_kernel[(heads, triton.cdiv(rank, block_r))](
        q_nope, w, q_pe, latent, k_pe, cos, sin, query, key if cache is None else cache,
        query if loc is None else loc, query if norm is None else norm[0], 0.0 if norm is None else norm[1], n,
        heads, q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        latent.stride(0), k_pe.stride(0), cos.stride(0), w.stride(0), (key if cache is None else cache).stride(0),
        NOPE=nope, RANK=rank, ROPE=rope, AT_SLOTS=cache is not None, NORM=norm is not None,
        BLOCK_RANK=triton.next_power_of_2(rank), BLOCK_NOPE=triton.next_power_of_2(nope), BLOCK_R=block_r,
        BLOCK_HALF=triton.next_power_of_2(rope // 2), INTERLEAVED=interleaved, ROUND=_TL[round_to], MID=_TL[mid],
        PDL=pdl, EARLY=early, num_warps=4, enable_fp_fusion=False, **({"launch_pdl": True} if pdl else {}))
    return query, (key if cache is None else None)


def absorbed_values(out: torch.Tensor, weight: torch.Tensor, nope: int, v_dim: int, early: bool = False
                    ) -> torch.Tensor:
    """Attention's output out [n, heads, >= rank] (n <= MAX_ROWS; its leading rank columns are the latent part) and
    kv_b_proj's weight [heads * (nope + v_dim), rank] -> each head's value, [n, heads * v_dim] in out's dtype (float32
    sums, `absorbed_values_reference`), one launch."""
    n, heads, _ = out.shape
    rank = weight.shape[-1]
    w = _up_weight(weight, heads, nope, v_dim, rank)
    if n > MAX_ROWS or out.shape[-1] < rank or out.stride(-1) != 1 or weight.dtype != out.dtype:
        raise ValueError(f"absorbed_values takes out [n <= {MAX_ROWS}, heads, >= {rank}] of the weight's dtype with a "
                         f"unit last stride; got {tuple(out.shape)} {out.dtype} strides {out.stride()}, weight "
                         f"{weight.dtype}")
    values = torch.empty((n, heads * v_dim), dtype=out.dtype, device=out.device)
    if n == 0:
        return values
    pdl = pdl_on(values)
    block_v = min(VALUE_BLOCK_V, triton.next_power_of_2(v_dim))
    _absorb_value_kernel[(heads, triton.cdiv(v_dim, block_v))](
        out, w, values, n, out.stride(0), out.stride(1), w.stride(0), values.stride(0), NOPE=nope, RANK=rank,
        V_DIM=v_dim, BLOCK_V=block_v, BLOCK_RANK=triton.next_power_of_2(rank), PDL=pdl, EARLY=early, num_warps=4,
        **({"launch_pdl": True} if pdl else {}))
    return values


def absorbed_query_key_reference(q_nope: torch.Tensor, weight: torch.Tensor, v_dim: int, q_pe: torch.Tensor,
                                 latent: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                 interleaved: bool, upcast_pairs: bool,
                                 norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin: the absorbed query in float32, rounded once, then mla_query_key_reference's rows (the latent normed
    first by kernels.norm's twin where `norm` is given)."""
    if norm is not None:
        from radixmesh.kernels.norm import rmsnorm_reference

        latent = rmsnorm_reference(latent, *norm)
    n, heads, nope = q_nope.shape
    w = _up_weight(weight, heads, nope, v_dim, weight.shape[-1])
    q_latent = torch.einsum("nhd,hdr->nhr", q_nope.float(), w[:, :nope].float()).to(q_nope.dtype)
    return mla_query_key_reference(q_latent, q_pe, latent, k_pe, cos, sin, interleaved, upcast_pairs)


def absorbed_values_reference(out: torch.Tensor, weight: torch.Tensor, nope: int, v_dim: int) -> torch.Tensor:
    """The twin: each head's value in float32, rounded once to out's dtype, [n, heads * v_dim]."""
    n, heads, _ = out.shape
    rank = weight.shape[-1]
    w = _up_weight(weight, heads, nope, v_dim, rank)
    values = torch.einsum("nhr,hjr->nhj", out[..., :rank].float(), w[:, nope:].float())
    return values.to(out.dtype).reshape(n, heads * v_dim)
