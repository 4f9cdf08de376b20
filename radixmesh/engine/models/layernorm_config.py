"""The `config.json` fields the LayerNorm decoders read (Cohere, StableLM, Starcoder2), with transformers' defaults
(CohereConfig, StableLmConfig, Starcoder2Config), and the refusal of what radixmesh's layers for them do not compute.

Each config names the same few switches its own way: the LayerNorms' epsilon (layer_norm_eps, norm_epsilon), the
projections' biases (attention_bias, use_qkv_bias, use_bias), q/k norms (use_qk_norm, qk_layernorm) and the parallel
residual (Cohere always, StableLM under use_parallel_residual). A field one of these architectures does not read
changes nothing in transformers either, and is ignored here too (StableLM's attention_bias, say).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixmesh.engine.model_config import ModelConfig

COHERE, STABLELM, STARCODER2 = "CohereForCausalLM", "StableLmForCausalLM", "Starcoder2ForCausalLM"
LAYERNORM_ARCHITECTURES = (COHERE, STABLELM, STARCODER2)
# Fields engine.models.support refuses away from their neutral value in other architectures: these layers read them.
READ_FIELDS = {COHERE: ("logit_scale", "use_qk_norm")}
# hidden_act values each MLP computes: silu(gate) * up; Starcoder2's un-gated GELU, with the tanh approximation or
# exact (transformers' ACT2FN "gelu" is torch's exact GELU)
_ACTIVATIONS = {COHERE: ("silu", "swish"), STABLELM: ("silu", "swish"), STARCODER2: ("gelu_pytorch_tanh", "gelu")}
_DEFAULT_ACTIVATION = {COHERE: "silu", STABLELM: "silu", STARCODER2: "gelu_pytorch_tanh"}
_NOT_YET = "not implemented by radixmesh yet"


@dataclass(frozen=True, slots=True)
class LayerNormSpec:
    """What one LayerNorm decoder's layers compute."""

    eps: float  # every LayerNorm's epsilon
    norm_bias: bool  # the LayerNorms have a bias (StableLM, Starcoder2; Cohere's have none)
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool  # Starcoder2's c_fc and c_proj
    qk_norm: bool  # q and k LayerNormed per head (each head its own weight) before RoPE
    parallel: bool  # attention and MLP read the same normed input; both outputs join the residual stream together
    logit_scale: float  # the logits are multiplied by it (Cohere)
    activation: str  # hidden_act


def layernorm_spec(cfg: ModelConfig) -> LayerNormSpec:
    """`cfg`'s switches with transformers' defaults for its architecture (one of LAYERNORM_ARCHITECTURES)."""
    raw, arch = cfg.raw, cfg.architecture
    activation = raw.get("hidden_act") or _DEFAULT_ACTIVATION[arch]
    if arch == COHERE:
        bias = bool(raw.get("attention_bias", False))
        return LayerNormSpec(raw.get("layer_norm_eps", 1e-5), False, bias, bias, False,
                             bool(raw.get("use_qk_norm", False)), True, raw.get("logit_scale", 0.0625), activation)
    if arch == STABLELM:
        return LayerNormSpec(raw.get("layer_norm_eps", 1e-5), True, bool(raw.get("use_qkv_bias", False)), False,
                             False, bool(raw.get("qk_layernorm", False)), bool(raw.get("use_parallel_residual", False)),
                             1.0, activation)
    bias = bool(raw.get("use_bias", True))
    return LayerNormSpec(raw.get("norm_epsilon", 1e-5), True, bias, bias, bias, False, False, 1.0, activation)


def check_layernorm(cfg: ModelConfig) -> None:
    """Raises ValueError if radixmesh's layers for `cfg`'s architecture would compute something other than
    transformers' (RoPE, sliding windows and quantization are checked by engine.models.support as for any model)."""
    raw, arch = cfg.raw, cfg.architecture
    spec = layernorm_spec(cfg)
    if spec.activation not in _ACTIVATIONS[arch]:
        raise ValueError(f"the MLP activation {spec.activation!r} (hidden_act={spec.activation!r} in config.json) is "
                         f"{_NOT_YET} for {arch} (it computes {', '.join(_ACTIVATIONS[arch])})")
    if raw.get("mlp_bias"):
        raise ValueError(f"MLP biases (mlp_bias=true in config.json) are not read by transformers' {arch}"
                         + (" (use_bias sets them)" if arch == STARCODER2 else ", whose MLP has none")
                         + ", so what the checkpoint expects is unclear; remove the field")
    if not (isinstance(spec.eps, (int, float)) and spec.eps > 0):
        raise ValueError(f"LayerNorm epsilon {spec.eps!r} in config.json: {arch} needs a positive number")
    if not (isinstance(spec.logit_scale, (int, float)) and math.isfinite(spec.logit_scale)):
        raise ValueError(f"logit_scale={spec.logit_scale!r} in config.json: {arch} multiplies its logits by it, "
                         "which needs a finite number")
    heads_dim = cfg.hidden_size // cfg.num_heads
    if arch == STABLELM and cfg.head_dim != heads_dim:
        raise ValueError(f"head_dim={raw.get('head_dim')!r} in config.json: transformers' {arch} splits its "
                         f"attention into hidden_size / num_attention_heads = {heads_dim} dimensions per head whatever "
                         "head_dim says, but rotates by head_dim, so what the checkpoint expects is unclear; remove "
                         "the field")
