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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels.moe import route_reference, route_warps, top_k_probs
from radixmesh.kernels.norm import fused_add_rmsnorm_reference
from radixmesh.kernels.runtime import pdl_on

BLOCK_N = 2  # router rows a program: 64 programs for 128 experts (gemv_row's one-row tiles)


@triton.jit
def _gate_kernel(H, R, G, W, ResOut, XOut, Logits, Weights, Ids, Counter, E, eps, D: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, TOP_K: tl.constexpr, KB: tl.constexpr,
                 EB: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr):
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
    tl.store(Logits + n, y.to(Logits.dtype.element_ty), mask=n_mask)
    # Every thread's stores come before the barrier, the barrier before the arrival (a release at GPU scope), and
    # the last program's acquire before its loads, which skip L1 (.cg): it sees every program's logits.
    tl.debug_barrier()
    arrived = tl.atomic_add(Counter, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        cols = tl.arange(0, EB)
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
             pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token's hidden row and residual [1, D] (one dtype), the norm's weight [D] and the router's [E, D] (that
    dtype) -> (normed row [1, D], residual + hidden [1, D], routing weights [1, top_k] in `dtype` (float32 when
    None), expert ids [1, top_k] int64): `moe_gate_reference` in one launch. `counter`: from `new_counter`, one per
    call site (two launches in flight must not share one). `pdl`: a programmatic dependent of the kernel before
    (where kernels.runtime.pdl_on says so)."""
    d = hidden.shape[-1]
    experts = router.shape[0]
    if (hidden.shape != (1, d) or residual.shape != (1, d) or norm_weight.shape != (d,) or router.shape != (experts, d)
            or len({t.dtype for t in (hidden, residual, norm_weight, router)}) != 1
            or not all(t.is_contiguous() for t in (hidden, residual, norm_weight, router))
            or counter.shape != (1,) or counter.dtype != torch.int32 or not 0 < top_k <= experts):
        raise ValueError(f"moe_gate takes one contiguous row and residual [1, D], a norm weight [D] and a router "
                         f"[E, D] of one dtype, an int32 counter [1] and 0 < top_k <= E; got hidden "
                         f"{tuple(hidden.shape)} {hidden.dtype}, residual {tuple(residual.shape)} {residual.dtype}, "
                         f"norm {tuple(norm_weight.shape)} {norm_weight.dtype}, router {tuple(router.shape)} "
                         f"{router.dtype}, counter {tuple(counter.shape)} {counter.dtype}, top_k {top_k}")
    x, summed = torch.empty_like(hidden), torch.empty_like(hidden)
    logits = hidden.new_empty((1, experts))
    weights = torch.empty((1, top_k), dtype=dtype or torch.float32, device=hidden.device)
    ids = torch.empty((1, top_k), dtype=torch.int64, device=hidden.device)
    pdl = pdl and pdl_on(hidden)
    _gate_kernel[(triton.cdiv(experts, BLOCK_N),)](
        hidden, residual, norm_weight, router, summed, x, logits, weights, ids, counter, experts, eps, D=d,
        BLOCK_D=triton.next_power_of_2(d), BLOCK_N=BLOCK_N, TOP_K=top_k, KB=triton.next_power_of_2(top_k),
        EB=triton.next_power_of_2(experts), RENORM=renormalize, PDL=pdl,
        num_warps=route_warps(experts), num_stages=1, **({"launch_pdl": True} if pdl else {}))
    return x, summed, weights, ids


def moe_gate_reference(hidden: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       router: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The twin of `moe_gate`: the twins of the three kernels it fuses, one after the other."""
    x, summed = fused_add_rmsnorm_reference(hidden, residual, norm_weight, eps)
    logits = (x.float() @ router.float().t()).to(x.dtype)
    weights, ids = route_reference(logits, top_k, renormalize, dtype)
    return x, summed, weights, ids
