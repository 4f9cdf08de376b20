"""SiLU-and-mul (GELU-and-mul for Gemma) of a fused gate/up projection, in PyTorch's rounding (the activation rounded
to the dtype, then the product)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixmesh.engine.layers.triton_ops import use_kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [n, 2 * intermediate] (gate first) -> silu(gate) * up [n, intermediate]."""
    if use_kernels(gate_up):
        from radixmesh.kernels.activation import silu_and_mul as kernel

        return kernel(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [n, 2 * intermediate] (gate first) -> gelu(gate, tanh approximation) * up [n, intermediate], as
    transformers' gelu_pytorch_tanh activation computes it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
