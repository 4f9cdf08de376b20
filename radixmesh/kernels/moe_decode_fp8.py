"""kernels.moe_decode's few-token expert path on fp8 experts (engine.quantization.fp8_load holds them so: float8_e4m3fn
w13 [experts, 2 x inter, hidden] and w2 [experts, hidden, inter] with float32 scales, kernels.fp8_experts.scale_shape),
W8A16, and its plain-torch twin. The same two gemv-shaped launches (gate/up per (token, k) pair with SiLU-and-mul,
down per token summing its top_k experts in registers), each reading one byte per weight and the weights' scales:

  per row     scales [experts, N]: each row's float32 sum of fp8 x activation products is multiplied by its row's
              scale once, as kernels.fp8_gemv does
  block-wise  scales [experts, ceil(N/bn), ceil(K/bk)]: each K-block's float32 partial sum of a row is multiplied by
              the row's block scale before it is added, as kernels.fp8_gemv's tensor-core product does; each row
              reads its own block row, so the programs' column tiles are free of bn

The activations stay in their dtype (16-bit or float32) and are not quantized; the fp8 weights are converted to
float32 in registers, exactly (e4m3 values are float32 values): the products are the dequantized weights'
(kernels.fp8_quant.dequantize_weight) up to float32 summation order. Rounding is kernels.moe_decode's: each product
rounded once to the activations' dtype, SiLU-and-mul as kernels.activation, the routing weight times the rounded
down-projection rounded again, the top_k rows summed in float32 and rounded once. The twin is
moe_decode.decode_experts_reference on the dequantized weights.

Against kernels.moe_fp8's grouped GEMMs (the path for more tokens): with per-row scales both compute these products
(W8A16) and differ only in float32 summation order and, in 16-bit dtypes, in how the top_k rows are summed (the
grouped twin adds them one at a time in the dtype). With block scales they compute different products: the grouped
GEMMs quantize their inputs to fp8 per token and group of bk columns (W8A8, ~3% a GEMM), this path does not, so at
one token it is nearer the dequantized model than the grouped path is. An id of -1 (an expert of another rank) loads
nothing and adds nothing; expert ids are read on the device and every shape follows the token count (CUDA graphs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels.fp8_experts import check_experts
from radixmesh.kernels.fp8_quant import FP8, dequantize_weight
from radixmesh.kernels.moe_decode import INTERPRETER_TILES, DecodeTiles, decode_experts_reference
from radixmesh.kernels.runtime import interpreting, pdl_enter, pdl_options

# The tiles by scale kind (block-wise, per row), the best of benchmarks.moe_decode --fp8's search at one token of the
# Qwen3-30B-A3B layer on an H100 (2026-12-06): one layer's experts 16.95 us block-wise and 16.76 per row, against
# 25.71 and 22.63 with the first guess (the 16-bit tiles' bytes per load, the down launch's expert loop). Both take
# the down launch's stacked form; per row the programs carry more columns.
FP8_TILES = {"block": DecodeTiles(up_block_n=1, up_block_k=2048, up_warps=4, down_block_n=2, down_block_k=256,
                                  down_warps=4, down_stacked=1),
             "row": DecodeTiles(up_block_n=4, up_block_k=2048, up_warps=4, down_block_n=4, down_block_k=256,
                                down_warps=4, down_stacked=1)}


def fp8_tiles(block: tuple[int, int] | None) -> DecodeTiles:
    """The default tiles for fp8 experts with these scales (block-wise [n, k], or None: one per row)."""
    return FP8_TILES["row" if block is None else "block"]


@triton.jit
def _fp8_chunk(acc, w_rows, s_rows, x, k, ok, kb, kb_ok, BLOCKWISE: tl.constexpr):
    # One K chunk of BLOCK_N fp8 rows: w_rows [BLOCK_N, 1, 1] row pointers, k [1, NB, SUB] columns (NB sub-chunks
    # of SUB <= bk columns, each inside one K-block), x [1, NB, SUB] float32, ok [BLOCK_N, NB, SUB]. Per row: acc
    # [BLOCK_N, NB, SUB] gathers the products elementwise. BLOCKWISE: acc [BLOCK_N, NB] gathers each sub-chunk's
    # partial sum times its row's scale of block kb [NB] (s_rows [BLOCK_N] pointers to the rows' block rows).
    w = tl.load(w_rows + k, mask=ok, other=0.0, eviction_policy="evict_first").to(tl.float32)
    if BLOCKWISE:
        s = tl.load(s_rows[:, None] + kb[None, :], mask=kb_ok, other=0.0)  # [BLOCK_N, NB]
        acc += tl.sum(w * x, axis=2) * s
    else:
        acc += w * x
    return acc


@triton.jit
def _fp8_rows_sum(acc, s_rows, rows_ok, BLOCKWISE: tl.constexpr):
    # [BLOCK_N] float32: the rows' scaled sums from _fp8_chunk's accumulator (per row: the row's scale once)
    if BLOCKWISE:
        y = tl.sum(acc, axis=1)
    else:
        y = tl.sum(tl.sum(acc, axis=2), axis=1) * tl.load(s_rows, mask=rows_ok, other=0.0)
    return y


@triton.jit
def _fp8_gate_up_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, act_ptr, inter, stride_x, stride_we, stride_wn, stride_se,
                        stride_sn, TOP_K: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, SUB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        BLOCKWISE: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    # act[pair, n] = silu(gate) * up, gate = x[token] . (w13[e, n] * scales), up the same of row inter + n, e =
    # ids[pair], token = pair // TOP_K, for the BLOCK_N columns n of program_id(0); act [pairs, inter] contiguous.
    # Row r's scales: s[e, r // BN] (per row: BN = 1, stride_sn = 1). An id of -1 loads nothing: zeros.
    NB: tl.constexpr = BLOCK_K // SUB
    pair = tl.program_id(1).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = n < inter
    rows_ok = n < tl.where(expert >= 0, inter, 0)  # no row at all for an id of -1
    gate_w = w_ptr + tl.maximum(expert, 0) * stride_we + n.to(tl.int64)[:, None, None] * stride_wn
    up_w = gate_w + inter * stride_wn
    scales = s_ptr + tl.maximum(expert, 0) * stride_se
    gate_s = scales + (n // BN) * stride_sn  # [BLOCK_N]
    up_s = scales + ((inter + n) // BN) * stride_sn
    x_row = x_ptr + (pair // TOP_K) * stride_x
    if BLOCKWISE:
        acc_gate = tl.zeros([BLOCK_N, NB], tl.float32)
        acc_up = tl.zeros([BLOCK_N, NB], tl.float32)
    else:
        acc_gate = tl.zeros([BLOCK_N, NB, SUB], tl.float32)
        acc_up = tl.zeros([BLOCK_N, NB, SUB], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: every load of the program is independent of the others
        starts = k0 + tl.arange(0, NB) * SUB  # [NB] first column of each sub-chunk
        k = (starts[:, None] + tl.arange(0, SUB)[None, :])[None, :, :]  # [1, NB, SUB]
        k_ok = k < K
        x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        ok = rows_ok[:, None, None] & k_ok
        kb_ok = rows_ok[:, None] & (starts < K)[None, :]
        acc_gate = _fp8_chunk(acc_gate, gate_w, gate_s, x, k, ok, starts // BK, kb_ok, BLOCKWISE)
        acc_up = _fp8_chunk(acc_up, up_w, up_s, x, k, ok, starts // BK, kb_ok, BLOCKWISE)
    dtype = act_ptr.dtype.element_ty
    gate = _fp8_rows_sum(acc_gate, gate_s, rows_ok, BLOCKWISE).to(dtype).to(tl.float32)  # rounded as a product is
    up = _fp8_rows_sum(acc_up, up_s, rows_ok, BLOCKWISE).to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(act_ptr + pair * inter + n, (silu * up).to(dtype), mask=n_ok)


@triton.jit
def _fp8_down_sum_kernel(act_ptr, w_ptr, s_ptr, ids_ptr, weights_ptr, out_ptr, hidden, stride_we, stride_wn,
                         stride_se, stride_sn, stride_out, TOP_K: tl.constexpr, K: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, BLOCKWISE: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    # out[token, n] = sum over k of weights[pair] * (act[pair] . (w2[ids[pair], n] * scales)), pair = token * TOP_K
    # + k, for the BLOCK_N columns n of program_id(0); act [pairs, K] contiguous. Pairs of id -1 load nothing and
    # add nothing.
    NB: tl.constexpr = BLOCK_K // SUB
    token = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = n < hidden
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        k_end = tl.where(expert >= 0, K, 0)  # an id of -1: no column of act or w2 at all
        rows_ok = n < tl.where(expert >= 0, hidden, 0)
        w_rows = w_ptr + tl.maximum(expert, 0) * stride_we + n.to(tl.int64)[:, None, None] * stride_wn
        s_rows = s_ptr + tl.maximum(expert, 0) * stride_se + (n // BN) * stride_sn  # [BLOCK_N]
        if BLOCKWISE:
            acc = tl.zeros([BLOCK_N, NB], tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, NB, SUB], tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            starts = k0 + tl.arange(0, NB) * SUB  # [NB]
            k = (starts[:, None] + tl.arange(0, SUB)[None, :])[None, :, :]  # [1, NB, SUB]
            k_ok = k < k_end
            a = tl.load(act_ptr + pair * K + k, mask=k_ok, other=0.0).to(tl.float32)
            kb_ok = rows_ok[:, None] & (starts < k_end)[None, :]
            acc = _fp8_chunk(acc, w_rows, s_rows, a, k, n_ok[:, None, None] & k_ok, starts // BK, kb_ok, BLOCKWISE)
        down = _fp8_rows_sum(acc, s_rows, rows_ok, BLOCKWISE).to(dtype).to(tl.float32)  # [BLOCK_N]
        weight = tl.load(weights_ptr + pair).to(tl.float32)  # finite, and down is zero for an id of -1
        total += (down * weight).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_out + n, total.to(dtype), mask=n_ok)


@triton.jit
def _fp8_down_stacked_kernel(act_ptr, w_ptr, s_ptr, ids_ptr, weights_ptr, out_ptr, hidden, stride_we, stride_wn,
                             stride_se, stride_sn, stride_out, TOP_K: tl.constexpr, KB: tl.constexpr,
                             K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr, BLOCKWISE: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    # _fp8_down_sum_kernel's result with the top_k experts as a tensor axis (kernels.moe_decode's stacked down launch):
    # per K chunk one [KB, BLOCK_N, NB, SUB] load of every expert's rows, the same products and scales row by row,
    # then the weighted, rounded rows summed over k in float32 in a tree's order and rounded once.
    NB: tl.constexpr = BLOCK_K // SUB
    token = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, KB)
    pair = token * TOP_K + j  # [KB]
    expert = tl.load(ids_ptr + pair, mask=j < TOP_K, other=-1).to(tl.int64)
    here = expert >= 0  # (an id of -1, or past TOP_K: no row of act or w2 at all)
    e = tl.maximum(expert, 0)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    rows_ok = here[:, None] & (n < hidden)[None, :]  # [KB, BLOCK_N]
    w_rows = w_ptr + e[:, None, None, None] * stride_we + n.to(tl.int64)[None, :, None, None] * stride_wn
    s_rows = s_ptr + e[:, None] * stride_se + (n // BN)[None, :] * stride_sn  # [KB, BLOCK_N]
    if BLOCKWISE:
        acc = tl.zeros([KB, BLOCK_N, NB], tl.float32)
    else:
        acc = tl.zeros([KB, BLOCK_N, NB, SUB], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        starts = k0 + tl.arange(0, NB) * SUB  # [NB] first column of each sub-chunk
        k = starts[:, None] + tl.arange(0, SUB)[None, :]  # [NB, SUB]
        k_ok = k < K
        a = tl.load(act_ptr + pair[:, None, None] * K + k[None, :, :], mask=here[:, None, None] & k_ok[None, :, :],
                    other=0.0).to(tl.float32)  # [KB, NB, SUB]
        w = tl.load(w_rows + k[None, None, :, :], mask=rows_ok[:, :, None, None] & k_ok[None, None, :, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)  # [KB, BLOCK_N, NB, SUB]
        prod = w * a[:, None, :, :]
        if BLOCKWISE:  # each sub-chunk's partial sum times its row's scale of its K-block
            s = tl.load(s_rows[:, :, None] + (starts // BK)[None, None, :],
                        mask=rows_ok[:, :, None] & (starts < K)[None, None, :], other=0.0)  # [KB, BLOCK_N, NB]
            acc += tl.sum(prod, axis=3) * s
        else:
            acc += prod
    if BLOCKWISE:
        y = tl.sum(acc, axis=2)
    else:
        y = tl.sum(tl.sum(acc, axis=3), axis=2) * tl.load(s_rows, mask=rows_ok, other=0.0)  # [KB, BLOCK_N]
    dtype = out_ptr.dtype.element_ty
    down = y.to(dtype).to(tl.float32)
    weight = tl.load(weights_ptr + pair, mask=here, other=0.0).to(tl.float32)
    weighted = (down * weight[:, None]).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_out + n, tl.sum(weighted, axis=0).to(dtype), mask=n < hidden)


def _scale_strides(s: torch.Tensor, block: tuple[int, int] | None) -> tuple[int, int]:
    """(per expert, per block row) of scales; per row the row index is the scale's, stride 1."""
    return s.stride(0), s.stride(1) if block is not None else 1


