"""Qwen2-MoE's gated shared expert joined to the routed experts' output in one launch: routed + sigmoid(x . g) *
shared, per token (`gated_shared_add`), where torch takes four (the one-row product of the gate, the sigmoid, the
product and the sum), and its plain-torch twin.

Numerics are the torch ops': the gate's dot summed in float32 and rounded to the dtype (a product's rounding), the
sigmoid rounded, the product rounded, the sum rounded. The dot's float32 sum runs in another order than a GEMM's, so
the gate may round to the neighbour of torch's; the rest is exactly rounded elementwise work. Compiled without fused
multiply-adds: with them Triton computes round(round(scale * shared) + routed) of 16-bit operands as one 16-bit FMA
(`fma.rn.bf16`, a single rounding), and on an H100 a fifth of a bf16 row's elements then differed from torch's by an
ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels.runtime import pdl_enter, pdl_options


@triton.jit
def _gated_shared_add_kernel(routed_ptr, shared_ptr, x_ptr, gate_ptr, out_ptr, hidden, stride_routed, stride_shared,
                             stride_x, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    # out[t] = routed[t] + sigmoid(x[t] . gate) * shared[t], each step rounded to the dtype; one program a token
    tok = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK)
    ok = h < hidden
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + tok * stride_x + h, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + h, mask=ok, other=0.0).to(tl.float32)
    logit = tl.sum(x * g, axis=0).to(dtype).to(tl.float32)
    scale = (1.0 / (1.0 + tl.exp(-logit))).to(dtype).to(tl.float32)
    shared = tl.load(shared_ptr + tok * stride_shared + h, mask=ok, other=0.0).to(tl.float32)
    routed = tl.load(routed_ptr + tok * stride_routed + h, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + tok * stride_out + h, (routed + (scale * shared).to(dtype).to(tl.float32)).to(dtype), mask=ok)


def gated_shared_add(routed: torch.Tensor, shared: torch.Tensor, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """routed, shared, x [tokens, hidden] (one dtype, unit last stride), gate [1, hidden] or [hidden] (the shared
    expert's gate weight, x's dtype) -> routed + sigmoid(x @ gate^T) * shared, a new [tokens, hidden] tensor."""
    gate = gate.reshape(-1)
    tokens, hidden = x.shape
    if (routed.shape != x.shape or shared.shape != x.shape or gate.shape != (hidden,)
            or len({routed.dtype, shared.dtype, x.dtype, gate.dtype}) != 1
            or any(t.stride(-1) != 1 for t in (routed, shared, x, gate))):
        raise ValueError(f"gated_shared_add takes routed, shared, x [tokens, hidden] and gate [hidden] of one dtype "
                         f"with unit last strides; got routed {tuple(routed.shape)} {routed.dtype}, shared "
                         f"{tuple(shared.shape)} {shared.dtype}, x {tuple(x.shape)} {x.dtype}, gate "
                         f"{tuple(gate.shape)} {gate.dtype}")
    out = torch.empty_like(routed, memory_format=torch.contiguous_format)
    if tokens:
        block = triton.next_power_of_2(hidden)
        _gated_shared_add_kernel[(tokens,)](routed, shared, x, gate, out, hidden, routed.stride(0), shared.stride(0),
                                            x.stride(0), out.stride(0), BLOCK=block,
                                            num_warps=max(1, min(8, block // 512)), enable_fp_fusion=False,
                                            **pdl_options(x))
    return out


def gated_shared_add_reference(routed: torch.Tensor, shared: torch.Tensor, x: torch.Tensor,
                               gate: torch.Tensor) -> torch.Tensor:
    """The twin: the torch ops the kernel replaces, the gate's dot in float32 rounded once as a product is."""
    logit = (x.float() @ gate.reshape(-1, 1).float()).to(x.dtype)
    return routed + torch.sigmoid(logit) * shared
