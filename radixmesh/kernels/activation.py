"""SiLU-and-multiply of the gated MLP in one Triton pass, and its plain-torch twin.

Numerics are those of engine.models.llama.MLP (Hugging Face's): silu(gate) = gate / (1 + exp(-gate)) in float32,
rounded to the model dtype, then multiplied by `up` in float32 and rounded once (PyTorch's half-precision multiply).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from radixmesh.kernels.runtime import pdl_enter, pdl_options

_MIN_PROGRAMS = 528  # 4 programs per SM of a 132-SM H100: few rows get narrower column blocks
_MIN_BLOCK, _MAX_BLOCK = 256, 2048  # columns per program: one 16-byte bf16 vector per thread of 1 to 8 warps


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in float32 from values of `dtype` (gate and up already rounded to it), the activation rounded
    to `dtype` before the multiply, the result rounded once: the module docstring's numerics."""
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, x_stride_row, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    # x [n, 2 * inter] (gate then up; unit column stride), out [n, inter] contiguous; grid (n, cdiv(inter, BLOCK)).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, silu_mul(gate, up, out_ptr.dtype.element_ty), mask=mask)


# ---- the activation in a one-row product's epilogue ---------------------------------------------------------------
# A gate/up product of one token ([2 * inter, k] weights, gate rows first) whose programs each take gate row j and up
# row inter + j side by side can write silu(gate) * up itself: the SiLU-and-mul launch leaves the chain (kernels.gemv.
# gemv_row, kernels.fp8_gemv.fp8_gemv_row and kernels.fp8_gemv_norm.fp8_gemv_row_norm with `gated=True`). Both
# products are rounded to the output dtype first, as the unfused product stores them, so the result is the two
# launches' bit for bit. The weight shapes whose one-row gate/up products take it in this process:
# engine.decode_products.gated_plan times one launch against two per shape; engine.layers.linear.
# MergedColumnParallelLinear.silu_and_mul reads it.
GATED_SHAPES: set[tuple[int, int]] = set()


def set_gated_shapes(shapes) -> None:
    """The gate/up weight shapes whose one-row products write the activation themselves; graphs captured afterwards
    follow it."""
    GATED_SHAPES.clear()
    GATED_SHAPES.update(shapes)


def check_gated(gated: bool, n: int, block_n: int) -> None:
    """A gated one-row product needs an even number of weight rows and whole pairs in every program."""
    if gated and (n % 2 or block_n < 2 or block_n & (block_n - 1)):
        raise ValueError(f"a gated one-row product takes [2 * inter, k] weights and a power-of-two BLOCK_N >= 2 "
                         f"(gate and up rows in pairs); got {n} rows, BLOCK_N {block_n}")


@triton.jit
def row_block(pid, N, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """The weight rows of a one-row product's program and their mask: BLOCK_N consecutive rows, or (GATED) BLOCK_N //
    2 pairs (gate row j, up row N // 2 + j) interleaved."""
    i = tl.arange(0, BLOCK_N)
    if GATED:
        j = pid * (BLOCK_N // 2) + i // 2
        return j + (i % 2) * (N // 2), j < N // 2
    n = pid * BLOCK_N + i
    return n, n < N


@triton.jit
def store_row_block(Y, y, pid, n, n_mask, N, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """Stores a program's float32 sums `y` (rows `n`, from row_block) rounded to Y's dtype, or (GATED) silu(gate) *
    up of each pair at its column of Y [N // 2]."""
    dtype = Y.dtype.element_ty
    if GATED:
        gate, up = tl.split(tl.reshape(y.to(dtype).to(tl.float32), [BLOCK_N // 2, 2]))
        j = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(Y + j, silu_mul(gate, up, dtype), mask=j < N // 2)
    else:
        tl.store(Y + n, y.to(dtype), mask=n_mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [n, 2 * inter] -> silu(gate_up[:, :inter]) * gate_up[:, inter:] [n, inter], written to `out`
    (contiguous) or a new tensor."""
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
        gate_up, out, inter, gate_up.stride(0), BLOCK=block,
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
