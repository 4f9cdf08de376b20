"""The one-row fp8 decode product with the RMSNorm before it (and the residual add before that) in the same launch:
y = rmsnorm(h + d) @ (w * scales)^T for one token, where kernels.norm.fused_add_rmsnorm and kernels.fp8_gemv.
fp8_gemv_row would take two launches.

Why (issue 52's batch-1 goal): in the 8B fp8 step each RMSNorm is a one-program launch of ~1.6 us in the chain of
dependent kernels (two a layer, ~0.1 ms a step, 4% of the H100's 2.65-ms fp8 floor), while the product after it reads
all of x in every program anyway. Here every program loads its weight rows first (they do not depend on the kernel
before, and the loads are in flight during what follows), then h and d whole, sums squares (a block reduction), and
multiplies its rows by the normed x; program 0 also writes the residual sum h + d. What a program pays is the
reduction and the norm's elementwise work on K values, against a launch and its link in the chain.

Numerics are kernels.norm's (Hugging Face's): the residual sum rounded to h's dtype, float32 statistics over it,
h * rsqrt(mean(h^2) + eps) rounded to h's dtype, times the norm weight, rounded to h's dtype; then the product as
kernels.fp8_gemv's (the x column scaled by its block's scale block-wise, float32 sums, the row's scale per channel,
the bias added in float32, one rounding to h's dtype). The float32 sum of squares is added in another order than the
norm kernel's, so rstd may differ in its last bits and a normed value by one rounding: the twin is the reference
norm followed by the reference product, within the product's tolerance.

The residual sum goes to `residual_out`, which must not alias h or d: the other programs are still reading them.
Whole rows a program: K is a constant of the compiled kernel and one load covers it (the norm's reduction needs all
of x before the first product), so this serves the hidden-size K of qkv and gate_up (4096 at the 8B shape).

The engine takes it per weight shape where engine.decode_products timed it faster than the two launches on this GPU
(NORM_PLAN; engine.models.llama.norm_then_linear), under RADIXMESH_FP8_NORM_IN_PRODUCT=1 until it has run on a GPU;
benchmarks.fp8_norm_rows times it at the 8B shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels.fp8_gemv import INTERPRETED_ROWS, check_operands
from radixmesh.kernels.norm import rms_normed
from radixmesh.kernels.runtime import interpreting, pdl_on

NORM_ROW_CONFIG = (2, 4)  # (BLOCK_N, num_warps): two rows a program, as fp8_gemv_row's default
# (n, k) -> config: the fp8 weight shapes whose one-row products after a decoder's RMSNorm take this kernel
# (engine.decode_products.fp8_norm_plan times it against the two launches; engine.models.llama.norm_then_linear)
NORM_PLAN: dict[tuple[int, int], tuple[int, int]] = {}


def set_norm_plan(plan: dict[tuple[int, int], tuple[int, int]]) -> None:
    """The weight shapes (and configs) whose norm and one-row product run in one launch in this process; graphs
    captured afterwards follow it."""
    NORM_PLAN.clear()
    NORM_PLAN.update(plan)


@triton.jit
def _fp8_gemv_row_norm_kernel(H, D, G, W, S, B, Y, R_OUT, N, stride_wn, stride_sn, eps, K: tl.constexpr,
                              KP: tl.constexpr, BLOCK_N: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                              BLOCKWISE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
                              HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    k = tl.arange(0, KP)
    k_mask = k < K
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # h and d are the kernels' before outputs
    # the rows first: their loads go out before the reduction below and are in flight while it runs
    w = tl.load(W + n.to(tl.int64)[:, None] * stride_wn + k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                other=0.0, eviction_policy="evict_first")
    dtype = H.dtype.element_ty
    h = tl.load(H + k, mask=k_mask, other=0.0)
    if HAS_RESIDUAL:
        h = (h.to(tl.float32) + tl.load(D + k, mask=k_mask, other=0.0).to(tl.float32)).to(dtype)
        if pid == 0:
            tl.store(R_OUT + k, h, mask=k_mask)
    normed = rms_normed(h.to(tl.float32), eps, K, dtype)
    x = (normed * tl.load(G + k, mask=k_mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    if BLOCKWISE:
        x = x * tl.load(S + (pid * BLOCK_N // BN) * stride_sn + k // BK, mask=k_mask, other=0.0)
    y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if not BLOCKWISE:
        y *= tl.load(S + n, mask=n_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(B + n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(Y + n, y.to(Y.dtype.element_ty), mask=n_mask)


def fp8_gemv_row_norm(h: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      w: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None,
                      bias: torch.Tensor | None = None, residual_out: torch.Tensor | None = None, pdl: bool = False,
                      config: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h [1, k] (and `residual` [1, k] of its dtype, added first), norm_weight [k] -> (rmsnorm(h + residual) @ (w *
    scales)^T (+ bias) [1, n] in h's dtype, h + residual written to `residual_out` (a new tensor if None; None
    without a residual)). `config`: (BLOCK_N, num_warps), default NORM_ROW_CONFIG. Module docstring."""
    check_operands(h, w, scales, block, bias, 1)
    n, k = w.shape
    if (norm_weight.shape != (k,) or norm_weight.dtype != h.dtype or norm_weight.device != h.device
            or not norm_weight.is_contiguous()):
        raise ValueError(f"the norm weight [{k}] of h's dtype on its device, got {tuple(norm_weight.shape)} "
                         f"{norm_weight.dtype} on {norm_weight.device} for h {tuple(h.shape)} {h.dtype}")
    if residual is not None and (residual.shape != h.shape or residual.dtype != h.dtype
                                 or not residual.is_contiguous()):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match h {tuple(h.shape)} {h.dtype}")
    if residual is not None:
        residual_out = torch.empty_like(h) if residual_out is None else residual_out
        if residual_out.shape != h.shape or residual_out.dtype != h.dtype or not residual_out.is_contiguous():
            raise ValueError(f"residual_out {tuple(residual_out.shape)} {residual_out.dtype} must match h")
        if any(residual_out.data_ptr() == t.data_ptr() for t in (h, residual)):
            raise ValueError("residual_out must not alias h or the residual: other programs still read them")
    block_n, warps = config or NORM_ROW_CONFIG
    if interpreting() and config is None:
        block_n = INTERPRETED_ROWS
    if block is not None:
        block_n = min(block_n, block[0])
    pdl = pdl and pdl_on(h)
    y = torch.empty((1, n), dtype=h.dtype, device=h.device)
    _fp8_gemv_row_norm_kernel[(triton.cdiv(n, block_n),)](
        h, h if residual is None else residual, norm_weight, w, scales, w if bias is None else bias.contiguous(), y,
        h if residual is None else residual_out, n, w.stride(0), scales.stride(0) if block is not None else 0, eps,
        K=k, KP=triton.next_power_of_2(k), BLOCK_N=block_n, BN=block[0] if block else 1, BK=block[1] if block else 1,
        BLOCKWISE=block is not None, HAS_RESIDUAL=residual is not None, PDL=pdl, HAS_BIAS=bias is not None,
        num_warps=warps, num_stages=1, **({"launch_pdl": True} if pdl else {}))
    return y, (residual_out if residual is not None else None)
