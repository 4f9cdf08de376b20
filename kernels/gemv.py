"""Skinny matrix products for decode: y = x @ W^T with few rows in x (a decode batch of 1-16 requests).

At batch size 1 a decode step is a chain of matrix-vector products whose time is reading the weights. One program
owns BLOCK_N output columns and streams their rows of W (contiguous along K, so loads are wide) through a software
pipeline, accumulating in float32; no split-K, so no second reduction kernel. The rows of x are padded to 16 for the
tensor-core dot (the padding costs arithmetic, which is free here, not bandwidth).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.runtime import dot_needs_upcast

MAX_ROWS = 16


@triton.jit
def _gemv_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_mask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        w = tl.load(W + n[:, None].to(tl.int64) * stride_wn + k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0, eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K], read once
        x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & k_mask[None, :], other=0.0)
        if UPCAST:
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc += tl.dot(x, tl.trans(w))  # [BLOCK_M, BLOCK_N]
    tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty),
             mask=(m[:, None] < M) & n_mask[None, :])


def _config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): enough programs for the SMs, 16-32 KB of weights per stage."""
    block_n = 16 if n <= 8192 else 32
    block_k = 512 if k >= 4096 else max(64, triton.next_power_of_2(k))
    return block_n, block_k, 4, 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [m, k] (m <= 16, unit stride along k), weight [n, k] contiguous -> x @ weight^T (+ bias) [m, n] in x's
    dtype. `config` overrides (BLOCK_N, BLOCK_K, num_warps, num_stages) for tuning."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k or x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"gemv takes x [m <= {MAX_ROWS}, k] and a contiguous weight [n, k]; got x {tuple(x.shape)} "
                         f"strides {x.stride()}, weight {tuple(weight.shape)}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_n, block_k, warps, stages = config or _config(n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0), BLOCK_M=MAX_ROWS, BLOCK_N=block_n,
        BLOCK_K=block_k, UPCAST=dot_needs_upcast(x.dtype), num_warps=warps, num_stages=stages)
    return y if bias is None else y + bias


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch twin: the product in float32, rounded once to x's dtype."""
    y = (x.float() @ weight.float().t()).to(x.dtype)
    return y if bias is None else y + bias
