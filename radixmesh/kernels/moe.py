"""Mixture-of-experts MLP in two grouped-GEMM launches, and its plain-torch twin.

Each token goes to `top_k` experts; a (token, k) pair is a "slot" (slot = token * top_k + k). `align_by_expert`
groups the slots by expert and pads each expert's group to a multiple of BLOCK_M, so one program's rows all use one
expert's weights; one launch (its twin `align_by_expert_reference` is the same in torch operations). It makes no host
round trip: the buffers have their worst-case size (every expert's last block padded), which keeps the shapes fixed
for CUDA graphs.

Tile sizes come from kernels/configs/moe-<GPU>.json, tuned per layer shape and token count on that GPU
(benchmarks.tune_moe), else defaults. `fused_experts` then runs gate/up for every slot ([slots, 2 x intermediate]), SiLU-and-mul, and down with the
routing weight applied ([slots, hidden]), and sums each token's top_k rows. Rounding follows the twin: each product
accumulates in float32 and is rounded to the activations' dtype once, as a dense `linear` is; the routing weight
multiplies the rounded down-projection; the top_k rows are summed in float32 and rounded once (the twin adds them
one expert at a time in the dtype, so in bfloat16 the two may differ by an ulp)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from radixmesh.kernels.moe_activation import add_weighted_bias, biased_activation
from radixmesh.kernels.moe_extras import ExpertExtras, clamped, clamped_swiglu, expert_rows
from radixmesh.kernels.runtime import CONFIG_DIR, config_file, dot_needs_upcast, interpreting, pdl_enter, pdl_options

BLOCK_M = 16


@triton.jit
def pick_top_k(key, value, cols, TOP_K: tl.constexpr, KB: tl.constexpr, EB: tl.constexpr, SAME: tl.constexpr):
    """The TOP_K largest entries of `key` [EB] (float32; largest first, the lowest column first among equals):
    (`value` at each [KB] float32, its column [KB] int64), the slots past TOP_K zeros. SAME: `value` is `key` (its
    maximum is the value; no gather). TOP_K rounds of max and argmax."""
    ks = tl.arange(0, KB)
    top_w = tl.zeros((KB,), tl.float32)
    top_i = tl.zeros((KB,), tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.max(key, 0)
        pick = tl.min(tl.where(key == best, cols, EB), 0)
        if SAME:
            got = best
        else:
            got = tl.sum(tl.where(cols == pick, value, 0.0), 0)
        top_w = tl.where(ks == k, got, top_w)
        top_i = tl.where(ks == k, pick.to(tl.int64), top_i)
        key = tl.where(cols == pick, float("-inf"), key)
    return top_w, top_i


@triton.jit
def top_k_probs(logits, cols, E, TOP_K: tl.constexpr, KB: tl.constexpr, EB: tl.constexpr, RENORM: tl.constexpr):
    """Router logits [EB] (float32, -inf past E) -> (the TOP_K largest softmax probabilities [KB], largest first, the
    lowest expert id first among equals; their expert ids [KB] int64), renormalized to sum to one when RENORM; the
    slots past TOP_K hold zeros. TOP_K rounds of max and argmax: in one warp, warp shuffles with no barrier between
    warps. (Each expert's place counted against all the others at once, an [EB, EB] comparison over four warps, took
    5.8 us a route against 3.0 on an H100 inside the Qwen3-30B-A3B step: benchmarks/results/NOTES.md, 2026-12-06.)"""
    ok = cols < E
    e = tl.exp(logits - tl.max(logits, 0))
    p = tl.where(ok, e / tl.sum(e, 0), -1.0)
    top_w, top_i = pick_top_k(p, p, cols, TOP_K, KB, EB, True)
    if RENORM:
        top_w = top_w / tl.sum(top_w, 0)
    return top_w, top_i


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride, TOP_K: tl.constexpr, KB: tl.constexpr,
                  EB: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr):
    # One token (program_id 0): softmax over its E router logits in float32, the TOP_K largest (the lowest expert id
    # first among equals), renormalized to sum to one when RENORM, stored in the weights' dtype. Under PDL it launches
    # while the router's product runs and waits for it (at batch 1 the launch was ~3.7 us of a 62-us layer on an
    # H100 without: benchmarks/results/NOTES.md, 2026-12-06). One warp for up to 256 experts (route_warps).
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, EB)
    x = tl.load(logits_ptr + row * stride + cols, mask=cols < E, other=float("-inf")).to(tl.float32)
    top_w, top_i = top_k_probs(x, cols, E, TOP_K, KB, EB, RENORM)
    ks = tl.arange(0, KB)
    keep = ks < TOP_K
    tl.store(weights_ptr + row * TOP_K + ks, top_w.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + row * TOP_K + ks, top_i, mask=keep)


def route(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype | None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [tokens, experts] -> (weights [tokens, top_k] in `dtype`, float32 when None; expert ids
    [tokens, top_k] int64), in one launch: `route_reference`'s softmax, top-k and renormalization."""
    if not (logits.is_cuda or interpreting()):  # no Triton here: the twin
        return route_reference(logits, top_k, renormalize, dtype)
    tokens, experts = logits.shape
    weights = torch.empty((tokens, top_k), dtype=dtype or torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](logits, weights, ids, experts, logits.stride(0), TOP_K=top_k,
                                 KB=triton.next_power_of_2(top_k), EB=triton.next_power_of_2(experts),
                                 RENORM=renormalize, num_warps=route_warps(experts), **pdl_options(logits))
    return weights, ids


