"""The W8A16 decode product of 2-16 rows, y = x @ (w * scales)^T: each fp8 weight element read once for all rows.
kernels.fp8_gemv's module docstring says how the weights and their scales are held; fp8_gemv_row keeps one row.

A program owns BLOCK_N output columns (weight rows) and streams their K columns once, multiplying each chunk against
all M rows of x (M padded to a power of two, at most 16), in one of two ways (the config's `mode`):

  CORES  float32 on the CUDA cores, as fp8_gemv_row: the chunk converted to float32 in registers (exact: e4m3 values
         are float32 values), each thread holding VEC consecutive columns of every weight row and of every x row, so
         one thread's products of a row pair are a chain of VEC fused multiply-adds into that pair's accumulator
         ([M_PAD, BLOCK_N] per thread); the threads' partial sums are added once, at the end. K is a constant of the
         kernel and its chunks are unrolled, so every weight load is independent of the others and goes out early.
         A weight element costs ~1.5 conversion instructions plus M_PAD multiply-adds, an x element one conversion
         per BLOCK_N weight rows: the compiled sm_90 code issues 5-5.5 instructions a weight element at 2 rows,
         8-9 at 4, 14-16 at 8, where an H200 streams weights at ~7.7 instructions a byte (~33 T thread-instructions
         a second against ~4.3 TB/s): within the stream's rate at 2 rows only.
  DOT    the tensor cores: the chunk converted to x's dtype in registers (exact: e4m3 values are bfloat16 and
         float16 values; to bfloat16 by way of float16 and float32, which avoids the slow F2F conversion unit) and
         multiplied against x padded to 16 rows (tl.dot, float32 accumulators): ~4.7 instructions a weight element
         whatever the rows (5.1 block-wise). x goes through shared memory each chunk, behind a barrier the compiler
         does not move loads across, so a chunk's weight loads go out one chunk ahead; the K loop covers DOT_STEP
         columns an iteration, its chunks unrolled (all of K unrolled would be ~17 thousand instructions, ~270 KB of
         code, at the 8B shape's down_proj). With about one chunk in flight a program, a shape of few column blocks
         (4096 columns: 128 blocks of 32, one per SM) would leave HBM idle, so K is split (dot_splits) until every
         SM has PROGRAMS_PER_SM programs: each split writes its float32 partial sums and a second, small kernel adds
         them in split order (deterministic, no atomics). K is a runtime argument: one compiled kernel serves every
         K and row count.

Scales: per output row (per-channel), applied once to each row's float32 sum; block-wise, each K-block's partial sum
is multiplied by its scale (CORES: each thread's VEC columns lie inside one K-block; DOT: BLOCK_K <= bk) and BLOCK_N
divides bn, so a program's rows share one block row. The bias is added in float32; the result is rounded once to x's
dtype. The plain-torch twin is kernels.fp8_gemv.fp8_linear_reference (the dequantized weight, one float32 product):
the same products, summed in another order. Each output (or partial sum) is written by one program, once: the
results do not depend on timing, and nothing waits on the host (CUDA graphs capture it). Under PDL (kernels.runtime)
a program lets its dependents launch and waits before it loads anything, as fp8_gemv_row does.

Which mode and tiles run a product is chosen per GPU at start-up by engine.decode_products (ROWS_PLAN, by weight
shape and padded row count), else ROWS_CONFIG.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from radixmesh.kernels.fp8_gemv import MAX_ROWS, check_operands
from radixmesh.kernels.runtime import dot_needs_upcast, interpreting, pdl_enter, pdl_on

CORES, DOT = "cores", "dot"  # a config's mode
VEC = 8  # CORES: consecutive columns a thread holds of each row (8 bytes of weights, 16 of each 16-bit x row)
# (BLOCK_N, BLOCK_K, num_warps, mode) by padded row count, before any measurement: the CUDA cores while the rows'
# multiply-adds fit the weights' stream (the module docstring), the tensor cores beyond
ROWS_CONFIG: dict[int, tuple[int, int, int, str]] = {2: (4, 512, 2, CORES), 4: (32, 256, 4, DOT),
                                                     8: (32, 256, 4, DOT), 16: (32, 256, 4, DOT)}
ROWS_PLAN: dict[tuple[int, int, int], tuple] = {}  # (n, k, padded rows) -> config (rows_config's)
DOT_STEP = 1024  # DOT: columns a loop iteration covers (BLOCK_K each unrolled chunk)
PROGRAMS_PER_SM = 4  # DOT: programs a K split aims at per SM (at ~86 registers a thread, 5 of 128 threads fit)
SUM_BLOCK = 1024  # outputs a program of the split sum adds up
INTERPRETED_ROWS = 64  # the interpreter runs programs one after another: there, fewer and larger ones


def padded_rows(m: int) -> int:
    """The row count a product of `m` rows (2..16) is compiled and planned for: the next power of two."""
    return max(2, triton.next_power_of_2(m))


def set_rows_plan(plan: dict[tuple[int, int, int], tuple]) -> None:
    """The configs by (n, k, padded rows) for this process (others take ROWS_CONFIG); graphs captured afterwards
    use them."""
    ROWS_PLAN.clear()
    ROWS_PLAN.update(plan)


@triton.jit
def _halves(t, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, V: tl.constexpr):
    # [A, B, C, V] -> its even and odd entries along the last axis, [A, B, C, V // 2] each (in-thread: free)
    return tl.split(tl.reshape(t, [A, B, C, V // 2, 2]))


@triton.jit
def _fma_chain(acc, w, x, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, C: tl.constexpr):
    # acc [M_PAD, BLOCK_N, C] + the sum over the last axis of w [1, BLOCK_N, C, 8] * x [M_PAD, 1, C, 8] (float32):
    # the 8 columns one at a time, so each step is one multiply-add per (row, weight row) pair
    w0, w1 = _halves(w, 1, BLOCK_N, C, 8)
    x0, x1 = _halves(x, M_PAD, 1, C, 8)
    w00, w01 = _halves(w0, 1, BLOCK_N, C, 4)
    w10, w11 = _halves(w1, 1, BLOCK_N, C, 4)
    x00, x01 = _halves(x0, M_PAD, 1, C, 4)
    x10, x11 = _halves(x1, M_PAD, 1, C, 4)
    a, b = tl.split(w00)
    c, d = tl.split(x00)
    acc += a * c
    acc += b * d
    a, b = tl.split(w01)
    c, d = tl.split(x01)
    acc += a * c
    acc += b * d
    a, b = tl.split(w10)
    c, d = tl.split(x10)
    acc += a * c
    acc += b * d
    a, b = tl.split(w11)
    c, d = tl.split(x11)
    acc += a * c
    acc += b * d
    return acc


@triton.jit(do_not_specialize=["M"])  # (one compiled kernel for every row count of a padding)
def _rows_cores_kernel(X, W, S, B, Y, M, N, stride_xm, stride_wn, stride_sn, stride_ym, K: tl.constexpr,
                       M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, BLOCKWISE: tl.constexpr, PDL: tl.constexpr, HAS_BIAS: tl.constexpr):
    C: tl.constexpr = BLOCK_K // 8  # column groups of a chunk, one per thread (and more when BLOCK_K is larger)
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.arange(0, M_PAD)
    m_mask = m < M
    group = tl.arange(0, C) * 8
    cols = group[:, None] + tl.arange(0, 8)[None, :]  # [C, 8]
    w_rows = W + n.to(tl.int64)[None, :, None, None] * stride_wn  # [1, BLOCK_N, 1, 1]
    x_rows = X + m[:, None, None, None] * stride_xm  # [M_PAD, 1, 1, 1]
    w_ok = n_mask[None, :, None, None]
    x_ok = m_mask[:, None, None, None]
    scale_row = S + (pid * BLOCK_N // BN) * stride_sn  # the program's block row (BLOCKWISE)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # x is the kernel before's output
    acc = tl.zeros([M_PAD, BLOCK_N, C], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: every load of the rows is independent of the others
        k = (k0 + cols)[None, None, :, :]  # [1, 1, C, 8]
        if k0 + BLOCK_K <= K:
            w = tl.load(w_rows + k, mask=w_ok, other=0.0, eviction_policy="evict_first")
            x = tl.load(x_rows + k, mask=x_ok, other=0.0)
        else:  # the last, partial chunk
            w = tl.load(w_rows + k, mask=w_ok & (k < K), other=0.0, eviction_policy="evict_first")
            x = tl.load(x_rows + k, mask=x_ok & (k < K), other=0.0)
        w = w.to(tl.float32)
        x = x.to(tl.float32)
        if BLOCKWISE:  # a thread's 8 columns lie in one K-block (8 divides bk): its partial sum, scaled once
            s = tl.load(scale_row + (k0 + group) // BK, mask=k0 + group < K, other=0.0)
            acc += _fma_chain(tl.zeros([M_PAD, BLOCK_N, C], tl.float32), w, x, M_PAD, BLOCK_N, C) * s[None, None, :]
        else:
            acc = _fma_chain(acc, w, x, M_PAD, BLOCK_N, C)
    y = tl.sum(acc, axis=2)  # [M_PAD, BLOCK_N]
    if not BLOCKWISE:
        y *= tl.load(S + n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(B + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m[:, None] * stride_ym + n[None, :], y.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _operand(w, x, VIA_HALF: tl.constexpr, UPCAST: tl.constexpr):
    # the fp8 tile in the dot's dtype, exactly: x's dtype (bfloat16 by way of float16 and float32), or float32
    if UPCAST:
        return w.to(tl.float32)
    if VIA_HALF:
        return w.to(tl.float16).to(tl.float32).to(tl.bfloat16)
    return w.to(x.dtype)


@triton.jit
def _dot_chunk(acc, w, x_rows, m_mask, scale_row, k0, kk, K, BLOCK_K: tl.constexpr, BK: tl.constexpr,
               BLOCKWISE: tl.constexpr, VIA_HALF: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # acc [16, BLOCK_N] + x's columns k0.. times the weight chunk w [BLOCK_N, BLOCK_K] (fp8; zeros past K)
    k = k0 + kk
    x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k[None, :] < K), other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    wt = tl.trans(_operand(w, x, VIA_HALF, UPCAST))  # [BLOCK_K, BLOCK_N]
    if BLOCKWISE:  # BLOCK_K divides bk: one scale per chunk
        s = tl.load(scale_row + k0 // BK, mask=k0 < K, other=0.0)
        return acc + tl.dot(x, wt, input_precision=PRECISION) * s
    return tl.dot(x, wt, acc, input_precision=PRECISION)


@triton.jit(do_not_specialize=["M"])  # (one compiled kernel for every row count)
def _rows_dot_kernel(X, W, S, B, Y, P, M, N, K, k_per, stride_xm, stride_wn, stride_sn, stride_ym,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     BLOCKWISE: tl.constexpr, UNROLL: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr,
                     VIA_HALF: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    k_lo = tl.program_id(1) * k_per  # this program's columns: k_lo .. k_lo + k_per (a split of K, or all of it)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.arange(0, 16)  # the rows padded to the tensor cores' 16
    m_mask = m < M
    kk = tl.arange(0, BLOCK_K)
    w_rows = W + n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    x_rows = X + m[:, None] * stride_xm  # [16, 1]
    scale_row = S + (pid * BLOCK_N // BN) * stride_sn  # the program's block row (BLOCKWISE)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + k_per, K), UNROLL * BLOCK_K):  # (k_per: a multiple of the step)
        for j in tl.static_range(UNROLL):  # unrolled: the compiler issues a chunk's loads ahead of the one before
            kj = k0 + j * BLOCK_K
            w = tl.load(w_rows + (kj + kk)[None, :], mask=n_mask[:, None] & ((kj + kk)[None, :] < K), other=0.0,
                        eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K] fp8
            acc = _dot_chunk(acc, w, x_rows, m_mask, scale_row, kj, kk, K, BLOCK_K, BK, BLOCKWISE, VIA_HALF, UPCAST,
                             PRECISION)
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:  # the split's float32 partial sums, P [splits, M, N] (block-wise: scaled), for _split_sum_kernel
        tl.store(P + (tl.program_id(1) * M + m[:, None]) * N + n[None, :], acc, mask=out_mask)
    else:
        if not BLOCKWISE:
            acc *= tl.load(S + n, mask=n_mask, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(B + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_sum_kernel(P, S, B, Y, M, N, stride_ym, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                      BLOCKWISE: tl.constexpr, PDL: tl.constexpr, HAS_BIAS: tl.constexpr):
    # y [M, N] = the splits' partial sums added in order (per-channel: times the row's scale), plus the bias,
    # rounded once
    pdl_enter(PDL)  # P is the kernel before's output
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    n = i % N
    y = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLITS):
        y += tl.load(P + s * M * N + i, mask=ok, other=0.0)
    if not BLOCKWISE:
        y *= tl.load(S + n, mask=ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(B + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + (i // N) * stride_ym + n, y.to(Y.dtype.element_ty), mask=ok)


def rows_config(m: int, n: int, k: int, block: tuple[int, int] | None,
                config: tuple | None = None) -> tuple[int, int, int, str, int]:
    """The (BLOCK_N, BLOCK_K, num_warps, mode, splits) an [m, k] x [n, k] product runs with: `config` ((BLOCK_N,
    BLOCK_K, num_warps, mode[, splits])), else ROWS_PLAN's for the shape, else ROWS_CONFIG's, fitted to the weight's
    blocks (BLOCK_N divides bn; DOT: BLOCK_K divides bk, and the CUDA cores where a block row is under the tensor
    cores' 16 columns) and to K; CORES: BLOCK_K at least VEC x 32 x num_warps, so that every thread holds its own
    columns of the chunk. splits: DOT's split of K, 0 for dot_splits' choice at launch (CORES: 1)."""
    block_n, block_k, warps, mode, *splits = (config or ROWS_PLAN.get((n, k, padded_rows(m)))
                                              or ROWS_CONFIG[padded_rows(m)])
    splits = splits[0] if splits else 0
    if interpreting() and config is None:
        block_n = INTERPRETED_ROWS
    if block is not None:
        block_n = min(block_n, block[0])
        if mode == DOT and block[0] < 16:
            mode = CORES
        if mode == DOT:
            block_k = min(block_k, block[1])
    if mode == DOT:
        return max(16, block_n), max(16, min(block_k, triton.next_power_of_2(k))), warps, mode, splits
    return block_n, max(VEC * 32 * warps, min(block_k, triton.next_power_of_2(k))), warps, mode, 1


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def dot_splits(n: int, k: int, block_n: int, step: int, sms: int) -> int:
    """How many parts DOT splits K into: none while the column blocks alone give every SM PROGRAMS_PER_SM programs
    (a program has about one chunk of weights in flight: fewer programs would leave HBM idle, as at the 8B shape's
    o_proj and down_proj, 4096 columns in 128 blocks of 32), else enough for that, a power of two, at most one per
    `step` columns of K (a loop iteration)."""
    want = PROGRAMS_PER_SM * sms // triton.cdiv(n, block_n)
    most = triton.cdiv(k, step)
    return max(1, min(1 << max(want, 1).bit_length() - 1, 1 << max(most, 1).bit_length() - 1))


def fp8_gemv_rows(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None,
                  bias: torch.Tensor | None = None, pdl: bool = False, config: tuple | None = None) -> torch.Tensor:
    """x [m <= 16, k] -> x @ (w * scales)^T (+ bias) [m, n] in x's dtype, float32 sums, each weight element read
    once (module docstring). `config`: (BLOCK_N, BLOCK_K, num_warps, CORES or DOT[, K splits, 0: dot_splits']),
    default rows_config's. CORES compiles a kernel per k and padded row count, DOT one for all; DOT with K split
    writes float32 partial sums that a second kernel adds (deterministic: in split order)."""
    check_operands(x, w, scales, block, bias, MAX_ROWS)
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_n, block_k, warps, mode, splits = rows_config(m, n, k, block, config)
    pdl = pdl and pdl_on(x)
    launch = {"launch_pdl": True} if pdl else {}
    common = dict(BLOCKWISE=block is not None, PDL=pdl, HAS_BIAS=bias is not None)
    scale_stride = scales.stride(0) if block is not None else 0
    b = w if bias is None else bias.contiguous()
    if mode == CORES:
        _rows_cores_kernel[(triton.cdiv(n, block_n),)](
            x, w, scales, b, y, m, n, x.stride(0), w.stride(0), scale_stride, y.stride(0), K=k,
            M_PAD=padded_rows(m), BLOCK_N=block_n, BLOCK_K=block_k, BN=block[0] if block else 1,
            BK=block[1] if block else 1, num_warps=warps, num_stages=1, **common, **launch)
        return y
    upcast = dot_needs_upcast(x.dtype)
    unroll = 1 if interpreting() else max(1, DOT_STEP // block_k)
    step = unroll * block_k  # columns a loop iteration covers
    splits = splits or dot_splits(n, k, block_n, step, _sm_count(x.device))
    k_per = triton.cdiv(triton.cdiv(k, step), splits) * step
    splits = triton.cdiv(k, k_per)
    partial = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else y
    _rows_dot_kernel[(triton.cdiv(n, block_n), splits)](
        x, w, scales, b, y, partial, m, n, k, k_per, x.stride(0), w.stride(0), scale_stride, y.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, BN=block[0] if block else 1, BK=block[1] if block else 1, UNROLL=unroll,
        SPLIT=splits > 1, VIA_HALF=x.dtype == torch.bfloat16 and not upcast, UPCAST=upcast,
        PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32", num_warps=warps, num_stages=1,
        **common, **launch)
    if splits > 1:
        _split_sum_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](
            partial, scales, b, y, m, n, y.stride(0), SPLITS=splits, BLOCK=SUM_BLOCK, num_warps=4, **common,
            **launch)
    return y
