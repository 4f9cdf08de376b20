"""Rotary position embedding (rotate-half / neox layout) for q and k in one Triton launch, and its plain-torch twin;
and for decode the same launch fused with the KV store (`rotary_store_kv`): the rotated k and the v of each token go
straight into their slot of the paged pool, one kernel per layer fewer. Either may also apply Qwen3's per-head
RMSNorm of q and k first (`qk_norm`: the two weights and eps), two launches a layer fewer again (and a per-head
LayerNorm's ten, below).

Numerics are those of engine.layers.rotary (Hugging Face's): the float32 cos/sin rows are cast to the model dtype,
then out = x * cos + rotate_half(x) * sin with PyTorch's per-op rounding: each product rounded to the model dtype, then
the sum rounded. Every step is an exactly rounded elementwise op, so the kernel equals the twin bit for bit; on the
GPU it is compiled without fused multiply-adds, which would skip the float32 rounding of the products. The norm is
kernels.norm.rmsnorm's (float32 statistics over the head, x * rstd rounded to the model dtype, times the weight rounded
again) on each head before it rotates; its sum of squares adds the head's two halves in another order than a
whole-row sum, so a normed value may round to the neighbour of the twin's. Gemma 3's norm (`QKNorm.offset`: the
weight stored as an offset from 1) is kernels.norm.gemma_rmsnorm's instead: float32 throughout, one rounding. A
per-head LayerNorm (`QKNorm.layer`: Command-R+'s and StableLM 2's, each head its own weight row, and Phi's, one weight
and a bias for every head) is engine.layers.norm's: the head's mean removed, float32 throughout, one rounding.

Partial rotary (cos/sin narrower than a head: Phi-4-mini, GLM-4.5, MiniMax-M2, StableLM): the leading `rotary_dim`
dimensions of each head rotate, the rest pass through (normed first, over the whole head, when `qk_norm` is set), as
engine.layers.rotary does it. Interleaved pairs (`Pairs`: Cohere, GLM-4): dimensions (2i, 2i + 1) rotate together,
over a table that holds each frequency twice in a row; Cohere's in float32 (each product and the pair's sum rounded
to float32, then once to the dtype, as torch computes it on the upcast rows).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from radixmesh.kernels.kv_store import check_store, store_kv_reference
from radixmesh.kernels.norm import gemma_rmsnorm_reference, rmsnorm_reference
from radixmesh.kernels.runtime import pdl_enter, pdl_options



class QKNorm(NamedTuple):
    """Qwen3's per-head RMSNorm of q and k (any (q weight, k weight, eps) tuple will do); with `offset` Gemma 3's;
    with `layer` a LayerNorm per head."""

    q_weight: torch.Tensor  # [head_dim], q's dtype; with `layer` any float dtype, or [heads, head_dim]: a row a head
    k_weight: torch.Tensor
    eps: float
    offset: bool = False  # Gemma's x * rsqrt(mean(x^2) + eps) * (1 + weight), in float32, rounded once
    layer: bool = False  # (x - mean) * rsqrt(var + eps) * weight (+ bias), in float32, rounded once
    q_bias: torch.Tensor | None = None  # with `layer`: [head_dim] (Phi's), added before the rounding
    k_bias: torch.Tensor | None = None

class Pairs(NamedTuple):
    """GPT-J's interleaved pairs (2i, 2i + 1) instead of rotate-half's: Cohere's (upcast: each pair's sums in float32,
    rounded once) and GLM's (in the model dtype)."""

    upcast: bool


_MIN_PROGRAMS = 528  # 4 programs per SM of a 132-SM H100: few tokens get fewer heads per program, down to 1
_MAX_HEADS = 8  # heads per program with many tokens: [8, head_dim / 2] tiles, 1 KiB each at head_dim 128 in bf16


