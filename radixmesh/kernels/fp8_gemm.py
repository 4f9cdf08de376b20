"""fp8 x fp8 GEMM with scales, y = (a * a_scales) @ (w * w_scales)^T in float32, rounded once to the output dtype;
and its plain-torch twin.

Two scale layouts, as the quantized weights come:
  block-wise   w's scales [ceil(N/bn), ceil(K/bk)] (one per bn x bk block, DeepSeek style) and a's per token and
               group of bk columns [M, ceil(K/bk)] (kernels.fp8_quant.group_quant(x, bk)): each BLOCK_K = bk step's
               product is scaled by its token's group scale and its block's scale before it is added, so BLOCK_N
               divides bn (one block row per program) and bk is a power of two of at least 32 (fp8 MMA's K)
  row-wise     w's scales [N] (per output channel) and a's [M, 1] (per token): the sums are scaled once at the end.
               On a GPU this is what torch._scaled_mm does (engine.quantization.fp8_linear prefers it there); this
               kernel is its fallback (float16 outputs, the interpreter) and the twin it is checked against
The tensor-core dot takes the fp8 tiles as they are (Hopper's fp8 MMA); products of fp8 values are exact in float32.
Tiles are Triton's usual square-ish ones by the row count, grouped along M for L2 reuse of w; for block-wise weights
a GPU may have tiles tuned per weight shape and row bucket (benchmarks.tune_fp8_gemm, saved as data in
kernels/configs/fp8-gemm-<GPU>.json, as SGLang keeps its kernels' configs), which the product then runs with. Every
tile sums each output's K in the same BLOCK_K = bk steps, in the same order.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from radixmesh.kernels.fp8_quant import FP8, dequantize_groups, dequantize_weight
from radixmesh.kernels.runtime import CONFIG_DIR, config_file

GROUP_M = 8
# Rows a tuned entry serves (up to each; the last also every longer product). 8192: a long prefill chunk's products,
# whose best tile the 1024-row one is not (H100, the 8B shapes: tiles tuned at 1024 rows, 8-13% faster there, left the
# 8k prefill as it was or slower)
BUCKETS = (32, 64, 128, 256, 1024, 8192)
# (BLOCK_M, BLOCK_N, num_warps, num_stages) benchmarks.tune_fp8_gemm tries for block-wise weights per row bucket; the
# first of each is _config's default. Narrower tiles fill the SMs where a bucket's row tiles times the column blocks
# are fewer than them (an 8B down_proj at 256 rows runs 2 x 32 = 64 programs of 128 x 128 on 132 SMs); four stages
# keep more of K in flight. Each compiles for sm_90 without spilling (Triton 3.6; 128 x 128 on 4 warps spills, so it
# is not here); every one passed its CUDA test against the twin at the 8B shapes (H100, 2026-12-06).
CANDIDATES = {32: ((32, 128, 4, 3), (16, 64, 4, 4), (32, 64, 4, 4), (16, 128, 4, 4)),
              64: ((64, 128, 4, 3), (32, 64, 4, 4), (64, 64, 4, 4), (32, 128, 4, 4)),
              128: ((128, 128, 8, 3), (64, 64, 4, 4), (64, 128, 4, 4), (128, 64, 4, 4)),
              256: ((128, 128, 8, 3), (64, 128, 4, 4), (128, 64, 4, 4), (64, 64, 4, 4)),
              1024: ((128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 4, 4), (128, 64, 4, 4)),
              8192: ((128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 4, 4), (128, 64, 4, 4))}
Tuned = dict[tuple[int, int, int, int, int], tuple[int, int, int, int]]  # (n, k, bn, bk, bucket) -> tiles


def gemm_bucket(m: int) -> int:
    """The tuning bucket of a product of `m` rows."""
    return next((b for b in BUCKETS if m <= b), BUCKETS[-1])


def config_path(device: str, folder: Path | str = CONFIG_DIR) -> Path:
    """Where the tuned block-wise tiles of a GPU (torch.cuda.get_device_name) live."""
    return config_file("fp8-gemm", device, folder)


def read_tuned(path: Path) -> Tuned:
    """A tuned-tiles file (benchmarks.tune_fp8_gemm: {"shapes": {"n,k,bn,bk": {"bucket": {"tiles": [BLOCK_M,
    BLOCK_N, num_warps, num_stages], ...}}}}, a weight shape and its scale block) by (n, k, bn, bk, bucket); {} when
    there is none."""
    if not path.exists():
        return {}
    out = {}
    for shape, buckets in json.loads(path.read_text())["shapes"].items():
        n, k, bn, bk = (int(v) for v in shape.split(","))
        for bucket, entry in buckets.items():
            out[(n, k, bn, bk, int(bucket))] = tuple(entry["tiles"])
    return out


@functools.cache
def tuned_tiles(device_index: int) -> Tuned:
    """The tiles tuned for the GPU at `device_index` (read once a process, from CONFIG_DIR as it is when first
    called: config_path's default was bound when it was defined)."""
    return read_tuned(config_path(torch.cuda.get_device_name(device_index), CONFIG_DIR))


@triton.jit
def _fp8_gemm_kernel(A, AS, W, WS, Y, M, N, K, stride_am, stride_asm, stride_wn, stride_wsn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BN: tl.constexpr,
                     BLOCKWISE: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP * grid_n  # programs of GROUP row tiles walk the column tiles together (w stays in L2)
    first_m = (pid // width) * GROUP
    group_m = min(grid_m - first_m, GROUP)
    pid_m = first_m + (pid % width) % group_m
    pid_n = (pid % width) // group_m
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = m < M
    n_mask = n < N
    a_rows = A + m.to(tl.int64)[:, None] * stride_am
    w_rows = W + n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        a = tl.load(a_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        part = tl.dot(a, tl.trans(w))
        if BLOCKWISE:  # this step is one group of a's row and one block of w's (BLOCK_K = bk, BLOCK_N | BN)
            kb = k0 // BLOCK_K
            a_s = tl.load(AS + m * stride_asm + kb, mask=m_mask, other=0.0)  # [BLOCK_M]
            w_s = tl.load(WS + (pid_n * BLOCK_N // BN) * stride_wsn + kb)
            acc += part * (a_s[:, None] * w_s)
        else:
            acc += part
    if not BLOCKWISE:
        acc *= tl.load(AS + m * stride_asm, mask=m_mask, other=0.0)[:, None]
        acc *= tl.load(WS + n, mask=n_mask, other=0.0)[None, :]
    tl.store(Y + m.to(tl.int64)[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def _config(m: int, blockwise_k: int | None) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by the number of rows."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    block_k = blockwise_k or 128
    return block_m, 128, block_k, 4 if block_m <= 64 else 8, 3


def gemm_config(m: int, n: int, k: int, block: tuple[int, int] | None,
                config: tuple[int, int, int, int] | None = None, tuned: Tuned | None = None
                ) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) a product runs with: `config` ((BLOCK_M, BLOCK_N,
    num_warps, num_stages)), else `tuned`'s for a block-wise weight's shape, scale block and row bucket, else
    _config's; BLOCK_K is bk block-wise (each step one scale) and BLOCK_N at most bn (one block row a program)."""
    block_m, block_n, block_k, warps, stages = _config(m, block[1] if block is not None else None)
    chosen = config or ((tuned or {}).get((n, k, *block, gemm_bucket(m))) if block is not None else None)
    if chosen is not None:
        block_m, block_n, warps, stages = chosen
    if block is not None:
        block_n = min(block_n, block[0])
    return block_m, block_n, block_k, warps, stages


def fp8_gemm(a: torch.Tensor, a_scales: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor,
             block: tuple[int, int] | None, out_dtype: torch.dtype,
             config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """a [M, K] fp8 with a_scales [M, ceil(K/bk)] (block-wise) or [M, 1]; w [N, K] fp8 contiguous with w_scales
    [ceil(N/bn), ceil(K/bk)] (block = (bn, bk)) or [N] (block None) -> [M, N] in out_dtype (see the module
    docstring). `config`: gemm_config's (default: the tiles tuned for this GPU, if any). A new tensor; no host
    sync."""
    m, k = a.shape
    n = w.shape[0]
    if a.dtype != FP8 or w.dtype != FP8 or w.shape[1] != k or a.stride(1) != 1 or not w.is_contiguous():
        raise ValueError(f"fp8_gemm takes fp8 a [m, k] (unit stride along k) and a contiguous fp8 w [n, k]; got a "
                         f"{tuple(a.shape)} {a.dtype}, w {tuple(w.shape)} {w.dtype}")
    if block is not None:
        bn, bk = block
        want_w, want_a = (-(-n // bn), -(-k // bk)), (m, -(-k // bk))
        if bk < 32 or bk & (bk - 1) or bn & (bn - 1):
            raise ValueError(f"fp8_gemm's block-wise scales need power-of-two blocks with bk >= 32, got {block}")
    else:
        bn, bk = n, None
        want_w, want_a = (n,), (m, 1)
    if tuple(w_scales.shape) != want_w or tuple(a_scales.shape) != want_a:
        raise ValueError(f"fp8_gemm with block {block} needs w_scales {want_w} and a_scales {want_a}, got "
                         f"{tuple(w_scales.shape)} and {tuple(a_scales.shape)}")
    y = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return y
    tuned = tuned_tiles(a.device.index or 0) if a.is_cuda and block is not None and config is None else None
    block_m, block_n, block_k, warps, stages = gemm_config(m, n, k, block, config, tuned)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_gemm_kernel[grid](a, a_scales, w, w_scales, y, m, n, k, a.stride(0), a_scales.stride(0), w.stride(0),
                           w_scales.stride(0) if block is not None else 0, y.stride(0), BLOCK_M=block_m,
                           BLOCK_N=block_n, BLOCK_K=block_k, BN=bn if block is not None else 1,
                           BLOCKWISE=block is not None, GROUP=GROUP_M, num_warps=warps, num_stages=stages)
    return y


def fp8_gemm_reference(a: torch.Tensor, a_scales: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor,
                       block: tuple[int, int] | None, out_dtype: torch.dtype) -> torch.Tensor:
    """Plain-torch twin: both operands dequantized to float32, one float32 product, rounded once."""
    a32 = dequantize_groups(a, a_scales, block[1] if block else None)
    return (a32 @ dequantize_weight(w, w_scales, block).t()).to(out_dtype)
