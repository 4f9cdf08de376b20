"""Mixture-of-experts MLP for a few tokens (small decode batches) in two gemv-shaped launches, and its plain-torch
twin. No alignment and no sorting: every (token, k) pair ("pair" = token * top_k + k, kernels.moe's slot) reads its
expert's weights itself.

  gate/up   grid (cdiv(inter, BLOCK_N), pairs): a program loads its pair's expert id, streams BLOCK_N gate rows and
            the BLOCK_N matching up rows of w13[expert] (whole rows, unrolled over K, in registers: kernels.gemv's
            gemv_row) against x[pair // top_k], and writes silu(gate) * up to act [pairs, inter].
  down      grid (cdiv(hidden, BLOCK_N), tokens): a program owns BLOCK_N output columns of one token and reads its
            top_k experts' rows at once (the experts a tensor axis), each product times the routing weight, summed
            in registers (the top-k sum fused: deterministic, no atomics), written once to out [tokens, hidden] in
            the activations' dtype. DecodeTiles.down_stacked=0 loops over the experts instead, summing in k order.

Rounding is kernels.moe.fused_experts': each product accumulates in float32 and is rounded to the activations' dtype
once; SiLU-and-mul as kernels.activation; the routing weight multiplies the rounded down-projection, rounded again; the
top_k rows are summed in float32 and rounded once. An id of -1 (an expert of another rank) loads nothing and adds
nothing. Expert ids are read on the device and every shape follows the token count: CUDA graphs capture it.

Experts with biases and GPT-OSS's clamped SwiGLU (kernels.moe_extras.ExpertExtras) take the same launches: each
product's bias is added to its rounded result (rounded again, as a product and a bias add round in torch), and the
activation rounds after each of its operations as torch's do in the activations' dtype (kernels.moe_extras.clamped_swiglu).
"""

from __future__ import annotations

import functools
import json
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixmesh.kernels.activation import silu_and_mul_reference
from radixmesh.kernels.moe_activation import swiglu_rounded
from radixmesh.kernels.moe_extras import clamped, clamped_swiglu
from radixmesh.kernels.runtime import interpreting, pdl_enter, pdl_options

# Which token counts take this path. It reads one expert's weights per pair, where the grouped GEMMs read each
# distinct expert once, but it saves their alignment, SiLU and top-k sum launches (at batch 1 on an H200: 7.7, ~2 and
# 4.4 us a layer, against 17.6 us of expert weights at 4.3 TB/s) and their 16-row tiles' waste. With pairs spread
# uniformly over E experts, pairs <= E / 4 keeps the expected re-read near 10% (Qwen3-30B-A3B, E = 128, top-8: 4
# tokens give 32 pairs over 29.3 distinct experts, +9%; 8 tokens would re-read 24%, ~27 us of a 113-us layer, more
# than the ~12 us of launches saved; E = 256: 8 tokens, +12%); 64 pairs bound the grid and the act buffer. One token
# always qualifies (its pairs are distinct experts: no re-read), so batch-1 decode takes this path in every model.
# benchmarks.moe_decode times both paths at 1-16 tokens: the crossover to set this by.
MAX_PAIRS = 64