@triton.jit
def _pair(d, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The two dimensions of a head that rotate together as pair d: (d, HALF + d), or (2d, 2d + 1) with
    INTERLEAVED."""
    if INTERLEAVED:
        e1 = 2 * d
        e2 = e1 + 1
    else:
        e1 = d
        e2 = d + HALF
    return e1, e2


@triton.jit
def _rotate_heads(src, dst, stride_head, dst_stride_head, head0, n_heads, c1, c2, s1, s2, norm_w, norm_b, w_stride,
                  eps, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, NORM: tl.constexpr,
                  TAIL: tl.constexpr, BLOCK_TAIL: tl.constexpr, OFFSET: tl.constexpr, INTERLEAVED: tl.constexpr,
                  UPCAST: tl.constexpr, LAYER: tl.constexpr, BIAS: tl.constexpr, W_HEADS: tl.constexpr):
    """Rotates heads [head0, head0 + BLOCK_H) of one token, each normed by norm_w [2 * HALF + TAIL] first when NORM:
    RMS-normed (Gemma's offset weight with OFFSET), or with LAYER LayerNormed (BIAS: plus norm_b's row; W_HEADS: each
    head its own weight row, w_stride apart); the TAIL dimensions after the rotated 2 * HALF pass through. src rows
    are stride_head apart, dst's dst_stride_head. Pairs rotate-half or INTERLEAVED (_pair); UPCAST: a pair's
    sums in float32, rounded once (Cohere's), else each product rounded to the dtype first (the model dtype's ops)."""
    heads = head0 + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    d = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    e1, e2 = _pair(d, HALF, INTERLEAVED)
    mask = (heads < n_heads)[:, None] & (d < HALF)[None, :]
    x1 = tl.load(src + heads[:, None] * stride_head + e1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + heads[:, None] * stride_head + e2[None, :], mask=mask, other=0.0).to(tl.float32)
    dtype = dst.dtype.element_ty
    if TAIL > 0:
        t = tl.arange(0, BLOCK_TAIL)
        tmask = (heads < n_heads)[:, None] & (t < TAIL)[None, :]
        x3 = tl.load(src + heads[:, None] * stride_head + 2 * HALF + t[None, :], mask=tmask, other=0.0).to(tl.float32)
    if NORM:
        if LAYER:  # the head's mean removed first (masked lanes stay 0)
            total = tl.sum(x1, axis=1) + tl.sum(x2, axis=1)
            if TAIL > 0:
                total += tl.sum(x3, axis=1)
            mean = (total / (2 * HALF + TAIL))[:, None]
            x1 = tl.where(mask, x1 - mean, 0.0)
            x2 = tl.where(mask, x2 - mean, 0.0)
            if TAIL > 0:
                x3 = tl.where(tmask, x3 - mean, 0.0)
        squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if TAIL > 0:
            squares += tl.sum(x3 * x3, axis=1)
        rstd = tl.rsqrt(squares / (2 * HALF + TAIL) + eps)[:, None]
        o1, m1 = _weight_offsets(heads, n_heads, w_stride, e1, d < HALF, W_HEADS)
        o2, m2 = _weight_offsets(heads, n_heads, w_stride, e2, d < HALF, W_HEADS)
        x1 = _normed(x1, rstd, norm_w, norm_b, o1, m1, dtype, OFFSET, LAYER, BIAS)
        x2 = _normed(x2, rstd, norm_w, norm_b, o2, m2, dtype, OFFSET, LAYER, BIAS)
        if TAIL > 0:
            o3, m3 = _weight_offsets(heads, n_heads, w_stride, 2 * HALF + t, t < TAIL, W_HEADS)
            x3 = _normed(x3, rstd, norm_w, norm_b, o3, m3, dtype, OFFSET, LAYER, BIAS)
    # rotate_half(x) = [-x2, x1]; round(-a) == -round(a), so x1*cos1 + (-x2)*sin1 == round(x1*cos1) - round(x2*sin1).
    if UPCAST:
        out1 = x1 * c1 - x2 * s1
        out2 = x2 * c2 + x1 * s2
    else:
        out1 = (x1 * c1).to(dtype).to(tl.float32) - (x2 * s1).to(dtype).to(tl.float32)
        out2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    tl.store(dst + heads[:, None] * dst_stride_head + e1[None, :], out1.to(dtype), mask=mask)
    tl.store(dst + heads[:, None] * dst_stride_head + e2[None, :], out2.to(dtype), mask=mask)
    if TAIL > 0:
        tl.store(dst + heads[:, None] * dst_stride_head + 2 * HALF + t[None, :], x3.to(dtype), mask=tmask)


@triton.jit
def _weight_offsets(heads, n_heads, w_stride, cols, cmask, W_HEADS: tl.constexpr):
    """Where the norm weights of `cols` are, with their mask: one row for every head ([1, block]), or with W_HEADS
    each head's own row, w_stride apart ([BLOCK_H, block])."""
    offs, omask = cols[None, :], cmask[None, :]
    if W_HEADS:
        offs, omask = heads[:, None] * w_stride + offs, (heads < n_heads)[:, None] & omask
    return offs, omask


@triton.jit
def _normed(x, rstd, w_ptr, b_ptr, offs, omask, dtype, OFFSET: tl.constexpr, LAYER: tl.constexpr,
            BIAS: tl.constexpr):
    """x [BLOCK_H, block] (float32, the mean already removed with LAYER) times rstd [BLOCK_H, 1] and the weight at
    w_ptr + offs, rounded to dtype as kernels.norm rounds (Llama's: x * rstd to the dtype, times the weight to the
    dtype; OFFSET, Gemma's: float32 throughout with (1 + weight), one rounding; LAYER, a LayerNorm's: float32
    throughout, plus the bias at b_ptr + offs with BIAS, one rounding), back in float32."""
    w = tl.load(w_ptr + offs, mask=omask, other=0.0).to(tl.float32)
    if LAYER:
        y = x * rstd * w
        if BIAS:
            y += tl.load(b_ptr + offs, mask=omask, other=0.0).to(tl.float32)
        return y.to(dtype).to(tl.float32)
    if OFFSET:
        return (x * rstd * (1.0 + w)).to(dtype).to(tl.float32)
    return ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, offset, dtype, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
             INTERLEAVED: tl.constexpr):
    """A position's cos/sin rows [rotary_dim] as four [1, BLOCK_HALF] parts, each pair's two (_pair), cast to the
    model dtype as the torch lookup does."""
    d = tl.arange(0, BLOCK_HALF)
    e1, e2 = _pair(d, HALF, INTERLEAVED)
    dmask = d < HALF
    c1 = tl.load(cos_ptr + offset + e1, mask=dmask, other=0.0).to(dtype).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + offset + e2, mask=dmask, other=0.0).to(dtype).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + offset + e1, mask=dmask, other=0.0).to(dtype).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + offset + e2, mask=dmask, other=0.0).to(dtype).to(tl.float32)[None, :]
    return c1, c2, s1, s2


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_dst_ptr, v_dst_ptr, cos_ptr, sin_ptr, pos_ptr, loc_ptr,
                   q_norm_ptr, k_norm_ptr, eps,
                   num_heads, num_kv_heads, q_blocks, q_stride_tok, q_stride_head, k_stride_tok, k_stride_head,
                   v_stride_tok, v_stride_head, kd_stride_row, kd_stride_head, vd_stride_row, vd_stride_head,
                   table_stride, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   STORE: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr, TAIL: tl.constexpr = 0,
                   BLOCK_TAIL: tl.constexpr = 1, BLOCK_HEAD: tl.constexpr = 0, OFFSET: tl.constexpr = False,
                   map_ptr=None, MAPPED: tl.constexpr = False, INTERLEAVED: tl.constexpr = False,
                   UPCAST: tl.constexpr = False, q_bias_ptr=None, k_bias_ptr=None, q_w_stride=0, k_w_stride=0,
                   LAYER: tl.constexpr = False, BIAS: tl.constexpr = False, W_HEADS: tl.constexpr = False):
    pdl_enter(PDL)
    # Grid (tokens, q_blocks + kv_blocks): block b < q_blocks rotates q heads [b * BLOCK_H, ...) into q_out; the rest
    # rotate k heads into row tok of k_dst, or with STORE into row loc[tok] of the pool k_dst, and then copy the
    # same v heads into that row of the pool v_dst. NORM: each q head normed by q_norm first (RMS, or LayerNorm with
    # LAYER: q_bias added with BIAS, a weight row a head q_w_stride apart with W_HEADS), each k head by k_norm. A
    # head is 2 * HALF rotated dimensions and TAIL passed through. MAPPED: the pool's row is map[loc[tok]] (a sliding
    # layer's slot for a full slot).
    tok = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    dtype = q_out_ptr.dtype.element_ty
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, pos * table_stride, dtype, HALF, BLOCK_HALF, INTERLEAVED)
    if blk < q_blocks:
        _rotate_heads(q_ptr + tok * q_stride_tok, q_out_ptr + tok * num_heads * (2 * HALF + TAIL), q_stride_head,
                      2 * HALF + TAIL, blk * BLOCK_H, num_heads, c1, c2, s1, s2, q_norm_ptr, q_bias_ptr, q_w_stride,
                      eps, HALF, BLOCK_H, BLOCK_HALF, NORM, TAIL, BLOCK_TAIL, OFFSET, INTERLEAVED, UPCAST, LAYER,
                      BIAS, W_HEADS)
    else:
        head0 = (blk - q_blocks) * BLOCK_H
        row = tok
        if STORE:
            row = tl.load(loc_ptr + tok).to(tl.int64)
            if MAPPED:
                row = tl.load(map_ptr + row).to(tl.int64)
        _rotate_heads(k_ptr + tok * k_stride_tok, k_dst_ptr + row * kd_stride_row, k_stride_head, kd_stride_head,
                      head0, num_kv_heads, c1, c2, s1, s2, k_norm_ptr, k_bias_ptr, k_w_stride, eps, HALF, BLOCK_H,
                      BLOCK_HALF, NORM, TAIL, BLOCK_TAIL, OFFSET, INTERLEAVED, UPCAST, LAYER, BIAS, W_HEADS)
        if STORE:
            heads = head0 + tl.arange(0, BLOCK_H)
            d = tl.arange(0, BLOCK_HEAD if BLOCK_HEAD > 0 else 2 * BLOCK_HALF)
            mask = (heads < num_kv_heads)[:, None] & (d < 2 * HALF + TAIL)[None, :]
            v = tl.load(v_ptr + tok * v_stride_tok + heads[:, None] * v_stride_head + d[None, :], mask=mask)
            tl.store(v_dst_ptr + row * vd_stride_row + heads[:, None] * vd_stride_head + d[None, :], v, mask=mask)


