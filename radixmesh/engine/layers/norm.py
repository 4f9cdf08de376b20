"""RMSNorm with the Hugging Face numerics: statistics in float32, the weight applied in the input dtype.

With a residual, the norm first adds it (rounded to the input dtype, as the decoder's `hidden + sublayer(...)` is)
and returns the sum as the new residual: one fused kernel on CUDA.
"""

from __future__ import annotations

import torch
from torch import nn

from radixmesh.engine.layers.triton_ops import use_kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., dim] -> normed x; with `residual` -> (norm(x + residual), x + residual)."""
        if use_kernels(x):
            from radixmesh.kernels.norm import fused_add_rmsnorm, rmsnorm

            if residual is None:
                return rmsnorm(x, self.weight, self.eps)
            return fused_add_rmsnorm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm (transformers' Gemma2RMSNorm / Gemma3RMSNorm): the weight is stored as an offset from 1 and
    applied in float32 before the cast back, x * rsqrt(mean(x^2) + eps) * (1 + weight). No residual fusion (Gemma's
    decoder norms the sublayers' outputs before adding them)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> normed x in x's dtype."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
