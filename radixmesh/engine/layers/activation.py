"""SiLU-and-mul (GELU-and-mul for Gemma) of a fused gate/up projection, in PyTorch's rounding (the activation rounded
to the dtype, then the product); the GELUs of un-gated MLPs (Phi's) as transformers' ACT2FN computes each."""

from __future__ import annotations

import math

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
    transformers' gelu_pytorch_tanh activation computes it (one kernel on CUDA, two torch launches otherwise)."""
    if use_kernels(gate_up):
        from radixmesh.kernels.activation import gelu_tanh_and_mul as kernel

        return kernel(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _gelu_tanh_formula(x: torch.Tensor) -> torch.Tensor:
    """transformers' NewGELUActivation ("gelu_new"): the tanh approximation written out, op for op."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    """transformers' FastGELUActivation ("gelu_fast")."""
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


# hidden_act -> the GELU transformers computes for it ("gelu": torch's exact GELU; "gelu_pytorch_tanh": torch's tanh
# approximation, which rounds otherwise than "gelu_new"'s formula)
GELUS = {"gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu_new": _gelu_tanh_formula,
         "gelu_fast": _gelu_fast}
