"""The `config.json` fields Gemma 2 and Gemma 3 (text) layers read, with transformers' defaults
(Gemma2Config, Gemma3TextConfig), and the refusal of what radixmesh's Gemma layers do not compute; Gemma 1's
(GemmaConfig: its activation, causal attention) too.

Gemma3ForConditionalGeneration is served text-only as Gemma 3: engine.model_config reads its text_config.

Gemma 3 rotates its sliding (local) layers and its global layers with different RoPE tables. transformers reads
them from `rope_parameters` keyed by layer type (what transformers 5 writes), or from the older fields: global layers
take rope_theta (default 1e6) and rope_scaling, local ones rope_local_base_freq (default 1e4) and no scaling. Gemma 2
has one table, read and checked as any other model's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixmesh.engine.layers.rotary import ROPE_TYPES

if TYPE_CHECKING:
    from radixmesh.engine.model_config import ModelConfig

GEMMA1, GEMMA2, GEMMA3, GEMMA3_MM = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                                     "Gemma3ForConditionalGeneration")
GEMMA3_ARCHITECTURES = (GEMMA3, GEMMA3_MM)
# the architectures with Gemma 2/3's fields (soft-caps, query_pre_attn_scalar, sliding layers, Gemma 3's RoPE tables)
GEMMA_ARCHITECTURES = (GEMMA2, *GEMMA3_ARCHITECTURES)
# Fields engine.models.support refuses away from their neutral value in other architectures: Gemma's layers read them.
GEMMA_FIELDS = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar")
ACTIVATION = "gelu_pytorch_tanh"  # the MLP's gate: GELU with the tanh approximation (torch's approximate="tanh")
# Gemma 1's hidden_act values transformers computes as ACTIVATION (GemmaConfig reads the legacy "gelu" as it)
_GEMMA1_ACTIVATIONS = (ACTIVATION, "gelu")
# RoPE types Gemma checkpoints use; each also needs engine.layers.rotary to compute it (ROPE_TYPES)
_GEMMA_ROPE_TYPES = ("default", "linear")
_NOT_YET = "not implemented by radixmesh yet"
_LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True, slots=True)
class LayerRope:
    """The RoPE of one layer type of Gemma 3."""

    theta: float
    scaling: dict | None  # the rope dict engine.layers.rotary reads (None: plain RoPE)
    where: str  # the config.json fields it comes from (for messages)

    @property
    def rope_type(self) -> str:
        scaling = self.scaling or {}
        return scaling.get("rope_type") or scaling.get("type") or "default"


@dataclass(frozen=True, slots=True)
class GemmaConfig:
    query_pre_attn_scalar: float  # attention scores are q.k / sqrt(query_pre_attn_scalar)
    attn_softcap: float | None  # attention scores become cap * tanh(score / cap)
    final_softcap: float | None  # logits become cap * tanh(logit / cap)
    activation: str
    # Gemma 3: (full-attention layers, sliding layers); Gemma 2: None, one table for every layer, read as any other
    # model's (engine.layers.rope_scaling, checked by engine.models.support)
    ropes: tuple[LayerRope, LayerRope] | None


def _gemma3_ropes(raw: dict) -> tuple[LayerRope, LayerRope]:
    """(global, local) as transformers' Gemma3TextConfig builds its rope_parameters."""
    params = raw.get("rope_parameters") or {}
    if not set(params) <= set(_LAYER_TYPES) or not all(v is None or isinstance(v, dict) for v in params.values()):
        raise ValueError(f"rope_parameters={params!r} in config.json: Gemma 3 reads RoPE per layer type "
                         f"(rope_parameters keyed by {' and '.join(_LAYER_TYPES)})")
    nested = {t: dict(params.get(t) or {"rope_type": "default"}) for t in _LAYER_TYPES}
    if raw.get("rope_scaling"):
        nested["full_attention"].update(raw["rope_scaling"])
    nested["full_attention"].setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
    nested["sliding_attention"].setdefault("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
    specs = []
    for layer_type in ("full_attention", "sliding_attention"):
        rope = nested[layer_type]
        theta = float(rope.pop("rope_theta"))
        kind = rope.get("rope_type") or rope.get("type") or "default"
        specs.append(LayerRope(theta, rope if kind != "default" else None,
                              f"{layer_type} RoPE: rope_theta={theta}, {rope}"))
    return specs[0], specs[1]


def _optional_float(raw: dict, field: str, default: float | None) -> float | None:
    value = raw.get(field, default)
    return None if value is None else float(value)


def gemma_config(cfg: ModelConfig) -> GemmaConfig:
    """`cfg`'s Gemma fields with transformers' defaults (Gemma 2: soft-caps 50 and 30; Gemma 3: none)."""
    raw, gemma2 = cfg.raw, cfg.architecture == GEMMA2
    return GemmaConfig(
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        attn_softcap=_optional_float(raw, "attn_logit_softcapping", 50.0 if gemma2 else None),
        final_softcap=_optional_float(raw, "final_logit_softcapping", 30.0 if gemma2 else None),
        activation=raw.get("hidden_activation", ACTIVATION),
        ropes=None if gemma2 else _gemma3_ropes(raw))


def _check_causal(raw: dict, arch: str) -> None:
    if raw.get("use_bidirectional_attention"):
        raise ValueError(f"bidirectional attention (use_bidirectional_attention=true in config.json) is {_NOT_YET}: "
                         f"radixmesh's {arch} attends causally")


def check_gemma1(cfg: ModelConfig) -> None:
    """Raises ValueError if radixmesh's Gemma 1 layers would compute something other than transformers' for `cfg`
    (GemmaConfig reads hidden_act, not Gemma 2's hidden_activation; its other fields are Llama's, checked as theirs)."""
    raw, arch = cfg.raw, cfg.architecture
    _check_causal(raw, arch)
    act = raw.get("hidden_act") or ACTIVATION
    if act not in _GEMMA1_ACTIVATIONS:
        raise ValueError(f"the MLP activation {act!r} (hidden_act={act!r} in config.json) is {_NOT_YET} for {arch}: "
                         f"its MLP computes {ACTIVATION}(gate) * up")
    if raw.get("mlp_bias"):
        raise ValueError(f"MLP biases (mlp_bias=true in config.json) are not read by transformers' {arch}, whose MLP "
                         "has none, so what the checkpoint expects is unclear; remove the field")


def check_gemma(cfg: ModelConfig) -> None:
    """Raises ValueError if radixmesh's Gemma layers would compute something other than transformers' for `cfg`."""
    raw, arch = cfg.raw, cfg.architecture
    _check_causal(raw, arch)
    if arch in GEMMA3_ARCHITECTURES and raw.get("attn_logit_softcapping") is not None:
        raise ValueError(f"attention logit soft-capping (attn_logit_softcapping={raw['attn_logit_softcapping']!r} "
                         "in config.json) is ignored by transformers' Gemma 3, so what the checkpoint expects is "
                         "unclear; set it to null")
    if arch == GEMMA3_MM and raw.get("final_logit_softcapping") is not None:
        raise ValueError(f"final logit soft-capping (text_config.final_logit_softcapping="
                         f"{raw['final_logit_softcapping']!r} in config.json) is ignored by transformers' {arch}, so "
                         "what the checkpoint expects is unclear; set it to null")
    spec = gemma_config(cfg)
    if spec.activation != ACTIVATION:
        raise ValueError(f"the MLP activation {spec.activation!r} (hidden_activation in config.json) is {_NOT_YET} "
                         f"for {arch}: its MLP computes {ACTIVATION}(gate) * up")
    for name, value in (("query_pre_attn_scalar", spec.query_pre_attn_scalar),
                        ("attn_logit_softcapping", spec.attn_softcap),
                        ("final_logit_softcapping", spec.final_softcap)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value!r} in config.json: {arch} needs a positive number")
    for rope in spec.ropes or ():
        _check_rope(rope, arch)
    factor = raw.get("partial_rotary_factor")
    if spec.ropes and factor is not None and factor != 1:
        raise ValueError(f"partial rotary embedding (partial_rotary_factor={factor} in config.json) is {_NOT_YET}: "
                         "it rotates every dimension of each head")


def _check_rope(rope: LayerRope, arch: str) -> None:
    kind = rope.rope_type
    if kind not in _GEMMA_ROPE_TYPES or kind not in ROPE_TYPES:
        raise ValueError(f"RoPE scaling {kind!r} ({rope.where} in config.json) is {_NOT_YET} for {arch} (it "
                         f"implements {', '.join(t for t in _GEMMA_ROPE_TYPES if t in ROPE_TYPES)}): positions would "
                         "be encoded differently from the model's training")
    scaling: dict[str, Any] = rope.scaling or {}
    factor = scaling.get("partial_rotary_factor")
    if factor is not None and factor != 1:
        raise ValueError(f"partial rotary embedding ({rope.where} in config.json) is {_NOT_YET}: it rotates every "
                         "dimension of each head")
    if kind == "linear" and not isinstance(scaling.get("factor"), (int, float)):
        raise ValueError(f"linear RoPE scaling without a numeric factor ({rope.where} in config.json) cannot be "
                         "computed")
