"""A sparse layer's gate at one token in one launch: the residual add and RMSNorm before the layer's MLP, the
router's product and the top-k routing (kernels.norm.fused_add_rmsnorm, kernels.gemv.gemv_row and kernels.moe.route
fused), and its plain-torch twin.

At batch 1 each of those three is a link of the decode step's chain of kernels that moves no weight worth the name
(an H100 profile of the Qwen3-30B-A3B shape: norm 1.4, router 1.8, routing 3.0 us of a ~61-us layer;
benchmarks/results/NOTES.md, 2026-12-06). Here each program owns BLOCK_N router rows: it loads them before its PDL
wait (weights: nothing earlier writes them), then adds the residual and norms the whole hidden row itself (a few KB
from L2, what the norm kernel would have read; every program the same bits, program 0 stores them), and stores its
rows' logits. The programs then count themselves in on an arrival counter; the last to arrive routes the token from
all the logits (kernels.moe.top_k_probs) and sets the counter back to zero for the next launch, so a CUDA graph
replays it as captured. The routing is paid once, by one program, not by every program of a wide launch (the
lesson of routing folded into the experts' gate/up launch, NOTES 2026-12-06). Measured on an H100 in that step: the
three links' 5.05 us became 4.09 (and o_proj before it 0.6 us longer), the step 2.916 -> 2.880 ms: under PDL a kernel
boundary costs little, and the fused kernel keeps most of the three's chain of dependent memory round trips.

Numerics are the three kernels': the residual sum and the normed row rounded as kernels.norm rounds them, float32 dot
products rounded once to the logits' dtype, then kernels.moe's routing over those rounded logits.

GPT-OSS's router has a bias (`router_bias`): added to each logit in float32 before its rounding, as kernels.gemv's
products add theirs (cuBLAS's epilogue).

`moe_gate_grouped` is the same launch for the blocks whose experts are chosen by score plus a correction bias
(DeepSeek-V2/V3, GLM-4.5, dots.llm1, Kimi K2: engine.models.moe.BiasRoutedMoeBlock), whose router is held in float32:
the logits stay float32 (as `F.linear(x.float(), router)` leaves them) and the last program routes them by
kernels.moe.grouped_top_k (route_grouped's rule). Unfused, that gate is four launches a layer at one token, two of them
torch's (the cast to float32 and cuBLAS's float32 product, ~5-7 us each in DeepSeek-V2-Lite's batch-1 profile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels.moe import (check_grouping, grouped_top_k, route_grouped_reference, route_reference,
                                   route_warps, top_k_probs)
from radixmesh.kernels.norm import fused_add_rmsnorm_reference
from radixmesh.kernels.runtime import pdl_on

BLOCK_N = 2  # router rows a program: 64 programs for 128 experts (gemv_row's one-row tiles)


@triton.jit
def _gate_kernel(H, R, G, W, Bias, ResOut, XOut, Logits, Weights, Ids, Counter, E, eps, scale, norm_min,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, TOP_K: tl.constexpr, KB: tl.constexpr,
                 EB: tl.constexpr, RENORM: tl.constexpr, GROUPED: tl.constexpr, GROUPS: tl.constexpr,
                 GB: tl.constexpr, GROUP_SIZE: tl.constexpr, TOP_GROUPS: tl.constexpr, GROUP_BEST: tl.constexpr,
                 SOFTMAX: tl.constexpr, CLAMP: tl.constexpr, PDL: tl.constexpr, RouterBias=None,
                 ROUTER_BIAS: tl.constexpr = False):
    # GROUPED: the last program routes by kernels.moe.grouped_top_k (Bias, scale, norm_min and the group constexprs
    # are its); else by top_k_probs (softmax, RENORM). ROUTER_BIAS: the router's own bias (GPT-OSS), added to each
    # logit in float32 before its rounding
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < E
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # the router's rows and the norm's weight: no kernel writes them, so they load while the kernel before ends
    w = tl.load(W + n.to(tl.int64)[:, None] * D + d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0,
                eviction_policy="evict_first")  # [BLOCK_N, BLOCK_D]
    g = tl.load(G + d, mask=d_mask, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()  # the hidden row is the kernel before's output
    dtype = H.dtype.element_ty
    h = tl.load(H + d, mask=d_mask, other=0.0).to(tl.float32)
    r = tl.load(R + d, mask=d_mask, other=0.0).to(tl.float32)
    summed = (h + r).to(dtype)
    s = summed.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(s * s, 0) / D + eps)
    x = ((s * rstd).to(dtype).to(tl.float32) * g).to(XOut.dtype.element_ty)
    if pid == 0:
        tl.store(ResOut + d, summed, mask=d_mask)
        tl.store(XOut + d, x, mask=d_mask)
    y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)  # [BLOCK_N]
    if ROUTER_BIAS:
        y += tl.load(RouterBias + n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(Logits + n, y.to(Logits.dtype.element_ty), mask=n_mask)
    # Every thread's stores come before the barrier, the barrier before the arrival (a release at GPU scope), and
    # the last program's acquire before its loads, which skip L1 (.cg): it sees every program's logits.
    tl.debug_barrier()
    arrived = tl.atomic_add(Counter, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        cols = tl.arange(0, EB)
        if GROUPED:
            logits = tl.load(Logits + cols, mask=cols < E, other=0.0, cache_modifier=".cg").to(tl.float32)
            bias = tl.load(Bias + cols, mask=cols < E, other=0.0).to(tl.float32)
            top_w, top_i = grouped_top_k(logits, bias, cols, E, scale, norm_min, TOP_K, KB, EB, GROUPS, GB,
                                         GROUP_SIZE, TOP_GROUPS, GROUP_BEST, RENORM, SOFTMAX, CLAMP)
        else:
            logits = tl.load(Logits + cols, mask=cols < E, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
            top_w, top_i = top_k_probs(logits, cols, E, TOP_K, KB, EB, RENORM)
        ks = tl.arange(0, KB)
        keep = ks < TOP_K
        tl.store(Weights + ks, top_w.to(Weights.dtype.element_ty), mask=keep)
        tl.store(Ids + ks, top_i, mask=keep)
        tl.store(Counter, 0)  # the next launch (the next step's, a graph's replay) counts from zero again


def new_counter(device: torch.device) -> torch.Tensor:
    """The arrival counter one `moe_gate` call site keeps (zero, int32); the kernel leaves it zero after each launch."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def moe_gate(hidden: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
             router: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype | None, counter: torch.Tensor,
             pdl: bool = False, router_bias: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token's hidden row and residual [1, D] (one dtype), the norm's weight [D] and the router's [E, D] (that
    dtype; with `router_bias` [E] of it, GPT-OSS's) -> (normed row [1, D], residual + hidden [1, D], routing weights
    [1, top_k] in `dtype` (float32 when None), expert ids [1, top_k] int64): `moe_gate_reference` in one launch.
    `counter`: from `new_counter`, one per call site (two launches in flight must not share one). `pdl`: a
    programmatic dependent of the kernel before (where kernels.runtime.pdl_on says so)."""
    d = hidden.shape[-1]
    experts = router.shape[0]
    with_bias = (router,) if router_bias is None else (router, router_bias)
    if (hidden.shape != (1, d) or residual.shape != (1, d) or norm_weight.shape != (d,) or router.shape != (experts, d)
            or len({t.dtype for t in (hidden, residual, norm_weight, *with_bias)}) != 1
            or not all(t.is_contiguous() for t in (hidden, residual, norm_weight, *with_bias))
            or (router_bias is not None and router_bias.shape != (experts,))
            or counter.shape != (1,) or counter.dtype != torch.int32 or not 0 < top_k <= experts):
        raise ValueError(f"moe_gate takes one contiguous row and residual [1, D], a norm weight [D] and a router "
                         f"[E, D] of one dtype, an int32 counter [1] and 0 < top_k <= E; got hidden "
                         f"{tuple(hidden.shape)} {hidden.dtype}, residual {tuple(residual.shape)} {residual.dtype}, "
                         f"norm {tuple(norm_weight.shape)} {norm_weight.dtype}, router {tuple(router.shape)} "
                         f"{router.dtype}, counter {tuple(counter.shape)} {counter.dtype}, top_k {top_k}"
                         + ("" if router_bias is None else f", router bias {tuple(router_bias.shape)} "
                            f"{router_bias.dtype}"))
    return _launch(hidden, residual, norm_weight, eps, router, hidden.dtype, dtype or torch.float32, counter, pdl,
                   hidden, top_k, dict(RENORM=renormalize, GROUPED=False, GROUPS=1, GB=1, GROUP_SIZE=experts,
                                       TOP_GROUPS=1, GROUP_BEST=1, SOFTMAX=True, CLAMP=False), 1.0, 0.0, router_bias)


def _launch(hidden, residual, norm_weight, eps, router, logits_dtype, weights_dtype, counter, pdl, bias, top_k,
            routing: dict, scale: float, norm_min: float, router_bias: torch.Tensor | None = None):
    d, experts = hidden.shape[-1], router.shape[0]
    x, summed = torch.empty_like(hidden), torch.empty_like(hidden)
    logits = torch.empty((1, experts), dtype=logits_dtype, device=hidden.device)
    weights = torch.empty((1, top_k), dtype=weights_dtype, device=hidden.device)
    ids = torch.empty((1, top_k), dtype=torch.int64, device=hidden.device)
    pdl = pdl and pdl_on(hidden)
    _gate_kernel[(triton.cdiv(experts, BLOCK_N),)](
        hidden, residual, norm_weight, router, bias, summed, x, logits, weights, ids, counter, experts, eps,
        float(scale), float(norm_min), D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_N=BLOCK_N, TOP_K=top_k,
        KB=triton.next_power_of_2(top_k), EB=triton.next_power_of_2(experts), **routing, PDL=pdl,
        RouterBias=router_bias, ROUTER_BIAS=router_bias is not None,
        num_warps=gate_warps(d, experts), num_stages=1, **({"launch_pdl": True} if pdl else {}))
    return x, summed, weights, ids


def gate_warps(d: int, experts: int) -> int:
    """One warp (kernels.moe.route_warps: the routing's reductions warp shuffles) while a program's router rows and
    the hidden row fit its registers (up to 4,096 wide); four past that (DeepSeek-V3's 7,168: the routing pays the
    barriers between warps, the product does not spill)."""
    return route_warps(experts) if d <= 4096 else 4


def moe_gate_grouped(hidden: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     router: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int, top_groups: int,
                     renormalize: bool, scale: float, softmax: bool, norm_min: float, group_best: int,
                     counter: torch.Tensor, pdl: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_gate` for a bias-routed block: one token's hidden row and residual [1, D] (one dtype), the norm's weight
    [D] (that dtype), the router [E, D] and the correction bias [E] in float32 -> (normed row, residual + hidden,
    float32 weights [1, top_k], int64 ids [1, top_k]): `moe_gate_grouped_reference` in one launch."""
    d = hidden.shape[-1]
    experts = router.shape[0]
    if (hidden.shape != (1, d) or residual.shape != (1, d) or norm_weight.shape != (d,) or router.shape != (experts, d)
            or bias.shape != (experts,) or len({hidden.dtype, residual.dtype, norm_weight.dtype}) != 1
            or router.dtype != torch.float32 or bias.dtype != torch.float32
            or not all(t.is_contiguous() for t in (hidden, residual, norm_weight, router, bias))
            or counter.shape != (1,) or counter.dtype != torch.int32):
        raise ValueError(f"moe_gate_grouped takes one contiguous row and residual [1, D] and a norm weight [D] of one "
                         f"dtype, a float32 router [E, D] and bias [E], an int32 counter [1]; got hidden "
                         f"{tuple(hidden.shape)} {hidden.dtype}, residual {tuple(residual.shape)} {residual.dtype}, "
                         f"norm {tuple(norm_weight.shape)} {norm_weight.dtype}, router {tuple(router.shape)} "
                         f"{router.dtype}, bias {tuple(bias.shape)} {bias.dtype}, counter {tuple(counter.shape)} "
                         f"{counter.dtype}")
    check_grouping(experts, top_k, groups, top_groups, group_best)
    routing = dict(RENORM=renormalize, GROUPED=True, GROUPS=groups, GB=triton.next_power_of_2(groups),
                   GROUP_SIZE=experts // groups, TOP_GROUPS=top_groups, GROUP_BEST=group_best, SOFTMAX=softmax,
                   CLAMP=norm_min > 0)
    return _launch(hidden, residual, norm_weight, eps, router, torch.float32, torch.float32, counter, pdl, bias,
                   top_k, routing, scale, norm_min)


def moe_gate_reference(hidden: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       router: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype | None,
                       router_bias: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The twin of `moe_gate`: the twins of the three kernels it fuses, one after the other."""
    x, summed = fused_add_rmsnorm_reference(hidden, residual, norm_weight, eps)
    logits = x.float() @ router.float().t()
    logits = (logits if router_bias is None else logits + router_bias.float()).to(x.dtype)
    weights, ids = route_reference(logits, top_k, renormalize, dtype)
    return x, summed, weights, ids


def moe_gate_grouped_reference(hidden: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                               router: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int, top_groups: int,
                               renormalize: bool, scale: float, softmax: bool, norm_min: float, group_best: int
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The twin of `moe_gate_grouped`: the norm's twin, the float32 router's product, kernels.moe's grouped routing."""
    x, summed = fused_add_rmsnorm_reference(hidden, residual, norm_weight, eps)
    logits = x.float() @ router.t()
    weights, ids = route_grouped_reference(logits, bias, top_k, groups, top_groups, renormalize, scale, softmax,
                                           norm_min, group_best)
    return x, summed, weights, ids
