"""Skinny matrix products for decode, y = x @ W^T with 1-16 rows in x, chained by programmatic dependent launch.

A batch-1 decode step is a chain of matrix-vector products whose time is reading the weights, and each product loses
a few microseconds at its boundaries: the next kernel starts streaming only once the previous one has drained. With
programmatic dependent launch (Hopper and later), a kernel launched with `pdl=True` may start while the kernel before
it still runs: its programs first pull the opening columns of their weight rows into L2 (weights do not change while a
forward runs, so they do not depend on the kernel before), then wait (`gdc_wait`) until that kernel's writes are
visible, and only then read x and write y. Every program also lets its own dependents launch as soon as it starts;
they can only start once every program of this kernel has, so a chain never starves itself of SMs.

Whether the model's decode products run here or on cuBLAS is chosen per GPU at start-up (engine.decode_products):
on an H100 this kernel is faster under PDL, on an H200 cuBLAS is.

One program owns BLOCK_N output columns and streams their rows of W (contiguous along K, so loads are wide) through
Triton's software pipeline, accumulating in float32; no split-K, so no second reduction kernel. The rows of x are
padded to 16 for the tensor-core dot (the padding costs arithmetic, which is free here, not bandwidth).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels.runtime import LINE_BYTES, dot_needs_upcast, pdl_on, prefetch_l2

MAX_ROWS = 16


@triton.jit
def _gemv_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE_ELEMS: tl.constexpr, PDL: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    w_rows = W + n.to(tl.int64) * stride_wn  # [BLOCK_N]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        if PREFETCH_LINES > 0:
            cols = tl.arange(0, PREFETCH_LINES) * LINE_ELEMS  # the first column of each 128-byte line
            prefetch_l2(tl.where(n_mask[:, None] & (cols[None, :] < K), w_rows[:, None] + cols[None, :], W))
        tl.extra.cuda.gdc_wait()  # from here on the kernel before has finished and its writes are visible
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        w = tl.load(w_rows[:, None] + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K], read once
        x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & k_mask[None, :], other=0.0)
        if UPCAST:
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:  # added in float32 before the one rounding, as cuBLAS's epilogue does
        acc += tl.load(B + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty),
             mask=(m[:, None] < M) & n_mask[None, :])


def default_config(n: int, k: int, element_size: int = 2) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, PREFETCH_K): enough programs for the SMs, 16-32 KB of weights per
    stage, and the first 2048 columns of each program's rows pulled into L2 ahead of the wait (the fastest of 0, 1024,
    2048 and 4096 in benchmarks.pdl_chain on an H100)."""
    block_n = 16 if n <= 8192 else 32
    block_k = max(64, min(1024 // element_size, triton.next_power_of_2(k)))
    return block_n, block_k, 4, 4, min(2048, triton.next_power_of_2(k))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
         pdl: bool = False, config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [m, k] (m <= 16, unit stride along k), weight [n, k] contiguous of x's dtype (bias [n]) -> x @ weight^T
    (+ bias) [m, n] in x's dtype, written to `out` ([m, n], unit stride along n) or a new tensor. `pdl`: launch it as
    a programmatic dependent of the kernel before (where kernels.runtime.pdl_on says so). `config` overrides
    default_config for tuning."""
    m, k = x.shape
    n = weight.shape[0]
    if (m > MAX_ROWS or weight.dim() != 2 or weight.shape[1] != k or weight.dtype != x.dtype or x.stride(1) != 1
            or not weight.is_contiguous() or (bias is not None and bias.shape != (n,))):
        raise ValueError(f"gemv takes x [m <= {MAX_ROWS}, k] and a contiguous weight [n, k] of x's dtype; got x "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()}, weight {tuple(weight.shape)} "
                         f"{weight.dtype}, bias {None if bias is None else tuple(bias.shape)}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{m}, {n}] {x.dtype} with unit column stride, got {tuple(out.shape)} "
                         f"{out.dtype} strides {out.stride()}")
    if m == 0:
        return out
    block_n, block_k, warps, stages, prefetch_k = config or default_config(n, k, weight.element_size())
    pdl = pdl and pdl_on(x)
    launch = {"launch_pdl": True} if pdl else {}
    line = LINE_BYTES // weight.element_size()
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight if bias is None else bias.contiguous(), out, m, n, k, x.stride(0), weight.stride(0),
        out.stride(0), BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        PREFETCH_LINES=triton.cdiv(prefetch_k, line) if pdl else 0, LINE_ELEMS=line, PDL=pdl,
        UPCAST=dot_needs_upcast(x.dtype), PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        HAS_BIAS=bias is not None, num_warps=warps, num_stages=stages, **launch)
    return out


# ---- one row: a product per row block, on the CUDA cores ----------------------------------------------------------
# At one row the tensor-core tile above wastes 15 of its 16 rows and stages every weight tile through shared memory.
# `gemv_row` reads each program's BLOCK_N weight rows straight into registers, whole rows at once (K is a constant of
# the compiled kernel, so the K / BLOCK_K loads are unrolled and go out together: ~16-60 KB in flight per program),
# and multiplies on the CUDA cores in float32. Over the 8B shape's 128 decode products in a CUDA graph, a kernel per
# product this way took 1.03x the copy-bandwidth floor on an H200 against cuBLAS's 1.21x (benchmarks.
# persistent_products, 2026-11-29). Under PDL a program lets its dependents launch and waits; it loads nothing
# before the wait.

# How a gemv_row launch takes part in programmatic dependent launch (the config's 4th field): not at all (a plain
# launch, waiting for the kernel before), as a dependent that only waits, or one that first pulls its block's
# weights into L2. Inside the 8B shape's batch-1 step on an H200 the three took 4.36-4.40, 3.93 and 4.64-4.67 ms
# (benchmarks.pdl_step, 2026-11-29): the prefetch of every early program's whole block floods the memory system
# the kernel before is streaming from. Nor does it pay when the small kernel before lets it launch only after its
# own wait (the product before finished): that kernel's loads queue behind the pull, and the H100's 8B fp8 step took
# 3.47 ms against 3.24-3.27 (twenty-second session; o_proj reached its floor, attention's merge grew 3 us a layer).
ROW_PLAIN, ROW_PDL, ROW_PDL_PREFETCH = 0, 1, 2
ROW_CONFIG = (2, 2048, 4, ROW_PDL)  # (BLOCK_N, BLOCK_K, num_warps, PDL mode): the best of 9 tiles in the H200 step


@triton.jit
def _gemv_row_kernel(X, W, B, Y, N, stride_wn, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PREFETCH_LINES: tl.constexpr, LINE_ELEMS: tl.constexpr, PDL: tl.constexpr,
                     HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    rows = W + n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        if PREFETCH_LINES > 0:  # the block's weights into L2 while the kernel before ends (weights do not change)
            cols = tl.arange(0, PREFETCH_LINES) * LINE_ELEMS
            prefetch_l2(tl.where(n_mask[:, None] & (cols[None, :] < K), rows + cols[None, :], W))
        tl.extra.cuda.gdc_wait()  # x is the kernel before's output
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: every load of the block is independent of the others
        k = k0 + tl.arange(0, BLOCK_K)
        if k0 + BLOCK_K <= K:
            w = tl.load(rows + k[None, :], mask=n_mask[:, None], other=0.0, eviction_policy="evict_first")
            x = tl.load(X + k)
        else:  # the last, partial chunk
            w = tl.load(rows + k[None, :], mask=n_mask[:, None] & (k[None, :] < K), other=0.0,
                        eviction_policy="evict_first")
            x = tl.load(X + k, mask=k < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(B + n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(Y + n, y.to(Y.dtype.element_ty), mask=n_mask)


def gemv_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
             pdl: bool = False, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """x [1, k] (unit stride), weight [n, k] contiguous of x's dtype (bias [n]) -> x @ weight^T (+ bias) [1, n] in x's
    dtype, written to `out` ([1, n], unit stride) or a new tensor; float32 sums. `pdl` and `out` as for gemv;
    `config`: (BLOCK_N, BLOCK_K, num_warps[, PDL mode: ROW_PLAIN, ROW_PDL (the default), ROW_PDL_PREFETCH]),
    default ROW_CONFIG. A kernel is compiled per k."""
    k = x.shape[-1]
    n = weight.shape[0]
    if (x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or weight.shape[1] != k or weight.dtype != x.dtype
            or x.stride(1) != 1 or not weight.is_contiguous() or (bias is not None and bias.shape != (n,))):
        raise ValueError(f"gemv_row takes x [1, k] and a contiguous weight [n, k] of x's dtype; got x "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()}, weight {tuple(weight.shape)} "
                         f"{weight.dtype}, bias {None if bias is None else tuple(bias.shape)}")
    if out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    elif out.shape != (1, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [1, {n}] {x.dtype} with unit column stride, got {tuple(out.shape)} "
                         f"{out.dtype} strides {out.stride()}")
    block_n, block_k, warps, *mode = config or ROW_CONFIG
    mode = mode[0] if mode else ROW_PDL
    block_k = min(block_k, triton.next_power_of_2(k))
    pdl = pdl and pdl_on(x) and mode != ROW_PLAIN
    line = LINE_BYTES // weight.element_size()
    prefetch = triton.next_power_of_2(triton.cdiv(k, line)) if pdl and mode == ROW_PDL_PREFETCH else 0
    _gemv_row_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight if bias is None else bias.contiguous(), out, n, weight.stride(0), K=k, BLOCK_N=block_n,
        BLOCK_K=block_k, PREFETCH_LINES=prefetch, LINE_ELEMS=line, PDL=pdl,
        HAS_BIAS=bias is not None, num_warps=warps, num_stages=1, **({"launch_pdl": True} if pdl else {}))
    return out


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch twin: the product (plus bias) in float32, rounded once to x's dtype."""
    y = x.float() @ weight.float().t()
    return (y if bias is None else y + bias.float()).to(x.dtype)
