"""Rotary position embedding (rotate-half layout), with Llama-3.1 frequency scaling.

The cos/sin table is built once in float32 for every position and cast to the model dtype at lookup, matching how
Hugging Face computes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from radixmesh.engine.layers.triton_ops import use_kernels

# The rope_scaling types this module computes; engine.models.support refuses any other at config time.
ROPE_TYPES = ("default", "llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama-3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")


class RotaryEmbedding:
    """Holds cos/sin for positions [0, max_positions); not an nn.Module, so it is never meta-initialised."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 device: torch.device):
        inv_freq = inv_frequencies(head_dim, theta, scaling).to(device)
        t = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        self.cos, self.sin = emb.cos(), emb.sin()

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_tokens, 1, head_dim] in `dtype`; looked up once per forward, shared by every layer."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> "RopeInputs":
        """What every layer of one forward needs to rotate its q and k: on CUDA the positions (the kernel reads the
        float32 tables itself), elsewhere the looked-up cos/sin."""
        if use_kernels(positions):
            return RopeInputs(self, positions, None, None)
        return RopeInputs(self, positions, *self.lookup(positions, dtype))


@dataclass(slots=True)
class RopeInputs:
    table: RotaryEmbedding
    positions: torch.Tensor  # [num_tokens] int64
    cos: torch.Tensor | None  # [num_tokens, 1, head_dim] in the model dtype; None: the Triton kernel looks up
    sin: torch.Tensor | None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [num_tokens, heads, head_dim], k [num_tokens, kv_heads, head_dim] -> rotated copies."""
        if self.cos is None:
            from radixmesh.kernels.rotary import apply_rotary as kernel

            return kernel(q, k, self.table.cos, self.table.sin, self.positions)
        return apply_rotary(q, k, self.cos, self.sin)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [num_tokens, heads, head_dim], k [num_tokens, kv_heads, head_dim] -> rotated copies."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
