"""Rotary position embedding (rotate-half layout) over a cos/sin table of every position.

The table is built once in float32 from the frequencies of the model's RoPE type (engine.layers.rope_scaling, where
YaRN and LongRoPE also scale cos and sin by an attention factor) and cast to the model dtype at lookup, matching how
Hugging Face computes it. The table serves positions [0, max_positions): LongRoPE picks its factors by that length
(engine.layers.rope_scaling).

Partial rotary (Phi-4-mini's partial_rotary_factor): the table covers the first `rotary_dim` dimensions of a head,
which rotate among themselves (rotate-half within them); the others pass through, as transformers' Phi-3 does (the
rotary kernel does the same).

Interleaved pairs (transformers' Cohere and GLM: GPT-J's layout): dimensions (2i, 2i + 1) rotate together by
frequency i, where rotate-half pairs (i, i + rotary_dim / 2); the table repeats each frequency twice in a row. As Cohere
computes it, q and k rotate in float32 (cos and sin rounded to the model dtype first) and round back once; GLM rotates
them in the model dtype (`upcast_pairs` False), which float32 models compute alike. The rotary kernel does either
(kernels.rotary.Pairs). A table kept in float32 at lookup (ERNIE 4.5's), or one a model looks up itself once per
forward (`looked_up`: DeepSeek's latent attention, whose kernels take the looked-up rows), is applied in plain torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from radixmesh.engine.layers.norm import GEMMA_NORM_KERNELS, GemmaRMSNorm, HeadLayerNorm, LayerNorm, RMSNorm
from radixmesh.engine.layers.rope_scaling import ROPE_TYPES, RopeSpec, frequencies, rope_spec, spec_of_dict
from radixmesh.engine.layers.triton_ops import use_kernels

if TYPE_CHECKING:
    from radixmesh.engine.model_config import ModelConfig

__all__ = ["ROPE_TYPES", "RopeInputs", "RotaryEmbedding", "apply_rotary"]


class RotaryEmbedding:
    """Holds cos/sin for positions [0, max_positions); not an nn.Module, so it is never meta-initialised."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 device: torch.device, interleaved: bool = False, upcast_pairs: bool = True):
        """The table of one rope dict (`scaling`: config.json's rope_scaling, original_max_position_embeddings in
        it); a model's table comes from `for_model`, which resolves its config as transformers does."""
        self._fill(replace(spec_of_dict(head_dim, theta, scaling), context=max_positions), max_positions, device,
                   head_dim, interleaved, upcast_pairs)

    @classmethod
    def for_model(cls, cfg: ModelConfig, max_positions: int, device: torch.device,
                  interleaved: bool = False, upcast_pairs: bool = True, float32_table: bool = False,
                  looked_up: bool = False) -> "RotaryEmbedding":
        """`cfg`'s table; `interleaved`: GPT-J's pair layout (module docstring) instead of rotate-half, rotated in
        float32 (`upcast_pairs`, Cohere's) or in the model dtype (GLM's); `float32_table`: cos and sin stay float32
        at lookup instead of rounding to the model dtype (ERNIE 4.5 keeps them "in full precision"); `looked_up`:
        cos and sin looked up once per forward on every device (the model's own kernels take the rows)."""
        table = cls.__new__(cls)
        table._fill(replace(rope_spec(cfg), context=max_positions), max_positions, device, cfg.rope_head_dim,
                    interleaved, upcast_pairs, float32_table, looked_up)
        return table

    def _fill(self, spec: RopeSpec, max_positions: int, device: torch.device, head_dim: int,
              interleaved: bool, upcast_pairs: bool, float32_table: bool = False, looked_up: bool = False) -> None:
        inv_freq, attention_factor = frequencies(spec)
        self.rotary_dim = spec.dim  # leading dimensions of a head that rotate (head_dim, unless partial)
        self.partial = spec.dim < head_dim
        self.interleaved, self.upcast_pairs, self.float32_table = interleaved, upcast_pairs, float32_table
        self.looked_up = looked_up or float32_table  # (the kernel rounds cos and sin to the model dtype)
        t = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(device))
        # [max_positions, rotary_dim]: frequency i at i and i + rotary_dim / 2, or (interleaved) at 2i and 2i + 1
        emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat([freqs, freqs], dim=-1)
        # float32, scaled as transformers scales them before the cast to the model dtype (x 1.0 changes nothing)
        self.cos, self.sin = emb.cos() * attention_factor, emb.sin() * attention_factor

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_tokens, 1, rotary_dim] in `dtype` (float32 with `float32_table`); looked up once per forward,
        shared by every layer."""
        dtype = torch.float32 if self.float32_table else dtype
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> "RopeInputs":
        """What every layer of one forward needs to rotate its q and k: on CUDA the positions (the kernel reads the
        float32 tables itself), elsewhere the looked-up cos/sin; a `looked_up` table everywhere (module
        docstring)."""
        if use_kernels(positions) and not self.looked_up:
            return RopeInputs(self, positions, None, None)
        return RopeInputs(self, positions, *self.lookup(positions, dtype))


@dataclass(slots=True)
class RopeInputs:
    table: RotaryEmbedding
    positions: torch.Tensor  # [num_tokens] int64
    cos: torch.Tensor | None  # [num_tokens, 1, rotary_dim] in the model dtype; None: the Triton kernel looks up
    sin: torch.Tensor | None
    # kernels.rotary.QKNorm: the per-head norms the kernel applies to q and k before it rotates them (norm_qk)
    qk_norm: tuple | None = None

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor, q_norm, k_norm
                ) -> tuple[torch.Tensor, torch.Tensor, "RopeInputs"]:
        """The per-head norms `q_norm`, `k_norm` of q and k, before they rotate. Where the rotary kernel runs (no
        cos looked up) and computes them (_kernel_norm), they are left to its launch: q and k come back as they are,
        with RopeInputs that carry the weights (two launches a layer fewer for an RMSNorm, ~ten for a LayerNorm).
        Any other (the torch path) is applied now. Either way `apply` (or the pool's fused write) then returns
        normed, rotated q and k."""
        norm = _kernel_norm(q, q_norm, k_norm) if self.cos is None else None
        if norm is None:
            return q_norm(q), k_norm(k), self
        return q, k, replace(self, qk_norm=norm)

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [num_tokens, heads, head_dim], k [num_tokens, kv_heads, head_dim] -> rotated copies (normed first when
        `qk_norm` is set, which only norm_qk does, and only where the kernel runs)."""
        if self.cos is None:
            from radixmesh.kernels.rotary import apply_rotary as kernel

            return kernel(q, k, self.table.cos, self.table.sin, self.positions, qk_norm=self.qk_norm,
                          pairs=self.pairs())
        return apply_rotary(q, k, self.cos, self.sin, self.table.interleaved, self.table.upcast_pairs)

    def pairs(self):
        """kernels.rotary.Pairs for an interleaved table, None for rotate-half (the kernel path only)."""
        if not self.table.interleaved:
            return None
        from radixmesh.kernels.rotary import Pairs

        return Pairs(self.table.upcast_pairs)


def _kernel_norm(q: torch.Tensor, q_norm, k_norm):
    """kernels.rotary.QKNorm for the q and k norms the rotary kernel computes, else None: Qwen3's (RMSNorm itself,
    weights of q's dtype), Gemma 3's (GemmaRMSNorm, offset weights), Command-R+'s and StableLM 2's (HeadLayerNorm, a
    weight row a head) and Phi's (a LayerNorm with weight and bias, one for every head)."""
    kind = type(q_norm)
    if (kind is not type(k_norm) or q_norm.eps != k_norm.eps or getattr(q_norm, "weight", None) is None
            or q_norm.weight.shape[-1] != q.shape[-1]):  # (a norm over more than a head stays in torch)
        return None
    from radixmesh.kernels.rotary import QKNorm

    if kind is HeadLayerNorm or (isinstance(q_norm, LayerNorm) and (q_norm.bias is None) == (k_norm.bias is None)):
        return QKNorm(q_norm.weight, k_norm.weight, q_norm.eps, layer=True, q_bias=getattr(q_norm, "bias", None),
                      k_bias=getattr(k_norm, "bias", None))
    if (kind is RMSNorm or (kind is GemmaRMSNorm and GEMMA_NORM_KERNELS)) \
            and q_norm.weight.dtype == q.dtype == k_norm.weight.dtype:
        return QKNorm(q_norm.weight, k_norm.weight, q_norm.eps, kind is GemmaRMSNorm)
    return None


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                 upcast_pairs: bool = True):
    """q [num_tokens, heads, head_dim], k [num_tokens, kv_heads, head_dim] -> rotated copies. cos, sin
    [num_tokens, 1, rotary_dim]: with rotary_dim < head_dim only the leading rotary_dim dimensions rotate;
    `interleaved`: GPT-J's pairs, in float32 unless not `upcast_pairs` (module docstring)."""
    if interleaved:
        return _rotate_pairs(q, cos, sin, upcast_pairs), _rotate_pairs(k, cos, sin, upcast_pairs)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot = x[..., :dim]
    return torch.cat([rot * cos + _rotate_half(rot) * sin, x[..., dim:]], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, upcast: bool = True) -> torch.Tensor:
    """x rotated by interleaved pairs in float32, rounded back to x's dtype once; without `upcast`, in x's dtype."""
    dim = cos.shape[-1]
    rot = x[..., :dim].float() if upcast else x[..., :dim]
    swapped = torch.stack([-rot[..., 1::2], rot[..., ::2]], dim=-1).flatten(-2)  # (x0, x1) -> (-x1, x0) per pair
    out = (rot * cos + swapped * sin).to(x.dtype)
    return out if dim == x.shape[-1] else torch.cat([out, x[..., dim:]], dim=-1)