def _launch(q, k, v, cos, sin, positions, q_out, k_dst, v_dst, loc, qk_norm, slot_map=None, pairs=None) -> None:
    """Runs _rotary_kernel: k rotated into row t of k_dst (loc None, v unused) or into row loc[t] (slot_map[loc[t]])
    of the pools k_dst, v_dst with v copied beside it; q and k normed first by `qk_norm` (a QKNorm, or the leading
    fields of one as a tuple) unless None."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cos, sin = cos.contiguous(), sin.contiguous()
    block_h = _heads_per_program(n, num_heads, num_kv_heads)
    q_blocks = triton.cdiv(num_heads, block_h)
    rotary_dim = cos.shape[1]
    tail = head_dim - rotary_dim
    block_half = triton.next_power_of_2(rotary_dim // 2)
    norm = QKNorm(cos, cos, 0.0) if qk_norm is None else QKNorm(*qk_norm)
    w_heads = norm.q_weight.dim() == 2  # (a LayerNorm's weight row a head)
    _rotary_kernel[(n, q_blocks + triton.cdiv(num_kv_heads, block_h))](
        q, k, v, q_out, k_dst, v_dst, cos, sin, positions, positions if loc is None else loc, norm.q_weight,
        norm.k_weight, float(norm.eps), num_heads,
        num_kv_heads, q_blocks, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_dst.stride(0), k_dst.stride(1), v_dst.stride(0), v_dst.stride(1), cos.stride(0),
        HALF=rotary_dim // 2, BLOCK_H=block_h, BLOCK_HALF=block_half, STORE=loc is not None, NORM=qk_norm is not None,
        TAIL=tail, BLOCK_TAIL=triton.next_power_of_2(tail) if tail else 1, BLOCK_HEAD=triton.next_power_of_2(head_dim),
        OFFSET=bool(norm.offset), map_ptr=slot_map, MAPPED=slot_map is not None, INTERLEAVED=pairs is not None,
        UPCAST=pairs is not None and pairs.upcast, q_bias_ptr=norm.q_bias, k_bias_ptr=norm.k_bias,
        q_w_stride=norm.q_weight.stride(0) if w_heads else 0, k_w_stride=norm.k_weight.stride(0) if w_heads else 0,
        LAYER=bool(norm.layer), BIAS=norm.q_bias is not None, W_HEADS=w_heads,
        num_warps=max(1, min(8, block_h * block_half * q.element_size() // (16 * 32))),
        enable_fp_fusion=False,
        **pdl_options(q))


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None,
                 qk_norm: QKNorm | None = None, pairs: Pairs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, num_heads, head_dim], k [n, num_kv_heads, head_dim] (one dtype; any strides but a unit last one),
    cos/sin [max_positions, rotary_dim] float32 (rotary_dim <= head_dim: the leading dimensions that rotate), positions
    [n] int -> rotated (q, k), written to `q_out`, `k_out` (contiguous; they may be q and k themselves when those are
    contiguous) or new tensors. `qk_norm` (QKNorm: q weight, k weight [head_dim] of q's dtype, eps[, offset], or a
    LayerNorm's with `layer`): each head normed first (module docstring). `pairs`: the table's pairs interleaved
    (Pairs)."""
    _check(q, k, cos, sin, positions, qk_norm)
    q_out, k_out = _output(q_out, q), _output(k_out, k)
    if q.shape[0]:
        _launch(q, k, k, cos, sin, positions, q_out, k_out, k_out, None, qk_norm, pairs=pairs)
    return q_out, k_out


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
                    q_out: torch.Tensor | None = None, qk_norm: QKNorm | None = None,
                    slot_map: torch.Tensor | None = None, pairs: Pairs | None = None) -> torch.Tensor:
    """apply_rotary and kernels.kv_store.store_kv in one launch: q, k rotated as apply_rotary does (RMS-normed first
    with `qk_norm`), the rotated k and v [n, num_kv_heads, head_dim] written to rows `loc` [n] of k_cache, v_cache
    [num_slots, num_kv_heads, head_dim] (rows slot_map[loc] with `slot_map`, int64 [any]: a sliding layer's pool,
    addressed by full slots); returns the rotated q (in `q_out`, contiguous, or a new tensor). Bit for bit the two
    kernels it replaces."""
    _check(q, k, cos, sin, positions, qk_norm)
    check_store(k_cache, v_cache, loc, k, v)
    if slot_map is not None and (slot_map.dim() != 1 or slot_map.dtype not in (torch.int32, torch.int64)
                                 or slot_map.device != loc.device):
        raise ValueError(f"slot_map must be a 1-D int tensor on {loc.device}, got {tuple(slot_map.shape)} "
                         f"{slot_map.dtype} on {slot_map.device}")
    q_out = _output(q_out, q)
    if q.shape[0]:
        _launch(q, k, v, cos, sin, positions, q_out, k_cache, v_cache, loc, qk_norm, slot_map, pairs)
    return q_out