def use_decode_path(tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether `tokens` tokens routed to `top_k` of `num_experts` experts run here rather than the grouped GEMMs."""
    return tokens * top_k <= max(top_k, min(MAX_PAIRS, num_experts // 4))


class DecodeTiles(NamedTuple):
    """Both launches' tiles: output columns per program, the K chunk each load covers (a power of two; K is a
    constant of the compiled kernel, so the chunks unroll and their loads go out together) and warps."""

    up_block_n: int = 1  # act columns per gate/up program: it reads 2 x up_block_n rows of w13 (1: the H100's best
    # at 1, 2, 4 and 8 tokens of the Qwen3-30B-A3B layer, benchmarks.moe_decode, 2026-12-05)
    up_block_k: int = 1024
    up_warps: int = 4
    down_block_n: int = 4  # hidden columns per down program: it reads top_k x down_block_n rows of w2
    down_block_k: int = 256
    down_warps: int = 4
    down_stacked: int = 1  # the down launch loads its top_k experts' rows as one [top_k, block_n, block_k] tile per K
    # chunk and reduces them at once (_down_stacked_kernel); 0: expert after expert (_down_sum_kernel). On an H100,
    # Qwen3-30B-A3B's layer at 1 token: 27.6 against 30.6 us (the floor 25.1), 2 and 4 tokens ~1 us better too
    # (benchmarks.moe_decode, 2026-12-06)


# Triton's interpreter runs programs one by one in Python (~20 ms each): wide blocks, a handful of programs
INTERPRETER_TILES = DecodeTiles(up_block_n=64, up_block_k=256, down_block_n=64, down_block_k=256)
TILES_ENV = "RADIXMESH_MOE_DECODE_TILES"  # JSON of DecodeTiles fields overriding the defaults (an operator's tuning)


def default_tiles() -> DecodeTiles:
    """DecodeTiles(), with the fields RADIXMESH_MOE_DECODE_TILES names (benchmarks.moe_decode finds a GPU's best);
    INTERPRETER_TILES in Triton's interpreter."""
    return INTERPRETER_TILES if interpreting() else tiles_from_env(DecodeTiles, TILES_ENV)


def tiles_from_env(cls, env: str):
    """cls() (a NamedTuple of integer tile fields) with the fields the JSON object in $env names."""
    return _tiles_from(cls, env, os.environ.get(env, ""))


@functools.cache
def _tiles_from(cls, env: str, text: str):
    """Parsed once per value: every MoE layer of an eager forward asks."""
    if not text:
        return cls()
    try:
        fields = json.loads(text)
        return cls()._replace(**{k: int(v) for k, v in fields.items()})
    except (ValueError, TypeError) as e:
        raise ValueError(f"{env}={text!r} is not a JSON object of {cls.__name__} fields "
                         f"({', '.join(cls._fields)}): {e}") from None


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, ids_ptr, act_ptr, b_ptr, inter, stride_x, stride_we, stride_wn, stride_be,
                    alpha, limit, TOP_K: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PDL: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr):
    pdl_enter(PDL)
    # act[pair, n] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, inter + n]), e = ids[pair], token = pair // TOP_K,
    # for the BLOCK_N columns n of program_id(0); act [pairs, inter] contiguous. An id of -1 loads nothing: zeros.
    pair = tl.program_id(1).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = n < inter
    rows_ok = (n < tl.where(expert >= 0, inter, 0))[:, None]  # no row at all for an id of -1
    gate_rows = w_ptr + tl.maximum(expert, 0) * stride_we + n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    up_rows = gate_rows + inter * stride_wn
    x_row = x_ptr + (pair // TOP_K) * stride_x
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: every load of the program is independent of the others
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        g = tl.load(gate_rows + k[None, :], mask=rows_ok & k_ok[None, :], other=0.0, eviction_policy="evict_first")
        u = tl.load(up_rows + k[None, :], mask=rows_ok & k_ok[None, :], other=0.0, eviction_policy="evict_first")
        acc_gate += g.to(tl.float32) * x
        acc_up += u.to(tl.float32) * x
    dtype = act_ptr.dtype.element_ty
    gate = tl.sum(acc_gate, axis=1).to(dtype).to(tl.float32)  # [BLOCK_N], rounded as a dense product is
    up = tl.sum(acc_up, axis=1).to(dtype).to(tl.float32)
    if HAS_BIAS:  # this expert's gate and up biases (b [experts, 2 x inter]), each sum rounded
        bias = b_ptr + tl.maximum(expert, 0) * stride_be + n
        gate = (gate + tl.load(bias, mask=n_ok, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        up = (up + tl.load(bias + inter, mask=n_ok, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    if SWIGLU:
        act = swiglu_rounded(gate, up, alpha, limit, dtype)
    else:
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    tl.store(act_ptr + pair * inter + n, act.to(dtype), mask=n_ok)


@triton.jit
def _down_sum_kernel(act_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, b_ptr, hidden, stride_we, stride_wn, stride_out,
                     stride_be, TOP_K: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr, HAS_BIAS: tl.constexpr):
    pdl_enter(PDL)
    # out[token, n] = sum over k of weights[pair] * (act[pair] . w2[ids[pair], n]), pair = token * TOP_K + k, for the
    # BLOCK_N columns n of program_id(0); act [pairs, K] contiguous. Pairs of id -1 load nothing and add nothing.
    token = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = n < hidden
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        k_end = tl.where(expert >= 0, K, 0)  # an id of -1: no column of act or w2 at all
        rows = w_ptr + tl.maximum(expert, 0) * stride_we + n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < k_end
            a = tl.load(act_ptr + pair * K + k, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
            acc += w.to(tl.float32) * a[None, :]
        down = tl.sum(acc, axis=1).to(dtype).to(tl.float32)  # [BLOCK_N]
        if HAS_BIAS:  # (an id of -1 adds none: its weight's product stays zero)
            bias = tl.load(b_ptr + tl.maximum(expert, 0) * stride_be + n, mask=n < tl.where(expert >= 0, hidden, 0),
                           other=0.0)
            down = (down + bias.to(tl.float32)).to(dtype).to(tl.float32)
        weight = tl.load(weights_ptr + pair).to(tl.float32)  # finite, and down is zero for an id of -1
        total += (down * weight).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_out + n, total.to(dtype), mask=n_ok)


@triton.jit
def _down_stacked_kernel(act_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, b_ptr, hidden, stride_we, stride_wn,
                         stride_out, stride_be, TOP_K: tl.constexpr, KB: tl.constexpr, K: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, HAS_BIAS: tl.constexpr):
    pdl_enter(PDL)
    # _down_sum_kernel's result with the top_k experts as a tensor axis: per K chunk one [KB, BLOCK_N, BLOCK_K] load of
    # every expert's rows, one reduction over K for all of them, then the weighted, rounded rows summed over k in
    # float32 (a tree's order, not k's: float32 sums of 8 terms, rounded once to the dtype).
    token = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, KB)
    pair = token * TOP_K + j  # [KB]
    expert = tl.load(ids_ptr + pair, mask=j < TOP_K, other=-1).to(tl.int64)
    here = expert >= 0  # (an id of -1, or past TOP_K: no row of act or w2 at all)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = n < hidden
    rows = (w_ptr + tl.maximum(expert, 0)[:, None, None] * stride_we
            + n.to(tl.int64)[None, :, None] * stride_wn)  # [KB, BLOCK_N, 1]
    acc = tl.zeros([KB, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(act_ptr + pair[:, None] * K + k[None, :], mask=here[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(rows + k[None, None, :], mask=here[:, None, None] & n_ok[None, :, None] & k_ok[None, None, :],
                    other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * a.to(tl.float32)[:, None, :]
    dtype = out_ptr.dtype.element_ty
    down = tl.sum(acc, axis=2).to(dtype).to(tl.float32)  # [KB, BLOCK_N]
    if HAS_BIAS:
        bias = tl.load(b_ptr + tl.maximum(expert, 0)[:, None] * stride_be + n[None, :],
                       mask=here[:, None] & n_ok[None, :], other=0.0)
        down = (down + bias.to(tl.float32)).to(dtype).to(tl.float32)
    weight = tl.load(weights_ptr + pair, mask=here, other=0.0).to(tl.float32)
    weighted = (down * weight[:, None]).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_out + n, tl.sum(weighted, axis=0).to(dtype), mask=n_ok)


def decode_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   tiles: DecodeTiles | None = None, extras=None) -> torch.Tensor:
    """x [tokens, hidden], w13 [experts, 2 x inter, hidden], w2 [experts, hidden, inter] (x's dtype, unit last
    stride), routing weights [tokens, top_k] (x's dtype or float32) and expert ids [tokens, top_k] (-1: another
    rank's) -> [tokens, hidden] in x's dtype: kernels.moe.fused_experts' result in two launches (module docstring).
    `tiles` overrides DecodeTiles() (INTERPRETER_TILES in the interpreter) for tuning; `extras`
    (kernels.moe_extras.ExpertExtras): the biases and the clamped SwiGLU. Meant for use_decode_path's token counts; any
    count is computed."""
    tokens, top_k = ids.shape
    experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if (x.shape != (tokens, hidden) or w2.shape != (experts, hidden, inter) or weights.shape != ids.shape
            or two_inter % 2 or w13.dtype != x.dtype or w2.dtype != x.dtype):
        raise ValueError(f"decode_experts takes x [tokens, hidden], w13 [experts, 2 x inter, hidden], w2 [experts, "
                         f"hidden, inter] of x's dtype and weights, ids [tokens, top_k]; got x {tuple(x.shape)} "
                         f"{x.dtype}, w13 {tuple(w13.shape)} {w13.dtype}, w2 {tuple(w2.shape)} {w2.dtype}, weights "
                         f"{tuple(weights.shape)}, ids {tuple(ids.shape)}")
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    t = tiles or default_tiles()
    x, w13, w2 = (a if a.stride(-1) == 1 else a.contiguous() for a in (x, w13, w2))
    ids, weights = ids.contiguous(), weights.contiguous()
    act = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)  # [pairs, inter]
    b13 = extras.b13 if extras is not None else None
    b2 = extras.b2 if extras is not None else None
    swiglu = clamped(extras)
    _gate_up_kernel[(triton.cdiv(inter, t.up_block_n), tokens * top_k)](
        x, w13, ids, act, b13 if b13 is not None else x, inter, x.stride(0), w13.stride(0), w13.stride(1),
        b13.stride(0) if b13 is not None else 0, float(extras.swiglu_alpha) if swiglu else 1.0,
        float(extras.swiglu_limit) if swiglu else 0.0, TOP_K=top_k, K=hidden, BLOCK_N=t.up_block_n,
        BLOCK_K=min(t.up_block_k, triton.next_power_of_2(hidden)), HAS_BIAS=b13 is not None, SWIGLU=swiglu,
        num_warps=t.up_warps, num_stages=1, **pdl_options(x))
    down_args = (act, w2, ids, weights, out, b2 if b2 is not None else out, hidden, w2.stride(0), w2.stride(1),
                 out.stride(0), b2.stride(0) if b2 is not None else 0)
    down_tiles = dict(TOP_K=top_k, K=inter, BLOCK_N=t.down_block_n,
                      BLOCK_K=min(t.down_block_k, triton.next_power_of_2(inter)), num_warps=t.down_warps,
                      num_stages=1, HAS_BIAS=b2 is not None, **pdl_options(x))
    grid = (triton.cdiv(hidden, t.down_block_n), tokens)
    if t.down_stacked:
        _down_stacked_kernel[grid](*down_args, KB=triton.next_power_of_2(top_k), **down_tiles)
    else:
        _down_sum_kernel[grid](*down_args, **down_tiles)
    return out


def decode_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                             ids: torch.Tensor, extras=None) -> torch.Tensor:
    """The twin of `decode_experts`, pair by pair in batched torch operations: each product in float32 rounded once
    to x's dtype, SiLU-and-mul as kernels.activation's twin, the weighted rows rounded, summed over k in float32 and
    rounded once."""
    tokens, top_k = ids.shape
    here = (ids >= 0).flatten()
    experts = ids.clamp(min=0).flatten()  # [pairs]
    xs = x.repeat_interleave(top_k, dim=0).float()  # [pairs, hidden]
    gate_up = torch.bmm(w13[experts].float(), xs[:, :, None])[:, :, 0].to(x.dtype)  # [pairs, 2 x inter]
    if extras is not None and extras.b13 is not None:
        gate_up = gate_up + extras.b13[experts].to(x.dtype)
    if clamped(extras):
        act = clamped_swiglu(gate_up, extras)
    else:
        act = silu_and_mul_reference(gate_up)
    down = torch.bmm(w2[experts].float(), act.float()[:, :, None])[:, :, 0].to(x.dtype)  # [pairs, hidden]
    if extras is not None and extras.b2 is not None:
        down = down + extras.b2[experts].to(x.dtype)
    weighted = (down.float() * weights.flatten().float()[:, None]).to(x.dtype)
    weighted = torch.where(here[:, None], weighted, torch.zeros_like(weighted))
    return weighted.view(tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)
