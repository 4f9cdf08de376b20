"""Mixture-of-experts MLP in two grouped-GEMM launches, and its plain-torch twin.

Each token goes to `top_k` experts; a (token, k) pair is a "slot" (slot = token * top_k + k). `align_by_expert`
orders the slots by expert and pads each expert's run to a multiple of BLOCK_M, so one program's rows all use one
expert's weights. It makes no host round trip: the buffers have their worst-case size (every expert's last block
padded), which keeps the shapes fixed for CUDA graphs.

`fused_experts` then runs gate/up for every slot ([slots, 2 x intermediate]), SiLU-and-mul, and down with the
routing weight applied ([slots, hidden]), and sums each token's top_k rows. Rounding follows the twin: each product
accumulates in float32 and is rounded to the activations' dtype once, as a dense `linear` is; the routing weight
multiplies the rounded down-projection; the top_k rows are summed in float32 and rounded once (the twin adds them
one expert at a time in the dtype, so in bfloat16 the two may differ by an ulp)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from radixmesh.kernels.runtime import dot_needs_upcast

BLOCK_M = 16


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [tokens, top_k] -> (slots [capacity] grouped by expert, each group padded to block_m with the sentinel
    tokens * top_k; the expert of each block [capacity / block_m], -1 for blocks no expert of this rank runs). An id
    of -1 (an expert another rank holds) gets a group of its own, after the others, that no block runs."""
    flat = ids.flatten().to(torch.int64)
    flat = torch.where(flat >= 0, flat, num_experts)
    n = flat.numel()
    capacity = triton.cdiv(n + (num_experts + 1) * (block_m - 1), block_m) * block_m
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


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, slots: torch.Tensor, block_experts: torch.Tensor,
                  n_slots: int, a_row_div: int, weights: torch.Tensor | None, zeroed: bool = False) -> torch.Tensor:
    """[n_slots, N]: each slot's row of `a` (slot // a_row_div) times its expert's w [N, K] transposed (rows of
    slots no block runs: zero when `zeroed`, else unset)."""
    n, k = w.shape[1], w.shape[2]
    out = (torch.zeros if zeroed else torch.empty)((n_slots, n), dtype=a.dtype, device=a.device)
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](a, w, out, slots, block_experts, weights if weights is not None else a, n_slots, n, k,
                               a_row_div, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                               BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, WEIGHTED=weights is not None,
                               UPCAST=dot_needs_upcast(a.dtype),
                               PRECISION="ieee" if a.dtype == torch.float32 else "tf32")
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """x [tokens, hidden], w13 [experts, 2 x inter, hidden], w2 [experts, hidden, inter], routing weights and
    expert ids [tokens, top_k] -> [tokens, hidden]: sum over k of weights * down(silu(gate) * up) of expert ids."""
    from radixmesh.kernels.activation import silu_and_mul

    tokens, top_k = ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    slots, block_experts = align_by_expert(ids, w13.shape[0])
    n_slots = tokens * top_k
    # rows of other ranks' experts (ids of -1) stay zero: no garbage through SiLU, nothing in the sum
    gate_up = _grouped_gemm(x, w13, slots, block_experts, n_slots, top_k, None, zeroed=True)
    act = silu_and_mul(gate_up)
    down = _grouped_gemm(act, w2, slots, block_experts, n_slots, 1, weights.flatten().contiguous(), zeroed=True)
    return down.view(tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)


def fused_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                            ids: torch.Tensor) -> torch.Tensor:
    """The twin: each expert once, on the tokens routed to it (in token order, as transformers does), its weighted
    output added into the token's row in x's dtype. Slots whose id is -1 (an expert of another rank) add nothing."""
    out = torch.zeros_like(x)
    hit = torch.zeros(w13.shape[0], dtype=torch.bool, device=x.device)
    flat = ids.flatten()
    hit[flat[flat >= 0]] = True
    for e in hit.nonzero().flatten().tolist():
        token, slot = torch.where(ids == e)
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        h = F.silu(gate) * up
        out.index_add_(0, token, (F.linear(h, w2[e]) * weights[token, slot, None]).to(out.dtype))
    return out
