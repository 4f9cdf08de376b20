"""What a checkpoint's attention layers compute beyond plain causal attention, read from `config.json` as
transformers' modeling code for the architecture reads it: which layers slide over a window of how many tokens, the
score scale, and attention logit soft-capping.

A query at position p of a sliding layer sees the keys at positions p - window < j <= p (transformers'
`sliding_window_overlay`: kv_idx > q_idx - sliding_window), i.e. itself and the window - 1 tokens before it.
Which layers slide is each architecture's own rule (transformers' config classes):

  Mistral, Mixtral      every layer, once sliding_window is set (Mistral defaults it to 4096; layer_types unread)
  Phi-3, Starcoder2     the same (Phi3Config, Starcoder2Config: no window by default)
  Qwen3-MoE             every layer under use_sliding_window (window default 4096)
  Qwen2, Qwen3          under use_sliding_window: layer_types, else the layers from max_window_layers (default 28) on
  Qwen2-MoE             under use_sliding_window: layer_types, else the even layers below max_window_layers
  dots.llm1             layer_types, else the layers from max_window_layers (default 62) on (window default 4096)
  Gemma 2               layer_types, else every other layer from layer 0 (window default 4096)
  Gemma 3               layer_types, else all but every sliding_window_pattern-th layer (default 6; window 4096)
  Cohere 2              the same, sliding_window_pattern defaulting to 4 (window 4096)
  GPT-OSS               layer_types, else every other layer from layer 0 (window default 128: model_config fills it)

Other architectures (Llama, Gemma 1, Cohere, StableLM, Phi, GLM, OLMo) attend to every earlier token whatever the
config says: layer_types with sliding layers there is a contradiction, which engine.models.support refuses unless the
window covers the whole context.

GPT-OSS's heads each have an attention sink (a learned logit in the softmax's denominator): `has_sinks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixmesh.engine.attention.base import AttentionShape
from radixmesh.engine.layers.rope_scaling import rope_field, rope_type, yarn_mscale
from radixmesh.engine.models.gemma_config import GEMMA_ARCHITECTURES, gemma_config

if TYPE_CHECKING:
    import torch

    from radixmesh.engine.model_config import ModelConfig

HF_DEFAULT_WINDOW = 4096  # MistralConfig, Qwen2/Qwen3(-MoE)Config, Gemma2Config, Gemma3TextConfig
HF_DEFAULT_MAX_WINDOW_LAYERS = 28  # Qwen2Config/Qwen3Config/Qwen2MoeConfig
DOTS1_DEFAULT_MAX_WINDOW_LAYERS = 62  # Dots1Config's
HF_DEFAULT_GEMMA3_PATTERN = 6  # Gemma3TextConfig's sliding_window_pattern
_DEFAULT_PATTERN = {"Cohere2ForCausalLM": 4}  # others: Gemma 3's
_EVERY_LAYER = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Starcoder2ForCausalLM")
_QWEN_LISTED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM")
_LAYER_TYPES = ("full_attention", "sliding_attention")  # the layer_types entries radixmesh computes
_EVERY_OTHER = ("Gemma2ForCausalLM", "GptOssForCausalLM")  # without layer_types: layers 0, 2, 4, ... slide
SINK_ARCHITECTURES = ("GptOssForCausalLM",)


@dataclass(frozen=True, slots=True)
class SlidingLayers:
    """Which layers of a config slide, as transformers computes them."""

    window: int | None  # the window size the sliding layers use; None: config.json gives none
    sliding: tuple[bool, ...]  # per layer
    where: str  # the config.json fields that say so (for messages)
    implemented: bool  # whether the architecture's attention reads the window at all

    @property
    def count(self) -> int:
        return sum(self.sliding)


def _listed(raw: dict, layers: int) -> tuple[bool, ...] | None:
    """config.json's layer_types as sliding flags, or None without them."""
    types = raw.get("layer_types")
    if not types:
        return None
    unknown = sorted({str(t) for t in types} - set(_LAYER_TYPES))
    if len(types) != layers or unknown:
        raise ValueError(f"layer_types in config.json lists {len(types)} layers for num_hidden_layers={layers}"
                         + (f", and types radixmesh does not compute ({', '.join(unknown)})" if unknown else "")
                         + f": each layer is one of {', '.join(_LAYER_TYPES)}")
    return tuple(t == "sliding_attention" for t in types)


def _qwen(raw: dict, arch: str, layers: int) -> SlidingLayers:
    on = bool(raw.get("use_sliding_window"))
    window = raw.get("sliding_window", HF_DEFAULT_WINDOW) if on else None
    first = raw.get("max_window_layers", HF_DEFAULT_MAX_WINDOW_LAYERS)
    where = f"use_sliding_window={str(on).lower()}, sliding_window={window}"
    listed = _listed(raw, layers)
    if listed is not None:
        return SlidingLayers(window, listed, f"{where}, layer_types", True)
    if arch == "Qwen2MoeForCausalLM":
        sliding = tuple(on and i % 2 == 0 and i < first for i in range(layers))
    else:
        sliding = tuple(window is not None and i >= first for i in range(layers))
    return SlidingLayers(window, sliding, f"{where}, max_window_layers={first}", True)


