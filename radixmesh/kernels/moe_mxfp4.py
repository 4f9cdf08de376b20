"""Experts held in MXFP4 (GPT-OSS's checkpoints: 4-bit e2m1 codes, two a byte, the low nibble first, and one
power-of-two scale, e8m0, a row and 32 inputs), computed without a bf16 copy: the weights are decoded in registers,
a tile at a time, where kernels.moe (the grouped GEMMs) and kernels.moe_decode (a few tokens) load bf16 rows. Half a
byte and 1/32 of one a weight instead of two bytes: a batch-1 step of gpt-oss-20b reads ~3.7 GB instead of ~7.2, and
gpt-oss-120b's experts take ~61 GB instead of ~229 (counted from the shapes). A code becomes its float32 value by
integer operations on its bits (no table, no special-function unit) where activations are float32 or float16.
bfloat16 activations (a GPU's serving dtype) take Triton's microscaled products in the grouped GEMMs (tl.dot_scaled:
its own decoding by byte permutes, then tensor-core products: gpt-oss-20b's 8k prefill 310 ms against 987 with the
integer decoding, twenty-ninth session). A few tokens' launches read the codes as 32-bit words on CUDA cores instead
(_row_times_words: two codes a float16 pattern by two shifts and two masks, widened by one conversion each, float32
FMAs; ~5.5 instructions a weight where the microscaled product with its row repeated into 16 took ~11): gpt-oss-20b's
layer at one token 41.9 us for both launches against tl.dot_scaled's 65.6 on an H100 (the floor 17.6), its batch-1
step 2.24 ms of GPU time against 2.87 (thirty-fourth session).

Layout (engine.models.gpt_oss after the load): `q` [experts, N, K / 2] uint8 and `s` [experts, N, K / 32] uint8 for
each product (w13: N = 2 x inter, gate rows then up rows, K = hidden; w2: N = hidden, K = inter), the rows as
kernels.moe's w13 and w2. Every decoded value is exact in bfloat16 (a 3-bit significand at most, times a power of
two), so the products are those of the dequantized weights (engine.quantization.mxfp4.dequantize) summed in another
order: `fused_experts_mxfp4_reference` dequantizes and runs kernels.moe's twin.

The kernels' own decoding splits K into its even and odd positions: each byte's low nibble multiplies the
activations' even columns and its high nibble the odd ones (no interleaving in registers). A few tokens take one
gate/up and one down launch (kernels.moe_decode's shape; for bfloat16 a program a pair in both, the word products
above, and a token's weighted terms summed after); more take the aligned
grouped GEMMs (kernels.moe's tuned tiles where a GPU has them; for bfloat16 64 x 256 tiles otherwise, BLOCK_K a
multiple of 64). The biases and the clamped SwiGLU (kernels.moe_activation) are computed
as on bf16 weights."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixmesh.kernels.moe import BLOCK_M, Tiles, fused_experts_reference, grouped_experts, tuned_tiles
from radixmesh.kernels.moe import default_tiles as default_grouped_tiles
from radixmesh.kernels.moe_activation import swiglu_rounded
from radixmesh.kernels.moe_decode import default_tiles, tiles_from_env, use_decode_path
from radixmesh.kernels.moe_extras import ExpertExtras, clamped
from radixmesh.kernels.runtime import dot_needs_upcast, interpreting, pdl_enter, pdl_options

GROUP = 32  # weights a scale
INTERPRETED_TILES = Tiles(block_n=64, block_k=64)


@triton.jit
def _e2m1(codes):
    """4-bit codes (the low bits of an int32 tensor) -> their float32 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
    negatives: sign, 2-bit exponent, 1-bit mantissa), built as float32 bit patterns with integer operations (no
    special-function unit, no subnormal): exponent e + 126 and the mantissa bit under it, 0.5 and 0 apart."""
    mag = codes & 7
    bits = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22)
    bits = tl.where(mag < 2, tl.where(mag == 1, 0x3F000000, 0), bits)
    return (bits | ((codes & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _scale(exps):
    """e8m0 scales (int32 0..255) -> 2^(e - 127) in float32: the exponent field itself (2^-127, e = 0, the one
    subnormal, apart)."""
    return tl.where(exps == 0, 5.877471754111438e-39, (exps << 23).to(tl.float32, bitcast=True))


@triton.jit
def _halves(q_rows, s_rows, half, ok):
    """One chunk of weight rows: bytes `half` (positions along K / 2) of rows `q_rows`, scaled by their groups'
    scales -> (even columns' values, odd columns' values), float32, zero where not `ok`."""
    codes = tl.load(q_rows + half, mask=ok, other=0, eviction_policy="evict_first").to(tl.int32)
    scale = _scale(tl.load(s_rows + half // 16, mask=ok, other=127).to(tl.int32))
    return _e2m1(codes) * scale, _e2m1(codes >> 4) * scale


@triton.jit
def _mxfp4_gate_up_kernel(x_ptr, q_ptr, s_ptr, ids_ptr, act_ptr, b_ptr, inter, stride_x, stride_qe, stride_qn,
                          stride_se, stride_sn, stride_be, alpha, limit, TOP_K: tl.constexpr, K: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, HAS_BIAS: tl.constexpr,
                          SWIGLU: tl.constexpr):
    pdl_enter(PDL)
    # kernels.moe_decode._gate_up_kernel over MXFP4 rows: act[pair, n] = act(x . gate_n + b, x . up_n + b)
    pair = tl.program_id(1).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    rows_ok = (n < tl.where(expert >= 0, inter, 0))[:, None]
    e = tl.maximum(expert, 0)
    gate_q = q_ptr + e * stride_qe + n.to(tl.int64)[:, None] * stride_qn
    gate_s = s_ptr + e * stride_se + n.to(tl.int64)[:, None] * stride_sn
    up_q, up_s = gate_q + inter * stride_qn, gate_s + inter * stride_sn
    x_row = x_ptr + (pair // TOP_K) * stride_x
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K // 2], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K // 2], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        h_ok = half < K // 2
        x_even = tl.load(x_row + 2 * half, mask=h_ok, other=0.0).to(tl.float32)[None, :]
        x_odd = tl.load(x_row + 2 * half + 1, mask=h_ok, other=0.0).to(tl.float32)[None, :]
        ok = rows_ok & h_ok[None, :]
        g_even, g_odd = _halves(gate_q, gate_s, half[None, :], ok)
        u_even, u_odd = _halves(up_q, up_s, half[None, :], ok)
        acc_gate += g_even * x_even + g_odd * x_odd
        acc_up += u_even * x_even + u_odd * x_odd
    _store_activation(tl.sum(acc_gate, axis=1), tl.sum(acc_up, axis=1), act_ptr, b_ptr, pair, expert, n, inter,
                      stride_be, alpha, limit, HAS_BIAS, SWIGLU)


@triton.jit
def _store_activation(gate, up, act_ptr, b_ptr, pair, expert, n, inter, stride_be, alpha, limit,
                      HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr):
    """A pair's gate and up products (float32 [BLOCK_N], columns n) -> its activation row, rounded as the twin
    rounds: each product to act's dtype, the bias added (none for an id of -1), the clamped SwiGLU or SiLU-and-mul."""
    dtype = act_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    if HAS_BIAS:
        bias = b_ptr + tl.maximum(expert, 0) * stride_be + n
        b_ok = n < tl.where(expert >= 0, inter, 0)
        gate = (gate + tl.load(bias, mask=b_ok, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        up = (up + tl.load(bias + inter, mask=b_ok, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    if SWIGLU:
        act = swiglu_rounded(gate, up, alpha, limit, dtype)
    else:  # SiLU-and-mul as kernels.activation rounds it
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    tl.store(act_ptr + pair * inter + n, act.to(dtype), mask=n < inter)


@triton.jit
def _mxfp4_down_kernel(act_ptr, q_ptr, s_ptr, ids_ptr, weights_ptr, out_ptr, b_ptr, hidden, stride_qe, stride_qn,
                       stride_se, stride_sn, stride_out, stride_be, TOP_K: tl.constexpr, K: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, HAS_BIAS: tl.constexpr):
    pdl_enter(PDL)
    # kernels.moe_decode._down_sum_kernel over MXFP4 rows: out[token, n] = sum_k w_k * (act[pair] . w2[e_k, n] + b)
    token = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        half_end = tl.where(expert >= 0, K // 2, 0)
        e = tl.maximum(expert, 0)
        q_rows = q_ptr + e * stride_qe + n.to(tl.int64)[:, None] * stride_qn
        s_rows = s_ptr + e * stride_se + n.to(tl.int64)[:, None] * stride_sn
        acc = tl.zeros([BLOCK_N, BLOCK_K // 2], tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            h_ok = half < half_end
            a_even = tl.load(act_ptr + pair * K + 2 * half, mask=h_ok, other=0.0).to(tl.float32)[None, :]
            a_odd = tl.load(act_ptr + pair * K + 2 * half + 1, mask=h_ok, other=0.0).to(tl.float32)[None, :]
            w_even, w_odd = _halves(q_rows, s_rows, half[None, :], n_ok[:, None] & h_ok[None, :])
            acc += w_even * a_even + w_odd * a_odd
        total += _weighted_down(tl.sum(acc, axis=1), b_ptr, weights_ptr, pair, expert, n, hidden, stride_be, dtype,
                                HAS_BIAS)
    tl.store(out_ptr + token * stride_out + n, total.to(dtype), mask=n_ok)


@triton.jit
def _weighted_down(down, b_ptr, weights_ptr, pair, expert, n, hidden, stride_be, dtype, HAS_BIAS: tl.constexpr):
    """A pair's down product (float32 [BLOCK_N]) -> its term of the token's sum, rounded as the twin rounds: the
    product to `dtype`, the bias added (none for an id of -1), times the routing weight."""
    down = down.to(dtype).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + tl.maximum(expert, 0) * stride_be + n, mask=n < tl.where(expert >= 0, hidden, 0),
                       other=0.0)
        down = (down + bias.to(tl.float32)).to(dtype).to(tl.float32)
    weight = tl.load(weights_ptr + pair).to(tl.float32)
    return (down * weight).to(dtype).to(tl.float32)


@triton.jit
def _row_times_codes(x_row, q_rows, s_rows, rows_ok, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One bf16 row x[K] times the MXFP4 rows at q_rows/s_rows ([BLOCK_N, 1] pointers; masked by rows_ok) -> float32
    [BLOCK_N]: Triton's microscaled product (tl.dot_scaled decodes the codes and applies their scales), its 16-row
    left operand the row repeated (the smallest tensor-core product), row 0 of the result taken."""
    acc = tl.zeros((16, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.broadcast_to(tl.load(x_row + k, mask=k < K, other=0.0)[None, :], (16, BLOCK_K))
        half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)  # (a scale a GROUP of weights)
        q = tl.load(q_rows + half[None, :], mask=rows_ok & (half < K // 2)[None, :], other=0,
                    eviction_policy="evict_first")
        s = tl.load(s_rows + groups[None, :], mask=rows_ok & (groups < K // 32)[None, :], other=127)
        acc = tl.dot_scaled(x, None, "bf16", q.T, s, "e2m1", acc, fast_math=True)
    return tl.sum(tl.where(tl.arange(0, 16)[:, None] == 0, acc, 0.0), axis=0)


@triton.jit
def _two_codes(words, i: tl.constexpr):
    """Codes i and i + 4 of each word (int32, eight codes, code i in bits 4i..4i+3) -> two float16 bit patterns in
    one int32 (code i in the low half): the code's magnitude bits under float16's exponent (e1 e0) and mantissa (m)
    and its sign on top, so each half reads as the code's value times 2^-14, exact for every code (0.5 is float16's
    subnormal as it is e2m1's). The two codes lie 16 bits apart, so two shifts and two masks serve both."""
    if i < 3:
        mag = words << (9 - 4 * i)
    else:
        mag = words >> (4 * i - 9)
    return (mag & 0x0E000E00) | ((words << (12 - 4 * i)) & -0x7FFF8000)  # (0x80008000: both halves' sign bits)


@triton.jit
def _half_values(pair, PTX: tl.constexpr):
    """Two float16 bit patterns in an int32 -> their values in float32 (the low half's, the high half's). PTX: by
    inline PTX, two conversions reading the halves in place (Triton's own casts repack halves first: ~5% more
    instructions in the launch); not in Triton's interpreter."""
    if PTX:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }", "=r,=r,r", [pair],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    lo = (pair & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, (pair >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _bf16_of_pair(pairs, odd: tl.constexpr):
    """Two bfloat16 values in an int32 (the even column low) -> the even or odd one in float32 (its bits on top)."""
    if odd:
        return (pairs & -0x10000).to(tl.float32, bitcast=True)
    return (pairs << 16).to(tl.float32, bitcast=True)


@triton.jit
def _row_times_words(x_row, q_rows, s_rows, rows_ok, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PTX: tl.constexpr, LOOP: tl.constexpr):
    """_row_times_codes on CUDA cores: the codes read as 32-bit words (eight a word), two codes at a time turned
    into float16 patterns by shifts and masks (_two_codes) and into float32 by one conversion each, times the row
    (read as bfloat16 pairs) in float32 FMAs; a word's sum scaled by its group's 2^(e - 127) once. Every product is
    the dequantized weight's times 2^-14 (undone once at the end), exact, so the result differs from the twin's
    only in the summation order (for scales of 2^-100 and up: below, the 2^-14 would push a scaled word sum under
    float32's normal range first; checkpoints hold ~2^-10..2^0). For one token, where the tensor-core product
    repeats the row into 16 and Triton's decoding by byte permutes bounds the launch. The K chunks unrolled (every
    load issued at once: more registers, fewer programs an SM) or, LOOP, a loop the launch's num_stages pipelines
    (~25% more instructions a weight for the addresses, a third of the registers: the sm_90 builds)."""
    WORDS: tl.constexpr = K // 8
    BLOCK_W: tl.constexpr = BLOCK_K // 8
    x_pairs = x_row.to(tl.pointer_type(tl.int32))  # x[2m] and x[2m + 1] an int32 (K % 32 == 0: aligned)
    q_words = q_rows.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    if LOOP:
        for w0 in range(0, WORDS, BLOCK_W):
            acc = _words_chunk(acc, w0, x_pairs, q_words, s_rows, rows_ok, WORDS, BLOCK_N, BLOCK_W, PTX)
    else:
        for w0 in tl.static_range(0, WORDS, BLOCK_W):
            acc = _words_chunk(acc, w0, x_pairs, q_words, s_rows, rows_ok, WORDS, BLOCK_N, BLOCK_W, PTX)
    return tl.sum(acc, axis=1) * 16384.0


@triton.jit
def _words_chunk(acc, w0, x_pairs, q_words, s_rows, rows_ok, WORDS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_W: tl.constexpr, PTX: tl.constexpr):
    """_row_times_words' words w0 .. w0 + BLOCK_W of each row, added to acc ([BLOCK_N, BLOCK_W] float32)."""
    w = w0 + tl.arange(0, BLOCK_W)
    w_ok = w < WORDS
    ok = rows_ok & w_ok[None, :]
    words = tl.load(q_words + w[None, :], mask=ok, other=0, eviction_policy="evict_first")
    scale = _scale(tl.load(s_rows + (w // 4)[None, :], mask=ok, other=127).to(tl.int32))
    part = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    for i in tl.static_range(4):
        codes = _two_codes(words, i)
        x_lo = _bf16_of_pair(tl.load(x_pairs + 4 * w + i // 2, mask=w_ok, other=0), i % 2)  # column 8w + i
        x_hi = _bf16_of_pair(tl.load(x_pairs + 4 * w + 2 + i // 2, mask=w_ok, other=0), i % 2)  # 8w + i + 4
        lo, hi = _half_values(codes, PTX)
        part += lo * x_lo[None, :]  # (two statements: two FMAs)
        part += hi * x_hi[None, :]
    return acc + part * scale


@triton.jit
def _row_times(x_row, q_rows, s_rows, rows_ok, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               WORDS: tl.constexpr, LOOP: tl.constexpr):
    if WORDS:
        return _row_times_words(x_row, q_rows, s_rows, rows_ok, K, BLOCK_N, BLOCK_K, WORDS == 2, LOOP)
    return _row_times_codes(x_row, q_rows, s_rows, rows_ok, K, BLOCK_N, BLOCK_K)


@triton.jit
def _mxfp4_gate_up_scaled_kernel(x_ptr, q_ptr, s_ptr, ids_ptr, act_ptr, b_ptr, inter, stride_x, stride_qe,
                                 stride_qn, stride_se, stride_sn, stride_be, alpha, limit, TOP_K: tl.constexpr,
                                 K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                                 HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, WORDS: tl.constexpr,
                                 LOOP: tl.constexpr):
    pdl_enter(PDL)
    # _mxfp4_gate_up_kernel for bfloat16 activations, its products tl.dot_scaled's (WORDS: _row_times_words')
    pair = tl.program_id(1).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.maximum(expert, 0)
    x_row = x_ptr + (pair // TOP_K) * stride_x
    if WORDS:  # the gate's and the up rows as one tile of 2 x BLOCK_N rows: the row's words read and widened once
        r = tl.arange(0, 2 * BLOCK_N)
        col = tl.program_id(0) * BLOCK_N + r % BLOCK_N
        rows = (col + (r // BLOCK_N) * inter).to(tl.int64)[:, None]
        both = _row_times_words(x_row, q_ptr + e * stride_qe + rows * stride_qn,
                                s_ptr + e * stride_se + rows * stride_sn,
                                (col < tl.where(expert >= 0, inter, 0))[:, None], K, 2 * BLOCK_N, BLOCK_K,
                                WORDS == 2, LOOP)
        gate, up = tl.split(both.reshape(2, BLOCK_N).trans())
    else:
        rows_ok = (n < tl.where(expert >= 0, inter, 0))[:, None]
        gate_q = q_ptr + e * stride_qe + n.to(tl.int64)[:, None] * stride_qn
        gate_s = s_ptr + e * stride_se + n.to(tl.int64)[:, None] * stride_sn
        gate = _row_times_codes(x_row, gate_q, gate_s, rows_ok, K, BLOCK_N, BLOCK_K)
        up = _row_times_codes(x_row, gate_q + inter * stride_qn, gate_s + inter * stride_sn, rows_ok, K, BLOCK_N,
                              BLOCK_K)
    _store_activation(gate, up, act_ptr, b_ptr, pair, expert, n, inter, stride_be, alpha, limit, HAS_BIAS, SWIGLU)


@triton.jit
def _mxfp4_down_scaled_kernel(act_ptr, q_ptr, s_ptr, ids_ptr, weights_ptr, terms_ptr, b_ptr, hidden, stride_qe,
                              stride_qn, stride_se, stride_sn, stride_be, K: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, PDL: tl.constexpr, HAS_BIAS: tl.constexpr, WORDS: tl.constexpr,
                              LOOP: tl.constexpr):
    pdl_enter(PDL)
    # _mxfp4_down_kernel's term of one pair for bfloat16 activations (its product tl.dot_scaled's or, WORDS,
    # _row_times_words'), a program a pair
    # and BLOCK_N columns: terms[pair, n] = w_pair * (act[pair] . w2[e_pair, n] + b2[e_pair, n]); the caller sums a
    # token's top_k terms (a program for all of them, expert after expert, was 3x slower on an H100)
    pair = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    e = tl.maximum(expert, 0)
    rows_ok = (n < tl.where(expert >= 0, hidden, 0))[:, None]
    down = _row_times(act_ptr + pair * K, q_ptr + e * stride_qe + n.to(tl.int64)[:, None] * stride_qn,
                      s_ptr + e * stride_se + n.to(tl.int64)[:, None] * stride_sn, rows_ok, K, BLOCK_N, BLOCK_K, WORDS,
                      LOOP)
    dtype = terms_ptr.dtype.element_ty
    term = _weighted_down(down, b_ptr, weights_ptr, pair, expert, n, hidden, stride_be, dtype, HAS_BIAS)
    tl.store(terms_ptr + pair * hidden + n, term.to(dtype), mask=n < hidden)


@triton.jit
def _terms_sum_kernel(terms_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # out[token, n] = sum over k of terms[token * TOP_K + k, n] in float32, in k order, rounded once to out's dtype
    # (a token's weighted terms from _mxfp4_down_scaled_kernel); grid (cdiv(hidden, BLOCK), tokens)
    pdl_enter(PDL)
    token = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = n < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(terms_ptr + (token * TOP_K + k) * hidden + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _mxfp4_grouped_kernel(a_ptr, q_ptr, s_ptr, out_ptr, slots_ptr, block_experts_ptr, weights_ptr, n_slots, N, K,
                          a_row_div, stride_a, stride_qe, stride_qn, stride_se, stride_sn, stride_out,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          WEIGHTED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                          SCALED: tl.constexpr):
    # kernels.moe._grouped_gemm_kernel over MXFP4 weights. SCALED (bfloat16 activations): each K step is Triton's
    # microscaled product (tl.dot_scaled) of the activations' tile and a [BLOCK_N, BLOCK_K / 2] tile of codes with
    # their scales; otherwise it decodes the tile's bytes into their even and odd columns' values (exact in the
    # activations' dtype) and takes two tensor-core products
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = tl.load(slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < n_slots
    a_rows = tl.where(valid, rows // a_row_div, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    q_cols = q_ptr + expert * stride_qe + cols.to(tl.int64)[None, :] * stride_qn  # [1, BLOCK_N]
    s_cols = s_ptr + expert * stride_se + cols.to(tl.int64)[None, :] * stride_sn
    q_rows = q_ptr + expert * stride_qe + cols.to(tl.int64)[:, None] * stride_qn  # [BLOCK_N, 1] (SCALED's loads)
    s_rows = s_ptr + expert * stride_se + cols.to(tl.int64)[:, None] * stride_sn
    dtype = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        h_ok = half < K // 2
        if SCALED:
            k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + a_rows[:, None] * stride_a + k[None, :], mask=valid[:, None] & (k < K)[None, :],
                        other=0.0)
            groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            q = tl.load(q_rows + half[None, :], mask=col_ok[:, None] & h_ok[None, :], other=0)
            s = tl.load(s_rows + groups[None, :], mask=col_ok[:, None] & (groups < K // 32)[None, :], other=127)
            acc = tl.dot_scaled(a, None, "bf16", q.T, s, "e2m1", acc, fast_math=True)
        else:
            a_base = a_ptr + a_rows[:, None] * stride_a + 2 * half[None, :]
            a_ok = valid[:, None] & h_ok[None, :]
            a_even = tl.load(a_base, mask=a_ok, other=0.0)
            a_odd = tl.load(a_base + 1, mask=a_ok, other=0.0)
            w_even, w_odd = _halves(q_cols, s_cols, half[:, None], h_ok[:, None] & col_ok[None, :])  # [K / 2, N]
            if UPCAST:  # the interpreter's bfloat16 dot is wrong (kernels.runtime.dot_needs_upcast)
                acc += tl.dot(a_even.to(tl.float32), w_even, input_precision=PRECISION)
                acc += tl.dot(a_odd.to(tl.float32), w_odd, input_precision=PRECISION)
            else:
                acc += tl.dot(a_even, w_even.to(dtype), input_precision=PRECISION)
                acc += tl.dot(a_odd, w_odd.to(dtype), input_precision=PRECISION)
    out_dtype = out_ptr.dtype.element_ty
    out = acc.to(out_dtype)
    if WEIGHTED:
        weight = tl.load(weights_ptr + rows, mask=valid, other=0.0)
        out = (out.to(tl.float32) * weight.to(tl.float32)[:, None]).to(out_dtype)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out, mask=valid[:, None] & col_ok[None, :])


def check_mxfp4(x: torch.Tensor, q13: torch.Tensor, s13: torch.Tensor, q2: torch.Tensor, s2: torch.Tensor) -> None:
    """ValueError unless the four tensors are MXFP4 experts for x's rows (module docstring's layout)."""
    experts, two_inter, half_hidden = q13.shape
    hidden, inter = 2 * half_hidden, two_inter // 2
    ok = (x.dim() == 2 and x.shape[1] == hidden and hidden % GROUP == 0 and inter % GROUP == 0 and two_inter % 2 == 0
          and s13.shape == (experts, two_inter, hidden // GROUP) and q2.shape == (experts, hidden, inter // 2)
          and s2.shape == (experts, hidden, inter // GROUP)
          and all(t.dtype == torch.uint8 and t.stride(-1) == 1 for t in (q13, s13, q2, s2)))
    if not ok:
        raise ValueError(f"MXFP4 experts are q13 [E, 2 x inter, hidden / 2], s13 [E, 2 x inter, hidden / 32], q2 [E, "
                         f"hidden, inter / 2], s2 [E, hidden, inter / 32] uint8 (unit last stride) for x [tokens, "
                         f"hidden]; got x {tuple(x.shape)}, q13 {tuple(q13.shape)}, s13 {tuple(s13.shape)}, q2 "
                         f"{tuple(q2.shape)}, s2 {tuple(s2.shape)}")


class ScaledTiles(NamedTuple):
    """The few-token launches' tiles for bfloat16 activations: output columns a program (the gate/up launch's rows
    are twice its columns), the K step, warps and pipeline stages of each launch, and the products' form."""

    up_block_n: int = 8  # gpt-oss-20b's layer on an H100, both launches: 41.9 us at one token against tl.dot_scaled's
    up_block_k: int = 1024  # 65.6 (its best tiles: 32 / 64 columns, 256 deep, 3 stages), 73 against 114 at two,
    down_block_n: int = 16  # 136 against 198 at four (thirty-fourth session; the floor at one token 17.6)
    down_block_k: int = 1024
    num_warps: int = 4
    num_stages: int = 1
    words: int = 1  # the products' form: 0 tl.dot_scaled, 1 CUDA cores (_row_times_words), 2 the same with its
    # halves widened by inline PTX (1 in Triton's interpreter)
    loop: int = 0  # the word products' K chunks: 0 unrolled, 1 a loop pipelined over num_stages (_row_times_words)
    max_pairs: int = 0  # up to how many (token, expert) pairs bfloat16 rows take these launches rather than the
    # grouped GEMMs; 0: kernels.moe_decode.use_decode_path's rule, but at least WORD_PAIRS


TERMS_BLOCK = 1024  # columns a program of the terms' sum
# bfloat16 rows take the word launches up to this many pairs at least (kernels.moe_decode's rule gives gpt-oss-20b's
# 32 experts, top 4, only 2 tokens): its batch-4 step 6.50 -> 5.03 ms of GPU time on an H100 with 16, batch 1 and 2
# alike (thirty-fifth session)
WORD_PAIRS = 16
TILES_ENV = "RADIXMESH_MXFP4_TILES"  # JSON of ScaledTiles fields overriding the defaults (benchmarks, an operator)
# The grouped GEMM's tiles for bfloat16 activations where no tuned entry exists: the H100's best of 64/128 columns x
# 128/256 deep x 4/8 warps for one expert's 16 and 64 rows of gpt-oss-20b's gate/up (12.1 and 15.7 us)
SCALED_GROUPED_TILES = Tiles(block_n=64, block_k=256, num_warps=4, num_stages=3)


def scaled(x: torch.Tensor) -> bool:
    """Whether x's rows take Triton's microscaled products (bfloat16 activations) rather than decoding the codes into
    x's dtype (float32, float16)."""
    return x.dtype == torch.bfloat16


def _grouped(a, q, s, slots, block_experts, n_slots, a_row_div, weights, zeroed, block_m, t: Tiles):
    n, k = q.shape[1], 2 * q.shape[2]
    out = (torch.zeros if zeroed else torch.empty)((n_slots, n), dtype=a.dtype, device=a.device)
    block_n = min(t.block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(max(64, t.block_k), max(64, triton.next_power_of_2(k)))  # (two 32-deep products a step at least)
    _mxfp4_grouped_kernel[(block_experts.numel(), triton.cdiv(n, block_n))](
        a, q, s, out, slots, block_experts, weights if weights is not None else a, n_slots, n, k, a_row_div,
        a.stride(0), q.stride(0), q.stride(1), s.stride(0), s.stride(1), out.stride(0), BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, WEIGHTED=weights is not None, UPCAST=dot_needs_upcast(a.dtype),
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", SCALED=scaled(a), num_warps=t.num_warps,
        num_stages=t.num_stages)
    return out


def _decode(x, q13, s13, q2, s2, weights, ids, extras: ExpertExtras | None,
            st: ScaledTiles | None = None) -> torch.Tensor:
    tokens, top_k = ids.shape
    hidden, inter = x.shape[1], q13.shape[1] // 2
    act = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)
    ids, weights = ids.contiguous(), weights.contiguous()
    b13 = extras.b13 if extras is not None else None
    b2 = extras.b2 if extras is not None else None
    swiglu = clamped(extras)
    if scaled(x):
        st = st or tiles_from_env(ScaledTiles, TILES_ENV)
        up_kernel = _mxfp4_gate_up_scaled_kernel
        up_n, up_k, down_n, down_k = st.up_block_n, st.up_block_k, st.down_block_n, st.down_block_k
        words = 1 if st.words == 2 and interpreting() else st.words
        up_launch = down_launch = dict(num_warps=st.num_warps, num_stages=st.num_stages, WORDS=words,
                                       LOOP=bool(st.loop))
    else:
        t = default_tiles()
        up_kernel = _mxfp4_gate_up_kernel
        up_n, up_k, down_n, down_k = t.up_block_n, t.up_block_k, t.down_block_n, t.down_block_k
        up_launch, down_launch = dict(num_warps=t.up_warps, num_stages=1), dict(num_warps=t.down_warps, num_stages=1)
    up_kernel[(triton.cdiv(inter, up_n), tokens * top_k)](
        x, q13, s13, ids, act, b13 if b13 is not None else x, inter, x.stride(0), q13.stride(0), q13.stride(1),
        s13.stride(0), s13.stride(1), b13.stride(0) if b13 is not None else 0,
        float(extras.swiglu_alpha) if swiglu else 1.0, float(extras.swiglu_limit) if swiglu else 0.0, TOP_K=top_k,
        K=hidden, BLOCK_N=up_n, BLOCK_K=max(64, min(up_k, triton.next_power_of_2(hidden))),
        HAS_BIAS=b13 is not None, SWIGLU=swiglu, **up_launch, **pdl_options(x))
    down_k = max(64, min(down_k, triton.next_power_of_2(inter)))
    b2_args = (b2 if b2 is not None else act, hidden, q2.stride(0), q2.stride(1), s2.stride(0), s2.stride(1))
    if scaled(x):  # a program a pair: each pair's weighted term, then a token's top_k terms summed in float32 (one
        # PDL launch: torch's sum and cast were two launches outside the chain, 4.7 us of gpt-oss-20b's layer)
        terms = torch.empty((tokens * top_k, hidden), dtype=x.dtype, device=x.device)
        _mxfp4_down_scaled_kernel[(triton.cdiv(hidden, down_n), tokens * top_k)](
            act, q2, s2, ids, weights, terms, *b2_args, b2.stride(0) if b2 is not None else 0, K=inter,
            BLOCK_N=down_n, BLOCK_K=down_k, HAS_BIAS=b2 is not None, **down_launch, **pdl_options(x))
        out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
        _terms_sum_kernel[(triton.cdiv(hidden, TERMS_BLOCK), tokens)](terms, out, hidden, TOP_K=top_k,
                                                                      BLOCK=TERMS_BLOCK, num_warps=4,
                                                                      **pdl_options(x))
        return out
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    _mxfp4_down_kernel[(triton.cdiv(hidden, down_n), tokens)](
        act, q2, s2, ids, weights, out, *b2_args, out.stride(0), b2.stride(0) if b2 is not None else 0, TOP_K=top_k,
        K=inter, BLOCK_N=down_n, BLOCK_K=down_k, HAS_BIAS=b2 is not None, **down_launch, **pdl_options(x))
    return out


def decode_experts_mxfp4(x: torch.Tensor, q13: torch.Tensor, s13: torch.Tensor, q2: torch.Tensor, s2: torch.Tensor,
                         weights: torch.Tensor, ids: torch.Tensor, extras: ExpertExtras | None = None,
                         tiles: ScaledTiles | None = None) -> torch.Tensor:
    """The few-token launches alone (fused_experts_mxfp4's decode path), with `tiles` for bfloat16 activations in
    place of the defaults (benchmarks.moe_decode --mxfp4 searches them)."""
    check_mxfp4(x, q13, s13, q2, s2)
    return _decode(x.contiguous(), q13, s13, q2, s2, weights, ids, extras, tiles)


def _few_enough(x: torch.Tensor, tokens: int, top_k: int, experts: int) -> bool:
    """Whether these tokens take the few-token launches: for bfloat16 rows ScaledTiles.max_pairs where set, else
    kernels.moe_decode's rule or WORD_PAIRS pairs, whichever allows more; for other rows the rule."""
    if not scaled(x):
        return use_decode_path(tokens, top_k, experts)
    limit = tiles_from_env(ScaledTiles, TILES_ENV).max_pairs
    if limit:
        return tokens * top_k <= limit
    return tokens * top_k <= WORD_PAIRS or use_decode_path(tokens, top_k, experts)


def fused_experts_mxfp4(x: torch.Tensor, q13: torch.Tensor, s13: torch.Tensor, q2: torch.Tensor, s2: torch.Tensor,
                        weights: torch.Tensor, ids: torch.Tensor, elsewhere: bool = True,
                        decode_path: bool | None = None, extras: ExpertExtras | None = None) -> torch.Tensor:
    """kernels.moe.fused_experts over MXFP4 experts (module docstring): x [tokens, hidden], routing weights and
    expert ids [tokens, top_k] (-1: another rank's) -> [tokens, hidden] in x's dtype. `decode_path` forces the
    few-token launches (True) or the grouped GEMMs (False); `extras`: the biases and the clamped SwiGLU."""
    check_mxfp4(x, q13, s13, q2, s2)
    tokens, top_k = ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    if _few_enough(x, tokens, top_k, q13.shape[0]) if decode_path is None else decode_path:
        return _decode(x, q13, s13, q2, s2, weights, ids, extras)
    layer = tuned_tiles(x, q13, tokens)  # (keyed by the codes' shape: entries of their own)
    if layer is None:
        block_m, up, down = default_grouped_tiles(tokens * top_k / q13.shape[0])
        layer = (block_m, SCALED_GROUPED_TILES, SCALED_GROUPED_TILES) if scaled(x) else (block_m, up, down)
    if interpreting():
        layer = (BLOCK_M, INTERPRETED_TILES, INTERPRETED_TILES)
    experts = ((q13, s13), (q2, s2))
    return grouped_experts(x, weights, ids, q13.shape[0], layer,
                           lambda a, second, *launch: _grouped(a, *experts[second], *launch), elsewhere, extras)


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # a code's value


def dequantize_experts(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., N, K / 2] codes and [..., N, K / 32] scales -> [..., N, K] weights in `dtype` (plain torch, at once:
    engine.quantization.mxfp4.dequantize runs it a chunk of rows at a time)."""
    lut = torch.tensor(E2M1, dtype=torch.float32, device=q.device)
    codes = q.to(torch.uint8)
    values = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1).flatten(-2)
    exps = s.to(torch.int32).repeat_interleave(GROUP, dim=-1) - 127
    return torch.ldexp(values, exps).to(dtype)


def fused_experts_mxfp4_reference(x: torch.Tensor, q13: torch.Tensor, s13: torch.Tensor, q2: torch.Tensor,
                                  s2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                                  extras: ExpertExtras | None = None) -> torch.Tensor:
    """The twin: the experts dequantized (exact), then kernels.moe's twin."""
    w13, w2 = dequantize_experts(q13, s13, x.dtype), dequantize_experts(q2, s2, x.dtype)
    return fused_experts_reference(x, w13, w2, weights, ids, extras)
