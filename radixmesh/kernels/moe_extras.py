"""What some models' experts compute beyond bias-free SiLU-gated MLPs (GPT-OSS: biases on both products, the clamped
SwiGLU), shared by kernels.moe's grouped GEMMs and kernels.moe_decode's few-token launches, and the activation's
plain-torch form (their twins'). Plain torch only: engine.models.gpt_oss imports it on CPU installs without Triton
(the Triton side is kernels.moe_activation)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ExpertExtras:
    """What some models' experts compute beyond bias-free SiLU-gated MLPs (GPT-OSS): per-expert biases after the
    gate/up product (`b13` [experts, 2 x inter], gate then up) and after the down product (`b2` [experts, hidden];
    None on a tensor-parallel rank that leaves it to rank 0), and the clamped SwiGLU (`swiglu_limit` > 0):
    gate clamped above at the limit, up to [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate)."""

    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    swiglu_alpha: float = 1.0
    swiglu_limit: float = 0.0


def clamped(extras: ExpertExtras | None) -> bool:
    """Whether the experts' activation is the clamped SwiGLU (else SiLU-and-mul)."""
    return extras is not None and extras.swiglu_limit > 0


def clamped_swiglu(gate_up: torch.Tensor, extras: ExpertExtras) -> torch.Tensor:
    """[n, 2 x inter] (gate then up) -> [n, inter]: the clamped SwiGLU in the dtype of gate_up, op for op as
    transformers' GPT-OSS experts compute it (plain torch)."""
    gate, up = gate_up.chunk(2, dim=-1)
    limit = extras.swiglu_limit
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * extras.swiglu_alpha))


def expert_rows(bias: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each slot's expert's bias row ([slots, n]; zero for an id of -1)."""
    flat = ids.flatten()
    return torch.where((flat >= 0)[:, None], bias[flat.clamp(min=0)], 0)
