"""Mixture-of-experts MLP with its experts' weights in float8_e4m3fn (engine.quantization.fp8_load holds them so):
kernels.moe's two grouped GEMMs reading one byte per weight, the scales applied in the kernel, and the plain-torch
twin.

Routing, the alignment of slots by expert, SiLU-and-mul and the sum of each token's top_k rows are kernels.moe's
(and its tuned tiles); only the products differ, by the experts' scales:
  per output row   w13 scales [experts, 2 x inter], w2's [experts, hidden] (per-channel and per-tensor checkpoints,
                   --quantization fp8): W8A16, the activations stay in their dtype; each fp8 tile is converted to
                   it in registers (exact: e4m3 values are bfloat16, float16 and float32 values) and the float32
                   sums are multiplied by their row's scale once, as kernels.fp8_gemv does for dense layers
  block-wise       scales [experts, ceil(N/bn), ceil(K/bk)] (DeepSeek-V3, Qwen3-30B-A3B-FP8): W8A8, each GEMM's
                   input quantized per token and group of bk columns (kernels.fp8_quant.group_quant) and each
                   BLOCK_K = bk step's fp8 product scaled by its row's group scale times its column's block scale
                   before it is added, as kernels.fp8_gemm does (there a program's columns share one block row; here
                   each column reads its own, so the column tile is free of bn)
Each product accumulates in float32 and is rounded once to the activations' dtype; the twin dequantizes the weights
(and, block-wise, the quantized activations) to float32 and makes the same products with one rounding each. No
host round trip (CUDA graphs capture it).

A few tokens (kernels.moe_decode.use_decode_path, as for 16-bit experts) run kernels.moe_decode_fp8's two
gemv-shaped launches instead of the alignment and grouped GEMMs: W8A16 for both scale layouts, so with block scales
they do not quantize the activations and are not this twin's products (moe_decode_fp8's docstring).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels.fp8_gemm import fp8_gemm_reference
from radixmesh.kernels.fp8_gemv import fp8_linear_reference
from radixmesh.kernels.fp8_experts import check_experts
from radixmesh.kernels.fp8_quant import group_quant, group_quant_reference
from radixmesh.kernels.moe import Tiles, grouped_experts, tiles
from radixmesh.kernels.runtime import dot_needs_upcast, interpreting

# Triton's interpreter runs the programs one after another in Python: there, fewer and wider ones (the same sums)
INTERPRETED_TILES = Tiles(block_n=256, block_k=64)


@triton.jit
def _fp8_grouped_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, slots_ptr, block_experts_ptr, weights_ptr,
                             n_slots, N, K, a_row_div, stride_a, stride_as, stride_we, stride_wn, stride_wse,
                             stride_wsn, stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, BN: tl.constexpr, BLOCKWISE: tl.constexpr,
                             WEIGHTED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # out[slot, n] = sum_k a[slot // a_row_div, k] * w[expert, n, k] * scales (x routing weight of the slot when
    # WEIGHTED), for the BLOCK_M slots of block program_id(0), all of one expert; grid (blocks, cdiv(N, BLOCK_N)).
    # BLOCKWISE: a fp8 with scales per row and group of BLOCK_K columns, w's scales per (BN x BLOCK_K) block (each
    # column its block row's); else a in its dtype and w's scales per row.
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = tl.load(slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    valid = rows < n_slots
    a_rows = tl.where(valid, rows // a_row_div, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_ok = cols < N
    w_scales = ws_ptr + expert * stride_wse  # this expert's scales
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N] fp8
        if BLOCKWISE:  # this step is one group of each a row and one block column of w's (BLOCK_K = bk)
            a_s = tl.load(as_ptr + a_rows * stride_as + k0 // BLOCK_K, mask=valid, other=0.0)  # [BLOCK_M]
            w_s = tl.load(w_scales + (cols // BN) * stride_wsn + k0 // BLOCK_K, mask=col_ok, other=0.0)  # [BLOCK_N]
            acc += tl.dot(a, w) * (a_s[:, None] * w_s[None, :])
        else:
            if UPCAST:  # the interpreter's bfloat16 dot is wrong (kernels.runtime.dot_needs_upcast)
                a = a.to(tl.float32)
            acc += tl.dot(a, w.to(a.dtype), input_precision=PRECISION)
    if not BLOCKWISE:
        acc *= tl.load(w_scales + cols, mask=col_ok, other=0.0)[None, :]
    dtype = out_ptr.dtype.element_ty
    out = acc.to(dtype)
    if WEIGHTED:
        weight = tl.load(weights_ptr + rows, mask=valid, other=0.0)
        out = (out.to(tl.float32) * weight.to(tl.float32)[:, None]).to(dtype)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out, mask=valid[:, None] & col_ok[None, :])


def _fp8_grouped_gemm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None,
                      slots: torch.Tensor, block_experts: torch.Tensor, n_slots: int, a_row_div: int,
                      weights: torch.Tensor | None, zeroed: bool, block_m: int, t: Tiles) -> torch.Tensor:
    """[n_slots, N] in x's dtype: each slot's row of x (slot // a_row_div) times its expert's fp8 w [N, K] with its
    scales, transposed (module docstring); x quantized per token and group of bk here when `block`. Rows of slots
    no block runs: zero when `zeroed`, else unset."""
    n, k = w.shape[1], w.shape[2]
    out = (torch.zeros if zeroed else torch.empty)((n_slots, n), dtype=x.dtype, device=x.device)
    block_n = min(t.block_n, max(16, triton.next_power_of_2(n)))
    if block is not None:
        a, a_scales = group_quant(x, block[1])
        block_k = block[1]
    else:
        a, a_scales = x, x
        block_k = min(t.block_k, max(16, triton.next_power_of_2(k)))
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _fp8_grouped_gemm_kernel[grid](
        a, a_scales, w, scales, out, slots, block_experts, weights if weights is not None else x, n_slots, n, k,
        a_row_div, a.stride(0), a_scales.stride(0), w.stride(0), w.stride(1), scales.stride(0),
        scales.stride(1) if block is not None else 0, out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, BN=block[0] if block is not None else 1, BLOCKWISE=block is not None,
        WEIGHTED=weights is not None, UPCAST=dot_needs_upcast(x.dtype),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=t.num_warps, num_stages=t.num_stages)
    return out


def fused_experts_fp8(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                      block: tuple[int, int] | None, weights: torch.Tensor, ids: torch.Tensor,
                      elsewhere: bool = True, decode_path: bool | None = None) -> torch.Tensor:
    """kernels.moe.fused_experts with fp8 experts: x [tokens, hidden], w13 fp8 [experts, 2 x inter, hidden] and w2
    fp8 [experts, hidden, inter] with float32 scales `s13`, `s2` (kernels.fp8_experts.scale_shape: per row, or per block of `block`),
    routing weights and expert ids [tokens, top_k] -> [tokens, hidden] in x's dtype. `elsewhere`: ids may be -1
    (experts of other ranks). A few tokens (kernels.moe_decode.use_decode_path) run
    kernels.moe_decode_fp8.decode_experts_fp8 instead; `decode_path` True or False forces the choice (tests,
    benchmarks)."""
    from radixmesh.kernels.moe_decode import use_decode_path
    from radixmesh.kernels.moe_decode_fp8 import decode_experts_fp8

    check_experts(x, w13, s13, w2, s2, block)
    tokens, top_k = ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    if use_decode_path(tokens, top_k, w13.shape[0]) if decode_path is None else decode_path:
        return decode_experts_fp8(x, w13, s13, w2, s2, block, weights, ids)
    x = x.contiguous()
    block_m, up, down_tiles = tiles(x, w13, tokens, top_k)
    if interpreting():
        up = down_tiles = INTERPRETED_TILES
    experts = ((w13, s13), (w2, s2))
    return grouped_experts(x, weights, ids, w13.shape[0], (block_m, up, down_tiles),
                           lambda a, second, *launch: _fp8_grouped_gemm(a, *experts[second], block, *launch), elsewhere)


def _product(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """x [m, K] @ (w [N, K] * scales)^T in float32, rounded once to x's dtype; block-wise, x quantized per token and
    group of bk first (the kernel's operands)."""
    if block is None:
        return fp8_linear_reference(x, w, scales, None)
    return fp8_gemm_reference(*group_quant_reference(x, block[1]), w, scales, block, x.dtype)


def fused_experts_fp8_reference(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor,
                                s2: torch.Tensor, block: tuple[int, int] | None, weights: torch.Tensor,
                                ids: torch.Tensor) -> torch.Tensor:
    """The twin (kernels.moe.fused_experts_reference with fp8 experts): each expert once, on the tokens routed to it,
    its weighted output added into the token's row in x's dtype; slots whose id is -1 add nothing."""
    import torch.nn.functional as F

    out = torch.zeros_like(x)
    hit = torch.zeros(w13.shape[0], dtype=torch.bool, device=x.device)
    flat = ids.flatten()
    hit[flat[flat >= 0]] = True
    for e in hit.nonzero().flatten().tolist():
        token, slot = torch.where(ids == e)
        gate, up = _product(x[token], w13[e], s13[e], block).chunk(2, dim=-1)
        h = F.silu(gate) * up
        out.index_add_(0, token, (_product(h, w2[e], s2[e], block) * weights[token, slot, None]).to(out.dtype))
    return out

