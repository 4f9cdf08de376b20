"""SiLU-and-multiply of the gated MLP in one Triton pass (and Gemma's GELU-and-multiply, the tanh approximation), and
their plain-torch twins.

Numerics are those of engine.models.llama.MLP (Hugging Face's): silu(gate) = gate / (1 + exp(-gate)) in float32,
rounded to the model dtype, then multiplied by `up` in float32 and rounded once (PyTorch's half-precision multiply).
Gemma's gelu(gate) is PyTorch's tanh form in float32, 0.5 * g * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 * g^3))),
likewise rounded before the multiply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from radixmesh.kernels.online_softmax import tanh
from radixmesh.kernels.runtime import pdl_enter, pdl_options

_MIN_PROGRAMS = 528  # 4 programs per SM of a 132-SM H100: few rows get narrower column blocks
_MIN_BLOCK, _MAX_BLOCK = 256, 2048  # columns per program: one 16-byte bf16 vector per thread of 1 to 8 warps


_GELU_BETA = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi), as PyTorch's float32 constant
_GELU_KAPPA = tl.constexpr(0.044715)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, x_stride_row, BLOCK: tl.constexpr, PDL: tl.constexpr,
                         GELU: tl.constexpr = False):
    pdl_enter(PDL)
    # x [n, 2 * inter] (gate then up; unit column stride), out [n, inter] contiguous; grid (n, cdiv(inter, BLOCK)).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if GELU:
        inner = _GELU_BETA * (gate + _GELU_KAPPA * (gate * gate * gate))
        act = (0.5 * gate * (1.0 + tanh(inner))).to(dtype).to(tl.float32)
    else:
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (act * up).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [n, 2 * inter] -> silu(gate_up[:, :inter]) * gate_up[:, inter:] [n, inter], written to `out`
    (contiguous) or a new tensor."""
    return _gated(gate_up, out, False)


def gelu_tanh_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [n, 2 * inter] -> gelu(gate_up[:, :inter], tanh approximation) * gate_up[:, inter:] [n, inter]
    (Gemma's MLP), written to `out` (contiguous) or a new tensor."""
    return _gated(gate_up, out, True)


def _gated(gate_up: torch.Tensor, out: torch.Tensor | None, gelu: bool) -> torch.Tensor:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [n, 2 * intermediate], got {tuple(gate_up.shape)}")
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != (n, inter) or out.dtype != gate_up.dtype or out.device != gate_up.device \
            or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {(n, inter)} {gate_up.dtype} tensor on {gate_up.device}")
    if n == 0 or inter == 0:
        return out
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    block = _block_columns(n, inter)
    _silu_and_mul_kernel[(n, triton.cdiv(inter, block))](
        gate_up, out, inter, gate_up.stride(0), BLOCK=block, GELU=gelu,
        num_warps=max(1, min(8, block * gate_up.element_size() // (16 * 32))), **pdl_options(gate_up))
    return out


def _block_columns(n_rows: int, inter: int) -> int:
    """The widest column block (up to _MAX_BLOCK) that still leaves enough programs to fill the GPU."""
    block = min(_MAX_BLOCK, max(_MIN_BLOCK, triton.next_power_of_2(inter)))
    while block > _MIN_BLOCK and n_rows * triton.cdiv(inter, block) < _MIN_PROGRAMS:
        block //= 2
    return block


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """The twin of `silu_and_mul`: the activation of engine.models.llama.MLP.forward, op for op."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """The twin of `gelu_tanh_and_mul`: engine.models.gemma's MLP activation, op for op."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
