"""Decode products with fp8 weights and 16-bit (or float32) activations, y = x @ (w * scales)^T: kernels.gemv's two
products reading a weight of one byte per element, the scales applied in the kernel. A batch-1 decode step's time is
reading the weights, so half the bytes is up to half the time; the activations are not quantized (no extra kernel,
no rounding of x).

Scales (engine.quantization.fp8_linear holds the weights so): per output row [N] (per-channel and per-tensor
checkpoints, and --quantization fp8), applied once to each row's float32 sum; or one per block of bn x bk
[ceil(N/bn), ceil(K/bk)], where a program's BLOCK_N rows lie in one block row (BLOCK_N divides bn), so each column
of x is scaled once for all of the program's rows.

`fp8_gemv_row` (one row, CUDA cores, as gemv_row: whole rows in flight, float32 products; with GROUP > 1 each
thread's GROUP consecutive products of a row are summed before they join its float32 accumulator, which then holds
BLOCK_K / GROUP columns a row instead of BLOCK_K: at sm_90 the registers a thread fall from 234 to 78 for the 8B
down_proj's (8, 1024, 4) tile (benchmarks.row_issue), so three times the programs fit an SM) and `fp8_gemv` (up to 16
rows, the tensor-core dot of gemv with the fp8 tile converted to x's dtype in registers, exact: e4m3 values are
bfloat16 and float16 values). Both launch as programmatic dependents under PDL (kernels.runtime) the way gemv_row
does, waiting before they read x. `ROW_PLAN` holds the one-row tiles engine.decode_products chose per weight shape.
Products of 2-16 rows run kernels.fp8_gemv_rows in the engine; fp8_gemv stays as its measured predecessor
(benchmarks.fp8_rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels.fp8_quant import FP8, dequantize_weight
from radixmesh.kernels.runtime import dot_needs_upcast, interpreting, pdl_on

MAX_ROWS = 16
ROW_CONFIG = (2, 2048, 4)  # (BLOCK_N, BLOCK_K, num_warps): gemv_row's H200 tiles, twice the elements per byte read
# Triton's interpreter runs the programs one after another in Python: there, fewer and larger ones (the same sums)
INTERPRETED_ROWS = 64
ROW_PLAN: dict[tuple[int, int], tuple[int, ...]] = {}  # (n, k) -> tiles (engine.decode_products.plan)


def set_row_plan(plan: dict[tuple[int, int], tuple[int, ...]]) -> None:
    """The one-row tiles by weight shape for this process (shapes not named take ROW_CONFIG); graphs captured
    afterwards use them."""
    ROW_PLAN.clear()
    ROW_PLAN.update(plan)


@triton.jit
def _fp8_gemv_row_kernel(X, W, S, B, Y, N, stride_wn, stride_sn, K: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCKWISE: tl.constexpr,
                         PDL: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    rows = W + n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    scale_row = S + (pid * BLOCK_N // BN) * stride_sn  # the program's block row (BLOCKWISE)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # x is the kernel before's output
    acc = tl.zeros([BLOCK_N, BLOCK_K // GROUP], tl.float32)  # GROUP consecutive products a sum (module docstring)
    for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: every load of the rows is independent of the others
        k = k0 + tl.arange(0, BLOCK_K)
        if k0 + BLOCK_K <= K:
            w = tl.load(rows + k[None, :], mask=n_mask[:, None], other=0.0, eviction_policy="evict_first")
            x = tl.load(X + k).to(tl.float32)
            if BLOCKWISE:
                x = x * tl.load(scale_row + k // BK)
        else:  # the last, partial chunk
            w = tl.load(rows + k[None, :], mask=n_mask[:, None] & (k[None, :] < K), other=0.0,
                        eviction_policy="evict_first")
            x = tl.load(X + k, mask=k < K, other=0.0).to(tl.float32)
            if BLOCKWISE:
                x = x * tl.load(scale_row + k // BK, mask=k < K, other=0.0)
        if GROUP == 1:
            acc += w.to(tl.float32) * x[None, :]
        else:
            acc += tl.sum(tl.reshape(w.to(tl.float32) * x[None, :], [BLOCK_N, BLOCK_K // GROUP, GROUP]), axis=2)
    y = tl.sum(acc, axis=1)
    if not BLOCKWISE:
        y *= tl.load(S + n, mask=n_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(B + n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(Y + n, y.to(Y.dtype.element_ty), mask=n_mask)


@triton.jit
def _fp8_gemv_kernel(X, W, S, B, Y, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BN: tl.constexpr, BLOCKWISE: tl.constexpr,
                     PDL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    w_rows = W + n.to(tl.int64)[:, None] * stride_wn
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K] fp8
        x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & k_mask[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        if BLOCKWISE:  # BLOCK_K = bk: one block of the program's block row per step
            acc += part * tl.load(S + (pid * BLOCK_N // BN) * stride_sn + k0 // BLOCK_K)
        else:
            acc += part
    if not BLOCKWISE:
        acc *= tl.load(S + n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(B + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty),
             mask=(m[:, None] < M) & n_mask[None, :])


def check_operands(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None,
           bias: torch.Tensor | None, max_rows: int) -> None:
    m, k = x.shape
    n = w.shape[0]
    want = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
    if (m > max_rows or w.dtype != FP8 or w.dim() != 2 or w.shape[1] != k or not w.is_contiguous()
            or x.stride(1) != 1 or tuple(scales.shape) != want or scales.dtype != torch.float32
            or not scales.is_contiguous() or (bias is not None and bias.shape != (n,))):
        raise ValueError(f"fp8 decode products take x [m <= {max_rows}, k] (unit stride along k), a contiguous fp8 "
                         f"weight [n, k] and float32 scales {want} (block {block}); got x {tuple(x.shape)} strides "
                         f"{x.stride()}, weight {tuple(w.shape)} {w.dtype}, scales {tuple(scales.shape)} "
                         f"{scales.dtype}, bias {None if bias is None else tuple(bias.shape)}")
    if block is not None and (block[0] & (block[0] - 1) or block[1] & (block[1] - 1) or block[1] < 16):
        raise ValueError(f"fp8 decode products need power-of-two blocks (bk >= 16), got {block}")


def fp8_gemv_row(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None,
                 bias: torch.Tensor | None = None, pdl: bool = False,
                 config: tuple[int, ...] | None = None) -> torch.Tensor:
    """x [1, k] -> x @ (w * scales)^T (+ bias) [1, n] in x's dtype, float32 sums (module docstring). `config`:
    (BLOCK_N, BLOCK_K, num_warps[, GROUP]), default ROW_PLAN's for this shape or ROW_CONFIG; GROUP (a power of two,
    default 1) consecutive products summed before they join the accumulator. A kernel is compiled per k."""
    check_operands(x, w, scales, block, bias, 1)
    n, k = w.shape
    block_n, block_k, warps, *group = config or ROW_PLAN.get((n, k), ROW_CONFIG)
    if interpreting() and config is None:
        block_n = INTERPRETED_ROWS
    if block is not None:
        block_n = min(block_n, block[0])
    block_k = min(block_k, triton.next_power_of_2(k))
    group = min(group[0] if group else 1, block_k)
    if group < 1 or group & (group - 1):
        raise ValueError(f"a one-row tile's GROUP is a power of two, got {config}")
    pdl = pdl and pdl_on(x)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _fp8_gemv_row_kernel[(triton.cdiv(n, block_n),)](
        x, w, scales, w if bias is None else bias.contiguous(), y, n, w.stride(0),
        scales.stride(0) if block is not None else 0, K=k, BLOCK_N=block_n, BLOCK_K=block_k,
        BN=block[0] if block else 1, BK=block[1] if block else 1, BLOCKWISE=block is not None, PDL=pdl,
        HAS_BIAS=bias is not None, GROUP=group, num_warps=warps, num_stages=1,
        **({"launch_pdl": True} if pdl else {}))
    return y


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None,
             bias: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """x [m <= 16, k] -> x @ (w * scales)^T (+ bias) [m, n] in x's dtype on the tensor cores, float32 sums."""
    check_operands(x, w, scales, block, bias, MAX_ROWS)
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_n = INTERPRETED_ROWS if interpreting() else 32 if n > 8192 else 16
    block_k = min(256, triton.next_power_of_2(k))
    if block is not None:
        block_n, block_k = min(block_n, block[0]), block[1]
    pdl = pdl and pdl_on(x)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, scales, w if bias is None else bias.contiguous(), y, m, n, k, x.stride(0), w.stride(0),
        scales.stride(0) if block is not None else 0, y.stride(0), BLOCK_M=MAX_ROWS, BLOCK_N=block_n,
        BLOCK_K=block_k, BN=block[0] if block else 1, BLOCKWISE=block is not None, PDL=pdl,
        UPCAST=dot_needs_upcast(x.dtype), PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        HAS_BIAS=bias is not None, num_warps=4, num_stages=4, **({"launch_pdl": True} if pdl else {}))
    return y


def fp8_linear_reference(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch twin of both: the weight dequantized to float32, one float32 product (plus bias), rounded once to
    x's dtype."""
    y = x.float() @ dequantize_weight(w, scales, block).t()
    return (y if bias is None else y + bias.float()).to(x.dtype)