def _chunks(block_k: int, k: int, block: tuple[int, int] | None) -> tuple[int, int]:
    """(BLOCK_K, SUB): the load chunk (a power of two, at most K's) and its sub-chunks, none crossing a K-block."""
    block_k = min(block_k, triton.next_power_of_2(k))
    return block_k, block_k if block is None else min(block_k, block[1])


def decode_experts_fp8(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                       block: tuple[int, int] | None, weights: torch.Tensor, ids: torch.Tensor,
                       tiles: DecodeTiles | None = None) -> torch.Tensor:
    """x [tokens, hidden], fp8 w13 [experts, 2 x inter, hidden] and w2 [experts, hidden, inter] with float32 scales
    s13, s2 (kernels.fp8_experts.scale_shape: per row, or per block of `block`), routing weights and expert ids [tokens,
    top_k] (-1: another rank's) -> [tokens, hidden] in x's dtype, in two launches (module docstring). `tiles`
    overrides fp8_tiles(block) (INTERPRETER_TILES in the interpreter). Meant for use_decode_path's token counts (through
    kernels.moe_fp8.fused_experts_fp8); any count is computed. ValueError on what kernels.moe_fp8 refuses."""
    check_experts(x, w13, s13, w2, s2, block)
    tokens, top_k = ids.shape
    if weights.shape != ids.shape or x.shape[0] != tokens:
        raise ValueError(f"decode_experts_fp8 takes x [tokens, hidden] and weights, ids [tokens, top_k]; got x "
                         f"{tuple(x.shape)}, weights {tuple(weights.shape)}, ids {tuple(ids.shape)}")
    _, two_inter, hidden = w13.shape
    inter = two_inter // 2
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    t = tiles or (INTERPRETER_TILES if interpreting() else fp8_tiles(block))
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids, weights = ids.contiguous(), weights.contiguous()
    bn, bk = block if block is not None else (1, 1)
    act = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)  # [pairs, inter]
    up_k, up_sub = _chunks(t.up_block_k, hidden, block)
    _fp8_gate_up_kernel[(triton.cdiv(inter, t.up_block_n), tokens * top_k)](
        x, w13, s13, ids, act, inter, x.stride(0), w13.stride(0), w13.stride(1), *_scale_strides(s13, block),
        TOP_K=top_k, K=hidden, BLOCK_N=t.up_block_n, BLOCK_K=up_k, SUB=up_sub, BN=bn, BK=bk,
        BLOCKWISE=block is not None, num_warps=t.up_warps, num_stages=1, **pdl_options(x))
    down_k, down_sub = _chunks(t.down_block_k, inter, block)
    down_args = (act, w2, s2, ids, weights, out, hidden, w2.stride(0), w2.stride(1), *_scale_strides(s2, block),
                 out.stride(0))
    down_tiles = dict(TOP_K=top_k, K=inter, BLOCK_N=t.down_block_n, BLOCK_K=down_k, SUB=down_sub, BN=bn, BK=bk,
                      BLOCKWISE=block is not None, num_warps=t.down_warps, num_stages=1, **pdl_options(x))
    grid = (triton.cdiv(hidden, t.down_block_n), tokens)
    if t.down_stacked:
        _fp8_down_stacked_kernel[grid](*down_args, KB=triton.next_power_of_2(top_k), **down_tiles)
    else:
        _fp8_down_sum_kernel[grid](*down_args, **down_tiles)
    return out


def dequantize_experts(w: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float32 [experts, N, K] of stacked fp8 experts: fp8_quant.dequantize_weight, expert by expert."""
    return torch.stack([dequantize_weight(q, s, block) for q, s in zip(w, scales)])


def decode_experts_fp8_reference(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor,
                                 s2: torch.Tensor, block: tuple[int, int] | None, weights: torch.Tensor,
                                 ids: torch.Tensor) -> torch.Tensor:
    """The twin of `decode_experts_fp8`: moe_decode.decode_experts_reference on the dequantized float32 experts (each
    product of x in float32 rounded once to x's dtype; the activations never quantized)."""
    if w13.dtype != FP8 or w2.dtype != FP8:
        raise ValueError(f"decode_experts_fp8_reference takes fp8 experts, got {w13.dtype} and {w2.dtype}")
    return decode_experts_reference(x, dequantize_experts(w13, s13, block), dequantize_experts(w2, s2, block),
                                    weights, ids)
