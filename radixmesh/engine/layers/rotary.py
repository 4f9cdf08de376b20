"""Rotary position embedding (rotate-half layout) over a cos/sin table of every position.

The table is built once in float32 from the frequencies of the model's RoPE type (engine.layers.rope_scaling, where
YaRN and LongRoPE also scale cos and sin by an attention factor) and cast to the model dtype at lookup, matching how
Hugging Face computes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixmesh.engine.layers.rope_scaling import ROPE_TYPES, RopeSpec, frequencies, rope_spec, spec_of_dict
from radixmesh.engine.layers.triton_ops import use_kernels

if TYPE_CHECKING:
    from radixmesh.engine.model_config import ModelConfig

__all__ = ["ROPE_TYPES", "RopeInputs", "RotaryEmbedding", "apply_rotary"]


class RotaryEmbedding:
    """Holds cos/sin for positions [0, max_positions); not an nn.Module, so it is never meta-initialised."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 device: torch.device):
        """The table of one rope dict (`scaling`: config.json's rope_scaling, original_max_position_embeddings in
        it); a model's table comes from `for_model`, which resolves its config as transformers does."""
        self._fill(spec_of_dict(head_dim, theta, scaling), max_positions, device)

    @classmethod
    def for_model(cls, cfg: ModelConfig, max_positions: int, device: torch.device) -> "RotaryEmbedding":
        table = cls.__new__(cls)
        table._fill(rope_spec(cfg), max_positions, device)
        return table

    def _fill(self, spec: RopeSpec, max_positions: int, device: torch.device) -> None:
        inv_freq, attention_factor = frequencies(spec)
        t = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(device))
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        # float32, scaled as transformers scales them before the cast to the model dtype (x 1.0 changes nothing)
        self.cos, self.sin = emb.cos() * attention_factor, emb.sin() * attention_factor

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