def rotary_store_kv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                              sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, loc: torch.Tensor, qk_norm: QKNorm | None = None,
                              slot_map: torch.Tensor | None = None, pairs: Pairs | None = None) -> torch.Tensor:
    """The twin of `rotary_store_kv`: the twins of the kernels it fuses, one after the other."""
    q_rot, k_rot = apply_rotary_reference(q, k, cos, sin, positions, qk_norm, pairs)
    store_kv_reference(k_cache, v_cache, loc if slot_map is None else slot_map[loc], k_rot, v)
    return q_rot


def _check(q, k, cos, sin, positions, qk_norm=None) -> None:
    n, _, head_dim = q.shape
    if k.dim() != 3 or k.shape[0] != n or k.shape[2] != head_dim or k.dtype != q.dtype or head_dim % 2:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} do not fit together")
    if cos.shape != sin.shape or cos.dim() != 2 or not 0 < cos.shape[1] <= head_dim or cos.shape[1] % 2 \
            or cos.dtype != torch.float32:
        raise ValueError(f"cos/sin must be float32 [max_positions, rotary_dim], rotary_dim even and at most "
                         f"{head_dim}, "
                         f"got {tuple(cos.shape)} {cos.dtype}")
    if positions.shape != (n,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int [{n}], got {tuple(positions.shape)} {positions.dtype}")
    if len({t.device for t in (q, k, cos, sin, positions)}) != 1:
        raise ValueError("q, k, cos, sin and positions must be on one device")
    if qk_norm is not None:
        _check_norm(QKNorm(*qk_norm), q, k.shape[1])


def _check_norm(norm: QKNorm, q: torch.Tensor, num_kv_heads: int) -> None:
    """An RMSNorm's weights: [head_dim] of q's dtype; a LayerNorm's (`layer`): [head_dim] or a row a head, any float
    dtype, with biases (both or neither) shaped and laid out as the weights."""
    head_dim = q.shape[2]
    weights = [w for w in (norm.q_weight, norm.k_weight, norm.q_bias, norm.k_bias) if w is not None]
    got = [(tuple(w.shape), w.dtype, str(w.device)) for w in weights]
    if not norm.layer:
        if any(w.shape != (head_dim,) or w.stride(0) != 1 or w.dtype != q.dtype or w.device != q.device
               for w in weights[:2]) or len(weights) > 2:
            raise ValueError(f"the q/k norm weights must be [{head_dim}] {q.dtype} on {q.device} (no biases), "
                             f"got {got}")
        return
    shapes = (((head_dim,), (head_dim,)) if norm.q_weight.dim() == 1
              else ((q.shape[1], head_dim), (num_kv_heads, head_dim)))
    biases = (norm.q_bias, norm.k_bias)
    if (any(w.shape != want or w.stride(-1) != 1 or not w.is_floating_point() or w.device != q.device
            for w, want in zip((norm.q_weight, norm.k_weight), shapes))
            or (biases[0] is None) != (biases[1] is None)
            or any(b is not None and (b.shape != w.shape or b.stride() != w.stride() or b.device != q.device)
                   for b, w in zip(biases, (norm.q_weight, norm.k_weight)))):
        raise ValueError(f"the q/k LayerNorm weights must be {list(shapes)} rows on {q.device}, biases both or neither "
                         f"and shaped as their weights, got {got}")


def _output(out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(like.shape)} {like.dtype} tensor on {like.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return out


def _heads_per_program(n_tokens: int, num_heads: int, num_kv_heads: int) -> int:
    """Up to _MAX_HEADS heads per program, halved while the grid would be too small to fill the GPU."""
    block_h = min(_MAX_HEADS, triton.next_power_of_2(max(num_heads, num_kv_heads)))
    while block_h > 1 and n_tokens * (triton.cdiv(num_heads, block_h) + triton.cdiv(num_kv_heads, block_h)) \
            < _MIN_PROGRAMS:
        block_h //= 2
    return block_h


def apply_rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           positions: torch.Tensor, qk_norm: QKNorm | None = None, pairs: Pairs | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of `apply_rotary`: (with `qk_norm` kernels.norm's twin on q and on k, then) RotaryEmbedding.lookup
    and engine.layers.rotary.apply_rotary, op for op."""
    if qk_norm is not None:
        norm = QKNorm(*qk_norm)
        if norm.layer:
            q, k = _layer_norm_heads(q, norm.q_weight, norm.q_bias, norm.eps), \
                _layer_norm_heads(k, norm.k_weight, norm.k_bias, norm.eps)
        else:
            twin = gemma_rmsnorm_reference if norm.offset else rmsnorm_reference
            q, k = twin(q, norm.q_weight, norm.eps), twin(k, norm.k_weight, norm.eps)
    c = cos[positions].to(q.dtype)[:, None, :]  # [n, 1, rotary_dim]
    s = sin[positions].to(q.dtype)[:, None, :]
    if pairs is not None:
        return _rotate_interleaved(q, c, s, pairs.upcast), _rotate_interleaved(k, c, s, pairs.upcast)
    return _rotate(q, c, s), _rotate(k, c, s)


def _layer_norm_heads(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [n, heads, head_dim] LayerNormed per head in float32, times the weight ([head_dim] or a row a head) and plus
    the bias in float32, rounded once: engine.layers.norm.HeadLayerNorm's arithmetic."""
    h = F.layer_norm(x.float(), (x.shape[-1],), eps=eps) * weight.float()
    return (h if bias is None else h + bias.float()).to(x.dtype)


def _rotate_interleaved(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, upcast: bool) -> torch.Tensor:
    """GPT-J's pairs (x0, x1) -> (x0 c - x1 s, x1 c + x0 s), in float32 rounded once with `upcast`, else in x's
    dtype op by op; the dimensions past the table's pass through."""
    dim = c.shape[-1]
    rot = x[..., :dim].float() if upcast else x[..., :dim]
    swapped = torch.stack([-rot[..., 1::2], rot[..., ::2]], dim=-1).flatten(-2)
    out = (rot * c + swapped * s).to(x.dtype)
    return out if dim == x.shape[-1] else torch.cat([out, x[..., dim:]], dim=-1)


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    dim = c.shape[-1]
    if dim == x.shape[-1]:
        return x * c + _rotate_half(x) * s
    rot = x[..., :dim]
    return torch.cat([rot * c + _rotate_half(rot) * s, x[..., dim:]], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
