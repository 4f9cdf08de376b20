"""Mixture-of-experts MLP for a few tokens (small decode batches) in two gemv-shaped launches, and its plain-torch
twin. No alignment and no sorting: every (token, k) pair ("pair" = token * top_k + k, kernels.moe's slot) reads its
expert's weights itself.

  gate/up   grid (cdiv(inter, BLOCK_N), pairs): a program loads its pair's expert id, streams BLOCK_N gate rows and
            the BLOCK_N matching up rows of w13[expert] (whole rows, unrolled over K, in registers: kernels.gemv's
            gemv_row) against x[pair // top_k], and writes silu(gate) * up to act [pairs, inter].
  down      grid (cdiv(hidden, BLOCK_N), tokens): a program owns BLOCK_N output columns of one token and loops over
            its top_k experts, each product times the routing weight, summed in registers in k order (the top-k sum
            fused: deterministic, no atomics), written once to out [tokens, hidden] in the activations' dtype.

Rounding is kernels.moe.fused_experts': each product accumulates in float32 and is rounded to the activations' dtype
once; SiLU-and-mul as kernels.activation; the routing weight multiplies the rounded down-projection, rounded again; the
top_k rows are summed in float32 and rounded once. An id of -1 (an expert of another rank) loads nothing and adds
nothing. Expert ids are read on the device and every shape follows the token count: CUDA graphs capture it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixmesh.kernels.activation import silu_and_mul_reference
from radixmesh.kernels.moe import _route_row, route_blocks, route_reference
from radixmesh.kernels.runtime import LINE_BYTES, interpreting, pdl_enter, pdl_options, prefetch_l2

# Which token counts take this path. It reads one expert's weights per pair, where the grouped GEMMs read each
# distinct expert once, but it saves their alignment, SiLU and top-k sum launches (at batch 1 on an H200: 7.7, ~2 and
# 4.4 us a layer, against 17.6 us of expert weights at 4.3 TB/s) and their 16-row tiles' waste. With pairs spread
# uniformly over E experts, pairs <= E / 4 keeps the expected re-read near 10% (Qwen3-30B-A3B, E = 128, top-8: 4
# tokens give 32 pairs over 29.3 distinct experts, +9%; 8 tokens would re-read 24%, ~27 us of a 113-us layer, more
# than the ~12 us of launches saved; E = 256: 8 tokens, +12%); 64 pairs bound the grid and the act buffer. One token
# always qualifies (its pairs are distinct experts: no re-read), so batch-1 decode takes this path in every model.
# benchmarks.moe_decode times both paths at 1-16 tokens: the crossover to set this by.
MAX_PAIRS = 64

# While the gate/up launch streams w13, its programs pull the start of their experts' w2 into L2 behind their own
# loads, so that the down launch begins on L2 hits instead of a cold chain to memory: at most this many bytes in all
# (the L2 of an H100 or H200 holds 50 MB; w13 streams past it marked evict-first). At batch 1 of Qwen3-30B-A3B the
# 8 experts' w2 is 25 MB: all of it. 0 turns it off (benchmarks.moe_decode measures both).
PREFETCH_DOWN_BYTES = 32 << 20


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


# Triton's interpreter runs programs one by one in Python (~20 ms each): wide blocks, a handful of programs
INTERPRETER_TILES = DecodeTiles(up_block_n=64, up_block_k=256, down_block_n=64, down_block_k=256)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, ids_ptr, act_ptr, inter, stride_x, stride_we, stride_wn,
                    logits_ptr, weights_ptr, E, stride_l, first, local, w2_ptr, stride_w2e, w2_lines,
                    TOP_K: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PDL: tl.constexpr, ROUTED: tl.constexpr, KB: tl.constexpr, EB: tl.constexpr,
                    RENORM: tl.constexpr, CHUNK: tl.constexpr, PREFETCH_LINES: tl.constexpr,
                    LINE_ELEMS: tl.constexpr):
    pdl_enter(PDL)
    # act[pair, n] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, inter + n]), e = ids[pair], token = pair // TOP_K,
    # for the BLOCK_N columns n of program_id(0); act [pairs, inter] contiguous. An id of -1 loads nothing: zeros.
    # ROUTED: the program routes its token itself from the router's logits (kernels.moe._route_row) and takes expert
    # k = pair % TOP_K of it; the first program of each pair writes the pair's weight and (global) id out. The global
    # id minus `first` is this rank's expert, -1 outside [0, local).
    pair = tl.program_id(1).to(tl.int64)
    if ROUTED:
        top_w, top_i = _route_row(logits_ptr + (pair // TOP_K) * stride_l, E, TOP_K, KB, EB, RENORM, CHUNK)
        mine = tl.arange(0, KB) == pair % TOP_K
        expert = tl.sum(tl.where(mine, top_i, 0), 0).to(tl.int64)
        if tl.program_id(0) == 0:
            tl.store(weights_ptr + pair, tl.sum(tl.where(mine, top_w, 0.0), 0).to(weights_ptr.dtype.element_ty))
            tl.store(ids_ptr + pair, expert)
        expert -= first
        expert = tl.where((expert >= 0) & (expert < local), expert, -1)
    else:
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
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    if PREFETCH_LINES > 0:  # this program's share of the first w2_lines 128-byte lines of its expert's w2, into L2
        line = tl.program_id(0) * PREFETCH_LINES + tl.arange(0, PREFETCH_LINES)
        ok = (line < w2_lines) & (expert >= 0)
        prefetch_l2(tl.where(ok, w2_ptr + tl.maximum(expert, 0) * stride_w2e + line.to(tl.int64) * LINE_ELEMS, w2_ptr))
    tl.store(act_ptr + pair * inter + n, (silu * up).to(dtype), mask=n_ok)


@triton.jit
def _down_sum_kernel(act_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, hidden, stride_we, stride_wn, stride_out, first,
                     local, TOP_K: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_enter(PDL)
    # out[token, n] = sum over k of weights[pair] * (act[pair] . w2[e, n]), e = ids[pair] - first (-1 outside
    # [0, local)), pair = token * TOP_K + k, for the BLOCK_N columns n of program_id(0); act [pairs, K] contiguous.
    # Pairs of id -1 load nothing and add nothing.
    token = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = n < hidden
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64) - first
        expert = tl.where((expert >= 0) & (expert < local), expert, -1)
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
        weight = tl.load(weights_ptr + pair).to(tl.float32)  # finite, and down is zero for an id of -1
        total += (down * weight).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_out + n, total.to(dtype), mask=n_ok)


def decode_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   tiles: DecodeTiles | None = None) -> torch.Tensor:
    """x [tokens, hidden], w13 [experts, 2 x inter, hidden], w2 [experts, hidden, inter] (x's dtype, unit last
    stride), routing weights [tokens, top_k] (x's dtype or float32) and expert ids [tokens, top_k] (-1: another
    rank's) -> [tokens, hidden] in x's dtype: kernels.moe.fused_experts' result in two launches (module docstring).
    `tiles` overrides DecodeTiles() (INTERPRETER_TILES in the interpreter) for tuning. Meant for use_decode_path's
    token counts; any count is computed."""
    _check(x, w13, w2, weights.shape == ids.shape, f"weights {tuple(weights.shape)}, ids {tuple(ids.shape)}")
    return _launch(x, w13, w2, weights.contiguous(), ids.contiguous(), tiles)


def decode_routed_experts(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                          renormalize: bool, weight_dtype: torch.dtype | None, first: int = 0,
                          tiles: DecodeTiles | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """decode_experts with the routing folded into its first launch: from the router's logits [tokens, E] every
    gate/up program routes its token itself (kernels.moe.route's softmax, top-k and renormalization; no launch of its
    own on the step's chain). w13 and w2 hold this rank's experts, global ids first .. first + len(w13) - 1 (expert
    parallelism; others add nothing). -> (the output, the routing weights [tokens, top_k] in `weight_dtype` (None:
    float32), the global expert ids [tokens, top_k] int64)."""
    tokens = x.shape[0]
    _check(x, w13, w2, logits.dim() == 2 and logits.shape[0] == tokens and top_k <= logits.shape[1],
           f"logits {tuple(logits.shape)}, top_k {top_k}")
    weights = torch.empty((tokens, top_k), dtype=weight_dtype or torch.float32, device=x.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=x.device)
    out = _launch(x, w13, w2, weights, ids, tiles, (logits if logits.stride(1) == 1 else logits.contiguous(),
                                                    renormalize, first))
    return out, weights, ids


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing_ok: bool, routing: str) -> None:
    experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if (x.dim() != 2 or x.shape[1] != hidden or w2.shape != (experts, hidden, inter) or not routing_ok
            or two_inter % 2 or w13.dtype != x.dtype or w2.dtype != x.dtype):
        raise ValueError(f"decode_experts takes x [tokens, hidden], w13 [experts, 2 x inter, hidden], w2 [experts, "
                         f"hidden, inter] of x's dtype and weights, ids [tokens, top_k] (or router logits [tokens, "
                         f"experts]); got x {tuple(x.shape)} {x.dtype}, w13 {tuple(w13.shape)} {w13.dtype}, w2 "
                         f"{tuple(w2.shape)} {w2.dtype}, {routing}")


def _launch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            tiles: DecodeTiles | None, routed: tuple | None = None) -> torch.Tensor:
    """The two launches; `routed`: (logits, renormalize, first), and `weights`, `ids` are written by the first."""
    tokens, top_k = ids.shape
    experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    t = tiles or (INTERPRETER_TILES if interpreting() else DecodeTiles())
    x, w13, w2 = (a if a.stride(-1) == 1 else a.contiguous() for a in (x, w13, w2))
    if routed is None:
        logits, renormalize, first, blocks = x, False, 0, {"KB": 1, "EB": 1, "CHUNK": 1}
    else:
        logits, renormalize, first = routed
        blocks = route_blocks(top_k, logits.shape[1])
    act = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)  # [pairs, inter]
    up_programs = triton.cdiv(inter, t.up_block_n)
    line = LINE_BYTES // w2.element_size()
    w2_lines = _prefetch_lines(w2, tokens * top_k)
    _gate_up_kernel[(up_programs, tokens * top_k)](
        x, w13, ids, act, inter, x.stride(0), w13.stride(0), w13.stride(1), logits, weights, logits.shape[1],
        logits.stride(0), first, experts, w2, w2.stride(0), w2_lines, TOP_K=top_k, K=hidden, BLOCK_N=t.up_block_n,
        BLOCK_K=min(t.up_block_k, triton.next_power_of_2(hidden)), ROUTED=routed is not None, RENORM=renormalize,
        **blocks, PREFETCH_LINES=triton.next_power_of_2(triton.cdiv(w2_lines, up_programs)) if w2_lines else 0,
        LINE_ELEMS=line, num_warps=t.up_warps, num_stages=1, **pdl_options(x))
    _down_sum_kernel[(triton.cdiv(hidden, t.down_block_n), tokens)](
        act, w2, ids, weights, out, hidden, w2.stride(0), w2.stride(1), out.stride(0), first, experts, TOP_K=top_k,
        K=inter, BLOCK_N=t.down_block_n, BLOCK_K=min(t.down_block_k, triton.next_power_of_2(inter)),
        num_warps=t.down_warps, num_stages=1, **pdl_options(x))
    return out


def _prefetch_lines(w2: torch.Tensor, pairs: int) -> int:
    """How many 128-byte lines of each pair's w2 the gate/up launch pulls into L2 (PREFETCH_DOWN_BYTES in all); 0
    in the interpreter, off CUDA, or where an expert's w2 is not one contiguous block."""
    if interpreting() or not w2.is_cuda or not PREFETCH_DOWN_BYTES or not w2[0].is_contiguous():
        return 0
    per_expert = w2[0].numel() * w2.element_size()
    return min(per_expert, PREFETCH_DOWN_BYTES // pairs) // LINE_BYTES


def decode_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                             ids: torch.Tensor) -> torch.Tensor:
    """The twin of `decode_experts`, pair by pair in batched torch operations: each product in float32 rounded once
    to x's dtype, SiLU-and-mul as kernels.activation's twin, the weighted rows rounded, summed over k in float32 and
    rounded once."""
    tokens, top_k = ids.shape
    here = (ids >= 0).flatten()
    experts = ids.clamp(min=0).flatten()  # [pairs]
    xs = x.repeat_interleave(top_k, dim=0).float()  # [pairs, hidden]
    gate_up = torch.bmm(w13[experts].float(), xs[:, :, None])[:, :, 0].to(x.dtype)  # [pairs, 2 x inter]
    act = silu_and_mul_reference(gate_up)
    down = torch.bmm(w2[experts].float(), act.float()[:, :, None])[:, :, 0].to(x.dtype)  # [pairs, hidden]
    weighted = (down.float() * weights.flatten().float()[:, None]).to(x.dtype)
    weighted = torch.where(here[:, None], weighted, torch.zeros_like(weighted))
    return weighted.view(tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)


def decode_routed_experts_reference(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                                    top_k: int, renormalize: bool, weight_dtype: torch.dtype | None, first: int = 0
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The twin of `decode_routed_experts`: kernels.moe.route_reference, the ids outside this rank's experts -1, then
    decode_experts_reference."""
    weights, ids = route_reference(logits, top_k, renormalize, weight_dtype)
    local = ids - first
    local = torch.where((local >= 0) & (local < w13.shape[0]), local, -1)
    return decode_experts_reference(x, w13, w2, weights, local), weights, ids