def route_warps(experts: int) -> int:
    """Warps for routing a token among `experts` (top_k_probs): one up to 256 experts, its reductions then warp
    shuffles with no barrier between warps."""
    return 1 if experts <= 256 else 4


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [tokens, experts] -> (weights [tokens, top_k], expert ids [tokens, top_k]), as transformers
    routes: softmax in float32, the top-k, renormalized to sum to one when asked, the weights cast to `dtype` (the
    Qwen models) or left float32 when it is None (Mixtral weighs in float32)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if dtype is None else weights.to(dtype)), ids


@triton.jit
def grouped_top_k(x, bias, cols, E, scale, norm_min, TOP_K: tl.constexpr, KB: tl.constexpr, EB: tl.constexpr,
                  GROUPS: tl.constexpr, GB: tl.constexpr, GROUP_SIZE: tl.constexpr, TOP_GROUPS: tl.constexpr,
                  GROUP_BEST: tl.constexpr, RENORM: tl.constexpr, SOFTMAX: tl.constexpr, CLAMP: tl.constexpr):
    """route_grouped_reference's rule for one token's router logits `x` [EB] (float32; any value past E) and the
    correction `bias` [EB] (float32, zeros past E): sigmoid (or SOFTMAX) scores; the choice adds the bias; with
    GROUPS > 1 only the experts of the TOP_GROUPS groups whose best choice (GROUP_BEST 1) or two best choices (2) sum
    highest compete; the TOP_K best choices (the lowest expert id first among equals) weigh their scores (not the
    choices), renormalized when RENORM (by sum + 1e-20, or with CLAMP by max(sum, norm_min)), times `scale`.
    Returns (weights [KB] float32, expert ids [KB] int64), zeros past TOP_K."""
    ok = cols < E
    if SOFTMAX:
        x = tl.where(ok, x, float("-inf"))
        e = tl.exp(x - tl.max(x, 0))
        scores = e / tl.sum(e, 0)
    else:
        scores = 1.0 / (1.0 + tl.exp(-tl.where(ok, x, 0.0)))
    choice = tl.where(ok, scores + bias, float("-inf"))
    if GROUPS > 1:
        group = cols // GROUP_SIZE
        gs = tl.arange(0, GB)
        group_score = tl.full((GB,), float("-inf"), tl.float32)  # (past GROUPS: never picked)
        for g in tl.static_range(GROUPS):
            mine = tl.where(group == g, choice, float("-inf"))
            best = tl.max(mine, 0)
            if GROUP_BEST == 2:
                first = tl.min(tl.where(mine == best, cols, EB), 0)
                best += tl.max(tl.where(cols == first, float("-inf"), mine), 0)
            group_score = tl.where(gs == g, best, group_score)
        keep = cols < 0  # no group chosen yet
        for _ in tl.static_range(TOP_GROUPS):
            best = tl.max(group_score, 0)
            pick = tl.min(tl.where(group_score == best, gs, GB), 0)
            keep = keep | (group == pick)
            group_score = tl.where(gs == pick, float("-inf"), group_score)
        choice = tl.where(keep, choice, float("-inf"))
    top_w, top_i = pick_top_k(choice, scores, cols, TOP_K, KB, EB, False)
    if RENORM:
        if CLAMP:
            top_w = top_w / tl.maximum(tl.sum(top_w, 0), norm_min)
        else:
            top_w = top_w / (tl.sum(top_w, 0) + 1e-20)
    return top_w * scale, top_i


