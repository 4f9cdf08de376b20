"""The experts' activation and biases in Triton (GPT-OSS's, kernels.moe_extras.ExpertExtras): the clamped SwiGLU as a
jit function of the kernels that compute it (`swiglu_rounded`: kernels.moe_decode, kernels.moe_mxfp4), and the
grouped GEMMs' two steps around their products in one launch each: the gate/up bias added and the activation
(`biased_activation`), the weighted down bias added (`add_weighted_bias`), each with its plain-torch twin (the ops
they replace, op for op)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels.moe_extras import ExpertExtras, clamped, clamped_swiglu, expert_rows
from radixmesh.kernels.runtime import pdl_enter, pdl_options

def _grid_columns(n: int) -> int:
    return min(1024, max(16, triton.next_power_of_2(n)))


@triton.jit
def swiglu_rounded(gate, up, alpha, limit, dtype):
    """GPT-OSS's clamped SwiGLU of float32 values already in `dtype`, rounding to `dtype` after each operation as
    torch computes it there: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    g = tl.minimum(gate, limit)
    u = tl.minimum(tl.maximum(up, -limit), limit)
    scaled = (g * alpha).to(dtype).to(tl.float32)
    sig = (1.0 / (1.0 + tl.exp(-scaled))).to(dtype).to(tl.float32)
    glu = (g * sig).to(dtype).to(tl.float32)
    return ((u + 1.0).to(dtype).to(tl.float32) * glu).to(dtype).to(tl.float32)


@triton.jit
def _biased_act_kernel(gu_ptr, ids_ptr, b_ptr, out_ptr, inter, stride_gu, stride_be, alpha, limit,
                       BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    # out[slot, n] = swiglu(gate_up[slot, n] + b13[e, n], gate_up[slot, inter + n] + b13[e, inter + n]), e = ids[slot]
    slot = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < inter
    dtype = out_ptr.dtype.element_ty
    row = gu_ptr + slot * stride_gu + n
    gate = tl.load(row, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(row + inter, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:  # (an id of -1, another rank's expert: no bias, as its zero row)
        expert = tl.load(ids_ptr + slot).to(tl.int64)
        bias = b_ptr + tl.maximum(expert, 0) * stride_be + n
        bias_ok = n < tl.where(expert >= 0, inter, 0)
        gate = (gate + tl.load(bias, mask=bias_ok, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        up = (up + tl.load(bias + inter, mask=bias_ok, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(out_ptr + slot * inter + n, swiglu_rounded(gate, up, alpha, limit, dtype).to(dtype), mask=ok)


def biased_activation(gate_up: torch.Tensor, ids: torch.Tensor, extras: ExpertExtras) -> torch.Tensor:
    """The grouped path's gate/up result [slots, 2 x inter] (slot = token * top_k + k, `ids` [tokens, top_k]) ->
    [slots, inter]: each slot's expert's gate/up bias added (rounded) and the clamped SwiGLU, in one launch
    (`biased_activation_reference` op for op)."""
    if not clamped(extras) or gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1 \
            or ids.numel() != gate_up.shape[0]:
        raise ValueError(f"biased_activation takes [slots, 2 x inter] with a clamped SwiGLU and an id a slot; got "
                         f"{tuple(gate_up.shape)} and ids {tuple(ids.shape)}")
    slots, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((slots, inter), dtype=gate_up.dtype, device=gate_up.device)
    if slots == 0:
        return out
    b13, block = extras.b13, _grid_columns(inter)
    _biased_act_kernel[(slots, triton.cdiv(inter, block))](
        gate_up, ids.flatten(), b13 if b13 is not None else gate_up, out, inter, gate_up.stride(0),
        b13.stride(0) if b13 is not None else 0, extras.swiglu_alpha, extras.swiglu_limit, BLOCK=block,
        HAS_BIAS=b13 is not None, num_warps=4, **pdl_options(gate_up))
    return out


def biased_activation_reference(gate_up: torch.Tensor, ids: torch.Tensor, extras: ExpertExtras) -> torch.Tensor:
    """The twin of `biased_activation`: the bias rows added in the model dtype, then `clamped_swiglu`."""
    if extras.b13 is not None:
        gate_up = gate_up + expert_rows(extras.b13, ids).to(gate_up.dtype)
    return clamped_swiglu(gate_up, extras)


@triton.jit
def _weighted_bias_kernel(out_ptr, ids_ptr, w_ptr, b_ptr, hidden, stride_out, stride_be, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
    pdl_enter(PDL)
    # out[slot, n] += weights[slot] * b2[ids[slot], n], the product rounded to out's dtype, then the sum
    slot = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    ok = n < hidden
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(w_ptr + slot).to(tl.float32)
    bias = tl.load(b_ptr + tl.maximum(expert, 0) * stride_be + n, mask=n < tl.where(expert >= 0, hidden, 0),
                   other=0.0)
    term = (weight * bias.to(tl.float32)).to(dtype).to(tl.float32)
    row = out_ptr + slot * stride_out + n
    tl.store(row, (tl.load(row, mask=ok, other=0.0).to(tl.float32) + term).to(dtype), mask=ok)


def add_weighted_bias(down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """The grouped path's weighted down products [slots, hidden] += each slot's routing weight times its expert's
    down bias (b2 [experts, hidden]), in place, one launch (`add_weighted_bias_reference` op for op)."""
    flat = weights.flatten()
    if down.dim() != 2 or down.stride(1) != 1 or flat.numel() != down.shape[0] or ids.numel() != down.shape[0]:
        raise ValueError(f"add_weighted_bias takes [slots, hidden] with a weight and an id a slot; got "
                         f"{tuple(down.shape)}, weights {tuple(weights.shape)}, ids {tuple(ids.shape)}")
    if down.shape[0] == 0:
        return down
    block = _grid_columns(down.shape[1])
    _weighted_bias_kernel[(down.shape[0], triton.cdiv(down.shape[1], block))](
        down, ids.flatten(), flat.contiguous(), b2, down.shape[1], down.stride(0), b2.stride(0), BLOCK=block,
        num_warps=4, **pdl_options(down))
    return down


def add_weighted_bias_reference(down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                                b2: torch.Tensor) -> torch.Tensor:
    """The twin of `add_weighted_bias` (in place too)."""
    down += (weights.flatten()[:, None] * expert_rows(b2, ids)).to(down.dtype)
    return down
