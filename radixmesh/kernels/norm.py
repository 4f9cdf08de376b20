"""RMSNorm, and residual add + RMSNorm, over the last dim: one Triton pass over the rows, and their plain-torch twins.

Numerics are those of engine.layers.norm.RMSNorm and the residual add of engine.models.llama (Hugging Face's): the
residual sum is rounded to the input dtype; the statistics are float32 over that rounded sum; h * rsqrt(mean(h^2) + eps)
is rounded to the input dtype, then multiplied by the weight in float32 and rounded once to the result dtype (how
PyTorch multiplies two half-precision tensors; their product is exact in float32, so this is the correctly rounded
product). The result dtype is promote_types(x.dtype, weight.dtype), as in the torch layer.

Gemma's RMSNorm (engine.layers.norm.GemmaRMSNorm, `offset=True` here) keeps h * rsqrt(mean(h^2) + eps) in float32,
multiplies it by 1 + weight in float32 and rounds once to x's dtype. Gemma 2 and 3 norm each sublayer's output before it
joins the residual stream and norm the sum again for the next sublayer: `gemma_sandwich` does that chain in one pass
(the post-norm rounded to the dtype, the residual sum rounded to it, then the next norm), as torch computes it op by op.

OLMo 2's RMSNorm (engine.models.olmo2.Olmo2RMSNorm, `olmo2_rmsnorm`) multiplies by the weight itself in float32 and
rounds once; its decoder adds each sublayer's normed output to the residual stream with no norm after the sum
(`olmo2_post_add`: the norm, rounded, then the sum, rounded, in one pass).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels.runtime import pdl_enter, pdl_options

_MIN_PROGRAMS = 528  # 4 programs per SM of a 132-SM H100: rows are packed only while this many programs remain
_MAX_TILE = 4096  # elements of one program's tile when short rows (per-head q/k norm) are packed together


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, post_w_ptr, n_rows, inner, dim, eps,
                    x_stride_outer, x_stride_inner, res_stride_outer, res_stride_inner,
                    HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                    OFFSET: tl.constexpr = False, POST: tl.constexpr = False, FLOAT_WEIGHT: tl.constexpr = False,
                    FINAL: tl.constexpr = True):
    pdl_enter(PDL)
    # Row r of the [outer, inner, dim] input sits at (r // inner) * stride_outer + (r % inner) * stride_inner; the
    # outputs are contiguous [n_rows, dim].
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # [ROWS]
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    mask = (rows < n_rows)[:, None] & (cols < dim)[None, :]  # [ROWS, BLOCK]
    outer, within = rows // inner, rows % inner
    x_off = (outer * x_stride_outer + within * x_stride_inner)[:, None] + cols[None, :]
    out_off = rows[:, None] * dim + cols[None, :]
    dtype = x_ptr.dtype.element_ty
    h = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)  # [ROWS, BLOCK]
    # OFFSET (Gemma) or FLOAT_WEIGHT (OLMo 2): the weight (1 + weight with OFFSET) applied in float32, one rounding
    if POST:  # the norm of the sublayer's output first (post_w), rounded before it joins the residual
        post_rstd = tl.rsqrt(tl.sum(h * h, axis=1) / dim + eps)
        post_w = tl.load(post_w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
        if OFFSET:
            post_w = 1.0 + post_w
        h = (h * post_rstd[:, None] * post_w[None, :]).to(dtype).to(tl.float32)
    if HAS_RESIDUAL:
        res_off = (outer * res_stride_outer + within * res_stride_inner)[:, None] + cols[None, :]
        r = tl.load(res_ptr + res_off, mask=mask, other=0.0).to(tl.float32)
        summed = (h + r).to(dtype)
        tl.store(res_out_ptr + out_off, summed, mask=mask)
        h = summed.to(tl.float32)
    if FINAL:  # (without it, the post-norm's sum is the result: OLMo 2's decoder)
        rstd = tl.rsqrt(tl.sum(h * h, axis=1) / dim + eps)  # [ROWS]
        w = tl.load(w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)  # [BLOCK]
        if OFFSET:  # Gemma: float32 throughout, (1 + weight), one rounding
            y = h * rstd[:, None] * (1.0 + w)[None, :]
        elif FLOAT_WEIGHT:
            y = h * rstd[:, None] * w[None, :]
        else:
            y = (h * rstd[:, None]).to(dtype).to(tl.float32) * w[None, :]
        tl.store(out_ptr + out_off, y.to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., dim], weight [dim] -> weight * x / rms(x) [..., dim], written to `out` (contiguous) or a new tensor."""
    return _launch(x, None, weight, eps, out, None)[0]


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      out: torch.Tensor | None = None,
                      residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., dim] (one dtype), weight [dim] -> (rmsnorm(x + residual), x + residual), written to `out`
    and `residual_out` (contiguous; residual_out may be `residual` itself when that is contiguous) or new tensors."""
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    return _launch(x, residual, weight, eps, out, residual_out)


def gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gemma's RMSNorm: x [..., dim] (any row strides), weight [dim] (stored as an offset from 1) -> x / rms(x) * (1 +
    weight) in x's dtype; with `residual` (Gemma 1's pre-norm decoder) -> (norm(x + residual), x + residual)."""
    out, res_out = _launch(x, residual, weight, eps, None, None, offset=True)
    return out if residual is None else (out, res_out)


