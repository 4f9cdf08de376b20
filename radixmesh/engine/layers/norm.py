"""RMSNorm with the Hugging Face numerics: statistics in float32, the weight applied in the input dtype; Gemma's
(1 + weight) RMSNorm; LayerNorm, over a whole hidden vector or per attention head.

With a residual, a norm first adds it (rounded to the input dtype, as the decoder's `hidden + sublayer(...)` is)
and returns the sum as the new residual: one fused kernel on CUDA (RMSNorm).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from radixmesh.engine.layers.linear import ELSEWHERE, Shard
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


# Gemma's norms run kernels.norm on CUDA; RADIXMESH_GEMMA_NORMS=0 keeps torch's ops there (an A/B switch for benchmarks)
GEMMA_NORM_KERNELS = os.environ.get("RADIXMESH_GEMMA_NORMS", "1") != "0"


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm (transformers' Gemma2RMSNorm / Gemma3RMSNorm): the weight is stored as an offset from 1 and
    applied in float32 before the cast back, x * rsqrt(mean(x^2) + eps) * (1 + weight). No residual fusion (Gemma's
    decoder norms the sublayers' outputs before adding them)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., dim] -> normed x in x's dtype; with `residual` (Gemma 1's pre-norm decoder) -> (norm(x + residual),
        x + residual). One kernel on CUDA (kernels.norm.gemma_rmsnorm): in torch a norm is ~9 launches."""
        if GEMMA_NORM_KERNELS and use_kernels(x):
            from radixmesh.kernels.norm import gemma_rmsnorm

            return gemma_rmsnorm(x, self.weight, self.eps, residual=residual)
        if residual is not None:
            summed = x + residual
            return self.forward(summed), summed
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim as torch's nn.LayerNorm computes it: statistics in float32, the weight (and the
    bias, where the model has one: StableLM, Starcoder2, Phi) applied before the one rounding to the input dtype.
    transformers' CohereLayerNorm (no bias) computes the same in float32 and rounds once, and OLMo's OlmoLayerNorm
    (`weight` False: neither weight nor bias) too. With a residual, as RMSNorm: (norm(x + residual), x + residual)."""

    def __init__(self, dim: int, eps: float, bias: bool, weight: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., dim] -> normed x in x's dtype; with `residual` -> (norm(x + residual), x + residual)."""
        if residual is None:
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        summed = x + residual
        return F.layer_norm(summed, (x.shape[-1],), self.weight, self.bias, self.eps), summed


class HeadLayerNorm(nn.Module):
    """LayerNorm without bias of each attention head's vector, with that head's own weight (Cohere's q_norm / k_norm,
    StableLM's q_layernorm / k_layernorm): statistics and weight in float32, one rounding to the input dtype.

    Holds the weights of heads [first, first + heads) of the checkpoint's `total` (this rank's under tensor
    parallelism). The checkpoint stores them as one [total, head_dim] tensor (Cohere), or, with `per_head`, as one
    [head_dim] tensor per head named `{per_head}.norms.{h}.weight` beside this module (StableLM's per-head
    nn.LayerNorm list), of which this rank reads its heads' only."""

    def __init__(self, heads: int, head_dim: int, eps: float, first: int = 0, total: int | None = None,
                 per_head: str | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, head_dim))
        self.eps, self.first, self.total, self.per_head = eps, first, total or heads, per_head

    def checkpoint_shards(self, leaf: str) -> list[tuple[str | None, Shard]]:
        heads = self.weight.shape[0]
        if self.per_head is None:
            return [(None, Shard(None, 0, self.first, heads))]
        return [(f"{self.per_head}.norms.{h}", Shard(h - self.first) if 0 <= h - self.first < heads else ELSEWHERE)
                for h in range(self.total)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, heads, head_dim] -> each head normed with its weight, in x's dtype."""
        h = F.layer_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (h * self.weight.float()).to(x.dtype)