@triton.jit
def _route_grouped_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, E, stride, scale, norm_min,
                          TOP_K: tl.constexpr, KB: tl.constexpr, EB: tl.constexpr, GROUPS: tl.constexpr,
                          GB: tl.constexpr, GROUP_SIZE: tl.constexpr, TOP_GROUPS: tl.constexpr,
                          GROUP_BEST: tl.constexpr, RENORM: tl.constexpr, SOFTMAX: tl.constexpr, CLAMP: tl.constexpr,
                          PDL: tl.constexpr):
    # One token (program_id 0): grouped_top_k over its router logits.
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, EB)
    ok = cols < E
    x = tl.load(logits_ptr + row * stride + cols, mask=ok, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    top_w, top_i = grouped_top_k(x, bias, cols, E, scale, norm_min, TOP_K, KB, EB, GROUPS, GB, GROUP_SIZE,
                                 TOP_GROUPS, GROUP_BEST, RENORM, SOFTMAX, CLAMP)
    ks = tl.arange(0, KB)
    keep_k = ks < TOP_K
    tl.store(weights_ptr + row * TOP_K + ks, top_w.to(weights_ptr.dtype.element_ty), mask=keep_k)
    tl.store(ids_ptr + row * TOP_K + ks, top_i, mask=keep_k)


def route_grouped(logits: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int, top_groups: int,
                  renormalize: bool, scale: float, softmax: bool = False, norm_min: float = 0.0, group_best: int = 2
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """route_grouped_reference in one launch (float32 weights [tokens, top_k], int64 ids)."""
    if not (logits.is_cuda or interpreting()):
        return route_grouped_reference(logits, bias, top_k, groups, top_groups, renormalize, scale, softmax, norm_min,
                                       group_best)
    tokens, experts = logits.shape
    check_grouping(experts, top_k, groups, top_groups, group_best)
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    if tokens:
        _route_grouped_kernel[(tokens,)](logits, bias, weights, ids, experts, logits.stride(0), float(scale),
                                         float(norm_min),
                                         TOP_K=top_k, KB=triton.next_power_of_2(top_k),
                                         EB=triton.next_power_of_2(experts), GROUPS=groups,
                                         GB=triton.next_power_of_2(groups), GROUP_SIZE=experts // groups,
                                         TOP_GROUPS=top_groups, GROUP_BEST=group_best, RENORM=renormalize,
                                         SOFTMAX=softmax,
                                         CLAMP=norm_min > 0, num_warps=route_warps(experts), **pdl_options(logits))
    return weights, ids


def check_grouping(experts: int, top_k: int, groups: int, top_groups: int, group_best: int = 2) -> None:
    """ValueError unless `experts` split into `groups` equal groups of at least `group_best` (1 or 2: a group's score
    is its best choice or its two best), `top_groups` of them can hold `top_k` experts, and top_k <= experts."""
    if group_best not in (1, 2):
        raise ValueError(f"a group scores its best choice or its two best, not {group_best}")
    if groups < 1 or experts % groups or (groups > 1 and experts // groups < group_best) \
            or not 1 <= top_groups <= groups or not 1 <= top_k <= top_groups * (experts // groups):
        size = "two experts or more" if group_best == 2 else "one expert or more"
        raise ValueError(f"group-limited routing of {experts} experts in n_group={groups} groups, the best "
                         f"topk_group={top_groups} of them, top {top_k} experts a token: the groups must be equal, "
                         f"hold {size} each, and the chosen groups at least num_experts_per_tok experts")


def route_grouped_reference(logits: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int, top_groups: int,
                            renormalize: bool, scale: float, softmax: bool = False, norm_min: float = 0.0,
                            group_best: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [tokens, experts] -> (float32 weights, int64 expert ids) [tokens, top_k], as transformers routes
    GLM-4.5 (and DeepSeek-V3's noaux_tc): sigmoid scores in float32 (ERNIE 4.5: `softmax` scores); each expert's
    choice is its score plus the correction `bias` [experts]; with `groups` > 1 the experts split into equal groups, a
    group's score is the sum of its `group_best` best choices (DeepSeek-V2's group_limited_greedy: its best one),
    and only the `top_groups` best groups' experts compete; the
    `top_k` best choices are picked, weighted by their scores (without the bias), renormalized to sum to one when
    asked (over sum + 1e-20, or, with `norm_min` > 0, over max(sum, norm_min) as ERNIE does), times `scale`
    (routed_scaling_factor)."""
    experts = logits.shape[-1]
    check_grouping(experts, top_k, groups, top_groups, group_best)
    scores = torch.softmax(logits.float(), dim=-1) if softmax else logits.float().sigmoid()
    choice = scores + bias.float()
    if groups > 1:
        grouped = choice.view(-1, groups, experts // groups)
        best = grouped.topk(group_best, dim=-1).values.sum(dim=-1)  # [tokens, groups]
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(top_groups, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(experts // groups, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total.clamp(min=norm_min) if norm_min > 0 else total + 1e-20)
    return weights * scale, ids


def _capacity(n: int, num_experts: int, block_m: int) -> int:
    """Slots of the aligned buffer: every group (the experts', and one for other ranks' experts) padded to block_m."""
    return triton.cdiv(n + (num_experts + 1) * (block_m - 1), block_m) * block_m


@triton.jit
def _align_kernel(ids_ptr, n, slots_ptr, block_experts_ptr, scratch_ptr, num_blocks,
                  E: tl.constexpr, BM: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr,
                  BCHUNK: tl.constexpr):
    # One program. Bin e < E counts expert e's slots, bin E the slots of other ranks' experts (id -1). Each group
    # starts at a multiple of BM; a slot's place in its group comes from an atomic cursor (scratch[BINS:]), so the
    # order within a group is arbitrary: every row of a grouped GEMM is computed alone, so outputs do not depend on
    # it.
    bins = tl.arange(0, BINS)
    counts = tl.zeros((BINS,), tl.int32)
    for c in range(0, n, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        ok = offs < n
        e = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
        counts += tl.histogram(tl.where(e < 0, E, e), BINS, mask=ok)
    padded = (counts + BM - 1) // BM * BM
    ends = tl.cumsum(padded, 0)
    tl.store(scratch_ptr + bins, ends - padded)
    tl.store(scratch_ptr + BINS + bins, tl.zeros((BINS,), tl.int32))
    for c in range(0, num_blocks * BM, CHUNK):  # every slot the sentinel n until placed
        offs = c + tl.arange(0, CHUNK)
        tl.store(slots_ptr + offs, n.to(tl.int64), mask=offs < num_blocks * BM)
    tl.debug_barrier()
    for c in range(0, n, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        ok = offs < n
        e = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
        e = tl.where(e < 0, E, e)
        rank = tl.atomic_add(scratch_ptr + BINS + e, 1, mask=ok)
        start = tl.load(scratch_ptr + e, mask=ok, other=0)
        tl.store(slots_ptr + start + rank, offs.to(tl.int64), mask=ok)
    for b0 in range(0, num_blocks, BCHUNK):  # a block's group: how many groups end at or before its first slot
        blocks = b0 + tl.arange(0, BCHUNK)
        group = tl.sum((ends[None, :] <= (blocks * BM)[:, None]).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + blocks, tl.where(group < E, group, -1).to(tl.int64), mask=blocks < num_blocks)


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [tokens, top_k] -> (slots [capacity] grouped by expert, each group padded to block_m with the sentinel
    tokens * top_k; the expert of each block [capacity / block_m], -1 for blocks no expert of this rank runs). An id
    of -1 (an expert another rank holds) gets a group of its own, after the others, that no block runs. One launch
    (the twin takes about twenty: at batch 1 they cost more than the experts' GEMMs)."""
    if not (ids.is_cuda or interpreting()):  # no Triton here: the twin
        return align_by_expert_reference(ids, num_experts, block_m)
    flat = ids.flatten().contiguous()
    n = flat.numel()
    capacity = _capacity(n, num_experts, block_m)
    slots = torch.empty(capacity, dtype=torch.int64, device=ids.device)
    block_experts = torch.empty(capacity // block_m, dtype=torch.int64, device=ids.device)
    bins = triton.next_power_of_2(num_experts + 1)
    scratch = torch.empty(2 * bins, dtype=torch.int32, device=ids.device)
    _align_kernel[(1,)](flat, n, slots, block_experts, scratch, capacity // block_m, E=num_experts, BM=block_m,
                        BINS=bins, CHUNK=1024, BCHUNK=max(1, 4096 // bins))
    return slots, block_experts


def align_by_expert_reference(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of `align_by_expert`, in torch operations (about twenty launches), slots in slot order within an
    expert."""
    flat = ids.flatten().to(torch.int64)
    flat = torch.where(flat >= 0, flat, num_experts)
    n = flat.numel()
    capacity = _capacity(n, num_experts, block_m)
    # scatter_add, not bincount: bincount sizes its output from the largest id, a read back to the host that a
    # CUDA graph cannot hold
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)  # slots by expert, in slot order within one
    experts = flat[order]
    rank = torch.arange(n, device=ids.device) - (torch.cumsum(counts, 0) - counts)[experts]
    slots = torch.full((capacity,), n, dtype=torch.int64, device=ids.device)
    slots[starts[experts] + rank] = order
    block_starts = torch.arange(0, capacity, block_m, device=ids.device)
    block_experts = torch.searchsorted(ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return slots, block_experts



@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, slots_ptr, block_experts_ptr, weights_ptr, n_slots, N, K,
                         a_row_div, stride_a, stride_we, stride_wn, stride_out,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         WEIGHTED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # out[slot, n] = sum_k a[slot // a_row_div, k] * w[expert, n, k] (x routing weight of the slot when WEIGHTED),
    # for the BLOCK_M slots of block program_id(0), all of one expert; grid (blocks, cdiv(N, BLOCK_N)).
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = tl.load(slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    valid = rows < n_slots
    a_rows = tl.where(valid, rows // a_row_div, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if UPCAST:  # the interpreter's bfloat16 dot is wrong (kernels.runtime.dot_needs_upcast)
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=PRECISION)
    dtype = out_ptr.dtype.element_ty
    out = acc.to(dtype)
    if WEIGHTED:
        weight = tl.load(weights_ptr + rows, mask=valid, other=0.0)
        out = (out.to(tl.float32) * weight.to(tl.float32)[:, None]).to(dtype)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out, mask=valid[:, None] & col_ok[None, :])


class Tiles(NamedTuple):
    """One grouped GEMM's launch: the tile (BLOCK_M is shared by both GEMMs of a forward and the alignment), warps
    and pipeline stages."""

    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2


def config_path(device: str, folder: Path | str = CONFIG_DIR) -> Path:
    """Where the tuned tiles of a GPU (torch.cuda.get_device_name) live."""
    return config_file("moe", device, folder)


@functools.cache
def _tuned(device: str) -> dict:
    """The tuned entries for a device (written by benchmarks.tune_moe): {layer shape: {token count: {"block_m",
    "up": Tiles fields, "down": Tiles fields}}}; {} when none was tuned."""
    path = config_path(device)
    return json.loads(path.read_text())["shapes"] if path.exists() else {}


def tiles(x: torch.Tensor, w13: torch.Tensor, tokens: int, top_k: int = 1) -> tuple[int, Tiles, Tiles]:
    """(BLOCK_M, the gate/up GEMM's tiles, the down GEMM's) for `tokens` tokens (`top_k` slots each) through experts
    shaped like w13 ([experts, 2 x intermediate, hidden]): the entry tuned for this GPU at the nearest token count at
    or above `tokens` (the largest tuned, past them all), else `default_tiles`."""
    return tuned_tiles(x, w13, tokens) or default_tiles(tokens * top_k / w13.shape[0])


def tuned_tiles(x: torch.Tensor, w13: torch.Tensor, tokens: int) -> tuple[int, Tiles, Tiles] | None:
    """`tiles`' tuned entry for this GPU, None where the shape was tuned nowhere."""
    shape = _tuned(torch.cuda.get_device_name(x.device)).get(layer_key(*w13.shape)) if x.is_cuda else None
    return pick(shape, tokens) if shape else None


def default_tiles(slots_per_expert: float) -> tuple[int, Tiles, Tiles]:
    """A shape tuned nowhere (GPT-OSS's, DeepSeek's, ...): by the slots an expert gets on average, what the tuner chose
    for Qwen3-30B-A3B's layer on both the H100 and the H200 at like counts (128 a expert at 2,048 tokens: 64-row
    blocks of 128 x 64 tiles in 3 stages; 16 at 256 tokens: 32-row blocks of 128 x 128); a few slots an expert keep
    16-row blocks of 64 x 64 tiles. (16-row blocks for every size left an 8k prefill of gpt-oss-20b's shape at 17% of
    the matmul peak on an H100, the twenty-eighth session's first GPU run.)"""
    if slots_per_expert >= 64:
        return 64, Tiles(128, 64, 4, 3), Tiles(128, 64, 4, 3)
    if slots_per_expert >= 16:
        return 32, Tiles(128, 128, 4, 3), Tiles(128, 128, 4, 3)
    return BLOCK_M, Tiles(), Tiles()


def pick(entries: dict, tokens: int) -> tuple[int, Tiles, Tiles]:
    """The entry of `entries` ({token count: entry}) tuned at the nearest count at or above `tokens`, else the
    largest."""
    counts = sorted(int(t) for t in entries)
    entry = entries[str(next((t for t in counts if t >= tokens), counts[-1]))]
    return entry["block_m"], Tiles(**entry["up"]), Tiles(**entry["down"])


def layer_key(experts: int, two_inter: int, hidden: int) -> str:
    return f"experts={experts},intermediate={two_inter // 2},hidden={hidden}"


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, slots: torch.Tensor, block_experts: torch.Tensor,
                  n_slots: int, a_row_div: int, weights: torch.Tensor | None, zeroed: bool = False,
                  block_m: int = BLOCK_M, t: Tiles = Tiles()) -> torch.Tensor:
    """[n_slots, N]: each slot's row of `a` (slot // a_row_div) times its expert's w [N, K] transposed (rows of
    slots no block runs: zero when `zeroed`, else unset). `slots` aligned to `block_m`."""
    n, k = w.shape[1], w.shape[2]
    out = (torch.zeros if zeroed else torch.empty)((n_slots, n), dtype=a.dtype, device=a.device)
    block_n = min(t.block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(t.block_k, max(16, triton.next_power_of_2(k)))
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](a, w, out, slots, block_experts, weights if weights is not None else a, n_slots, n, k,
                               a_row_div, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, WEIGHTED=weights is not None,
                               UPCAST=dot_needs_upcast(a.dtype),
                               PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
                               num_warps=t.num_warps, num_stages=t.num_stages)
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, elsewhere: bool = True, decode_path: bool | None = None,
                  extras: ExpertExtras | None = None) -> torch.Tensor:
    """x [tokens, hidden], w13 [experts, 2 x inter, hidden], w2 [experts, hidden, inter], routing weights and
    expert ids [tokens, top_k] -> [tokens, hidden]: sum over k of weights * down(silu(gate) * up) of expert ids.
    `elsewhere`: ids may be -1 (experts of other ranks); False saves zeroing rows that every expert writes.
    A few tokens (kernels.moe_decode.use_decode_path) run kernels.moe_decode's two gemv-shaped launches instead of the
    alignment and grouped GEMMs; `decode_path` True or False forces the choice (tests, benchmarks). `extras`
    (biases, the clamped SwiGLU: kernels.moe_extras.ExpertExtras) add the biases to the grouped GEMMs' results and
    run the activation between them in torch; the few-token launches compute both in their own kernels."""
    from radixmesh.kernels.moe_decode import decode_experts, use_decode_path

    tokens, top_k = ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    if use_decode_path(tokens, top_k, w13.shape[0]) if decode_path is None else decode_path:
        return decode_experts(x, w13, w2, weights, ids, extras=extras)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    layer = tiles(x, w13, tokens, top_k)
    return grouped_experts(x, weights, ids, w13.shape[0], layer,
                           lambda a, second, *launch: _grouped_gemm(a, w2 if second else w13, *launch), elsewhere,
                           extras)


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
                    layer: tuple[int, Tiles, Tiles], product, elsewhere: bool = True,
                    extras: ExpertExtras | None = None) -> torch.Tensor:
    """The grouped path around its two products, whatever holds the experts (16-bit here, kernels.moe_fp8, kernels.
    moe_mxfp4): the slots aligned by expert in blocks of `layer`'s BLOCK_M, `product(a, second, slots, block_experts,
    n_slots, a_row_div, weights, zeroed, block_m, tiles)` for gate/up (second False) and down (True), the activation
    between them (with `extras`' gate/up bias and clamped SwiGLU in one launch), the weighted down bias, the top-k
    sum in float32."""
    from radixmesh.kernels.activation import silu_and_mul

    tokens, top_k = ids.shape
    block_m, up, down_tiles = layer
    slots, block_experts = align_by_expert(ids, num_experts, block_m)
    n_slots = tokens * top_k
    # rows of other ranks' experts (ids of -1) stay zero: no garbage through SiLU, nothing in the sum
    gate_up = product(x, False, slots, block_experts, n_slots, top_k, None, elsewhere, block_m, up)
    if clamped(extras):  # the gate/up bias and the clamped SwiGLU in one launch
        act = biased_activation(gate_up, ids, extras)
    else:
        if extras is not None and extras.b13 is not None:
            gate_up += expert_rows(extras.b13, ids).to(gate_up.dtype)
        act = silu_and_mul(gate_up)
    flat_weights = weights.flatten().contiguous()
    down = product(act, True, slots, block_experts, n_slots, 1, flat_weights, elsewhere, block_m, down_tiles)
    if extras is not None and extras.b2 is not None:  # sum_k w_k (act W2 + b2): the weighted biases added apart
        add_weighted_bias(down, ids, flat_weights, extras.b2)
    return down.view(tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)


def fused_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                            ids: torch.Tensor, extras: ExpertExtras | None = None) -> torch.Tensor:
    """The twin: each expert once, on the tokens routed to it (in token order, as transformers does), its weighted
    output added into the token's row in x's dtype. Slots whose id is -1 (an expert of another rank) add nothing.
    `extras`: each product's bias added to it, and the clamped SwiGLU in place of SiLU-and-mul."""
    out = torch.zeros_like(x)
    hit = torch.zeros(w13.shape[0], dtype=torch.bool, device=x.device)
    flat = ids.flatten()
    hit[flat[flat >= 0]] = True
    for e in hit.nonzero().flatten().tolist():
        token, slot = torch.where(ids == e)
        b13, b2 = (None, None) if extras is None else (_row(extras.b13, e), _row(extras.b2, e))
        gate_up = F.linear(x[token], w13[e], b13)
        if clamped(extras):
            h = clamped_swiglu(gate_up, extras)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = F.silu(gate) * up
        out.index_add_(0, token, (F.linear(h, w2[e], b2) * weights[token, slot, None]).to(out.dtype))
    return out


def _row(bias: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if bias is None else bias[e]