def gemma_sandwich(x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma 2/3 between sublayers: x (a sublayer's output) and residual [..., dim] -> (norm(s; weight), s) where s =
    residual + norm(x; post_weight), both Gemma norms, each result rounded to x's dtype as torch rounds it."""
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    if post_weight.shape != (x.shape[-1],) or post_weight.device != x.device:
        raise ValueError(f"post weight {tuple(post_weight.shape)} does not fit x {tuple(x.shape)}")
    return _launch(x, residual, weight, eps, None, None, offset=True, post_weight=post_weight)


def olmo2_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """OLMo 2's RMSNorm: x [..., dim] (any row strides), weight [dim] -> weight * x / rms(x) in float32, rounded once
    to x's dtype."""
    return _launch(x, None, weight, eps, None, None, float_weight=True)[0]


def olmo2_post_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """OLMo 2 between sublayers: x (a sublayer's output), residual [..., dim] -> residual + olmo2_rmsnorm(x, weight),
    the norm and the sum each rounded to x's dtype as torch rounds them; one launch."""
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    return _launch(x, residual, weight, eps, None, None, float_weight=True, post_weight=weight, final=False)[1]


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out: torch.Tensor | None, res_out: torch.Tensor | None, offset: bool = False,
            post_weight: torch.Tensor | None = None, float_weight: bool = False,
            final: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    dim = x.shape[-1]
    if weight.shape != (dim,) or weight.device != x.device:
        raise ValueError(f"weight {tuple(weight.shape)} on {weight.device} does not fit x {tuple(x.shape)}")
    if final:
        out = _output(out, x, x.dtype if offset or float_weight else torch.promote_types(x.dtype, weight.dtype))
    if residual is not None:
        res_out = _output(res_out, x, x.dtype)
    n_rows = x.numel() // dim if dim else 0
    if n_rows == 0:
        return out, res_out
    store = out if final else res_out  # (without a final norm the kernel stores only the sum)
    x3 = _as_rows(x)
    r3 = x3 if residual is None else _as_rows(residual)
    block = triton.next_power_of_2(dim)
    rows = _rows_per_program(n_rows, block)
    _rmsnorm_kernel[(triton.cdiv(n_rows, rows),)](
        x3, r3, weight.contiguous(), store, store if res_out is None else res_out,
        weight if post_weight is None else post_weight.contiguous(), n_rows, x3.shape[1], dim, eps,
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        HAS_RESIDUAL=residual is not None, ROWS=rows, BLOCK=block, OFFSET=offset, POST=post_weight is not None,
        FLOAT_WEIGHT=float_weight, FINAL=final, num_warps=_num_warps(rows * block, x.element_size()), **pdl_options(x))
    return out, res_out


def _output(out: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if out is None:
        return torch.empty(like.shape, dtype=dtype, device=like.device)
    if out.shape != like.shape or out.dtype != dtype or out.device != like.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(like.shape)} {dtype} tensor on {like.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return out


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., dim] as an [outer, inner, dim] view with unit stride in dim (a copy only where no such view exists)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-2] if x.dim() > 1 else 1, x.shape[-1])


def _rows_per_program(n_rows: int, block: int) -> int:
    """Pack short rows into tiles of up to _MAX_TILE elements, but only while enough programs remain to fill the GPU."""
    rows = max(1, _MAX_TILE // block)
    while rows > 1 and triton.cdiv(n_rows, rows) < _MIN_PROGRAMS:
        rows //= 2
    return rows


def _num_warps(tile: int, element_size: int) -> int:
    """Warps such that each thread still moves at least one 16-byte vector of the tile (1 to 8 warps)."""
    return max(1, min(8, tile * element_size // (16 * 32)))


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The twin of `rmsnorm`: engine.layers.norm.RMSNorm.forward, op for op."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def gemma_rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The twin of `gemma_rmsnorm`: engine.layers.norm.GemmaRMSNorm.forward, op for op."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def gemma_sandwich_reference(x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of `gemma_sandwich`: Gemma 2's `hidden + post_norm(sublayer)`, then the next norm."""
    summed = residual + gemma_rmsnorm_reference(x, post_weight, eps)
    return gemma_rmsnorm_reference(summed, weight, eps), summed


def fused_add_rmsnorm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of `fused_add_rmsnorm`: the decoder layer's `hidden + ...` followed by RMSNorm."""
    summed = x + residual
    return rmsnorm_reference(summed, weight, eps), summed


def olmo2_rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The twin of `olmo2_rmsnorm`: engine.models.olmo2.Olmo2RMSNorm.forward on one rank, op for op."""
    h = x.float()
    return (weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def olmo2_post_add_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> torch.Tensor:
    """The twin of `olmo2_post_add`: OLMo 2's `hidden + post_norm(sublayer)`."""
    return residual + olmo2_rmsnorm_reference(x, weight, eps)