def _patterned(raw: dict, arch: str, layers: int) -> SlidingLayers:
    """Gemma 2/3's and Cohere 2's rule: layer_types, else every pattern-th layer global."""
    window = raw.get("sliding_window", HF_DEFAULT_WINDOW)
    listed = _listed(raw, layers)
    if listed is not None:
        return SlidingLayers(window, listed, f"sliding_window={window}, layer_types", True)
    pattern = 2 if arch in _EVERY_OTHER else raw.get("sliding_window_pattern",
                                                              _DEFAULT_PATTERN.get(arch, HF_DEFAULT_GEMMA3_PATTERN))
    if not isinstance(pattern, int) or pattern < 1:
        raise ValueError(f"sliding_window_pattern={pattern!r} in config.json: every how many layers one is global "
                         "needs a positive whole number")
    sliding = tuple((i + 1) % pattern != 0 for i in range(layers))
    rule = "every other layer" if arch in _EVERY_OTHER else f"sliding_window_pattern={pattern}"
    return SlidingLayers(window, sliding, f"sliding_window={window}, {rule}", True)


def sliding_layers(cfg: ModelConfig) -> SlidingLayers:
    """Which of `cfg`'s layers slide and over how many tokens, by its architecture's rule (module docstring)."""
    raw, arch, layers = cfg.raw, cfg.architecture, cfg.num_layers
    if arch in _EVERY_LAYER:
        has_default = arch == "MistralForCausalLM"
        window = raw.get("sliding_window", HF_DEFAULT_WINDOW if has_default else None)
        where = (f"sliding_window={window}" if "sliding_window" in raw or not has_default
                 else f"no sliding_window, which transformers' MistralConfig defaults to {HF_DEFAULT_WINDOW}")
        return SlidingLayers(window, (window is not None,) * layers, where, True)
    if arch == "Qwen3MoeForCausalLM":
        on = bool(raw.get("use_sliding_window"))
        window = raw.get("sliding_window", HF_DEFAULT_WINDOW) if on else None
        return SlidingLayers(window, (window is not None,) * layers,
                             f"use_sliding_window={str(on).lower()}, sliding_window={window}", True)
    if arch in _QWEN_LISTED:
        return _qwen(raw, arch, layers)
    if arch == "Dots1ForCausalLM":  # Qwen's rule with no use_sliding_window switch
        window = raw.get("sliding_window", HF_DEFAULT_WINDOW)
        first = raw.get("max_window_layers", DOTS1_DEFAULT_MAX_WINDOW_LAYERS)
        listed = _listed(raw, layers)
        sliding = listed if listed is not None else tuple(window is not None and i >= first for i in range(layers))
        return SlidingLayers(window, sliding, f"sliding_window={window}, " + (
            "layer_types" if listed is not None else f"max_window_layers={first}"), True)
    if arch in GEMMA_ARCHITECTURES or arch in ("Cohere2ForCausalLM", "GptOssForCausalLM"):
        return _patterned(raw, arch, layers)
    window = raw.get("sliding_window")  # unread by transformers here, as layer_types: what they would say
    types = raw.get("layer_types") or []
    listed = tuple(i < len(types) and types[i] == "sliding_attention" for i in range(layers))
    return SlidingLayers(window, listed, f"sliding_window={window}, layer_types", False)


def layer_windows(cfg: ModelConfig, context_length: int) -> tuple[int | None, ...]:
    """Per layer: its window, or None where it sees every earlier token. A window of at least `context_length`
    tokens masks nothing in a sequence the engine can hold, so it is None too (nothing to compute)."""
    spec = sliding_layers(cfg)
    if not spec.implemented or spec.window is None or spec.window >= context_length:
        return (None,) * cfg.num_layers
    return tuple(spec.window if slides else None for slides in spec.sliding)


def has_sinks(cfg: ModelConfig) -> bool:
    """Whether the model's attention heads have sinks (a learned logit each, in every softmax's denominator)."""
    return cfg.architecture in SINK_ARCHITECTURES


def mla_scale(cfg: ModelConfig) -> float:
    """MLA's score scale as transformers computes it (DeepSeek's reference too): 1 / sqrt(qk_head_dim), times the
    square of YaRN's mscale at `mscale_all_dim` where the RoPE type is not the default and that field is set."""
    scale = cfg.mla.qk_head_dim ** -0.5
    rope = rope_field(cfg.raw)[1]
    all_dim = rope.get("mscale_all_dim")
    if rope_type(cfg.architecture, rope)[0] != "default" and all_dim:
        scale *= yarn_mscale(float(rope["factor"]), all_dim) ** 2
    return scale


def attention_shape(cfg: ModelConfig, num_heads: int, num_kv_heads: int, context_length: int,
                    dtype: torch.dtype | None = None) -> AttentionShape:
    """The attention backend's view of `cfg` on one tensor-parallel rank (`num_heads`, `num_kv_heads`: its own;
    `dtype`: the model's, which its queries have)."""
    scale, softcap = cfg.head_dim ** -0.5, None
    if cfg.architecture in GEMMA_ARCHITECTURES:
        gemma = gemma_config(cfg)
        scale, softcap = gemma.query_pre_attn_scalar ** -0.5, gemma.attn_softcap
    if cfg.architecture == "GraniteForCausalLM":  # GraniteConfig's default is 1.0, not 1 / sqrt(head_dim)
        scale = cfg.raw.get("attention_multiplier", 1.0)
    if cfg.mla is not None:  # scores of the whole q/k head (its un-rotated and rotated parts), not of the latent
        scale = mla_scale(cfg)
    windows = layer_windows(cfg, context_length)
    return AttentionShape(num_heads, num_kv_heads, cfg.head_dim, scale, softcap,
                          windows if any(w is not None for w in windows) else (), dtype,
                          cfg.mla.kv_lora_rank if cfg.mla is not None else None, has_sinks(cfg))
