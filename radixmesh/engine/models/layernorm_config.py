"""The `config.json` fields the LayerNorm decoders read (Cohere, Cohere 2, StableLM, Starcoder2, Phi), with
transformers' defaults (CohereConfig, Cohere2Config, StableLmConfig, Starcoder2Config, PhiConfig), and the refusal of
what radixmesh's layers for them do not compute.

Each config names the same few switches its own way: the LayerNorms' epsilon (layer_norm_eps, norm_epsilon), the
projections' biases (attention_bias, use_qkv_bias, use_bias; Phi's are always there), q/k norms (use_qk_norm,
qk_layernorm) and the parallel residual (Cohere, Cohere 2 and Phi always, StableLM under use_parallel_residual). A field
one of these architectures does not read changes nothing in transformers either, and is ignored here too (StableLM's
attention_bias, say).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixmesh.engine.model_config import ModelConfig

COHERE, STABLELM, STARCODER2 = "CohereForCausalLM", "StableLmForCausalLM", "Starcoder2ForCausalLM"
COHERE2, PHI = "Cohere2ForCausalLM", "PhiForCausalLM"
LAYERNORM_ARCHITECTURES = (COHERE, COHERE2, STABLELM, STARCODER2, PHI)
# Fields engine.models.support refuses away from their neutral value in other architectures: these layers read them.
READ_FIELDS = {COHERE: ("logit_scale", "use_qk_norm"), COHERE2: ("logit_scale",)}
# hidden_act values each MLP computes: silu(gate) * up; Starcoder2's and Phi's un-gated GELU (engine.layers.activation:
# each as transformers' ACT2FN computes it)
_ACTIVATIONS = {COHERE: ("silu", "swish"), COHERE2: ("silu", "swish"), STABLELM: ("silu", "swish"),
                STARCODER2: ("gelu_pytorch_tanh", "gelu"), PHI: ("gelu_new", "gelu_pytorch_tanh", "gelu", "gelu_fast")}
_DEFAULT_ACTIVATION = {COHERE: "silu", COHERE2: "silu", STABLELM: "silu", STARCODER2: "gelu_pytorch_tanh",
                       PHI: "gelu_new"}
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
    logit_scale: float  # the logits are multiplied by it (Cohere, Cohere 2)
    activation: str  # hidden_act


def layernorm_spec(cfg: ModelConfig) -> LayerNormSpec:
    """`cfg`'s switches with transformers' defaults for its architecture (one of LAYERNORM_ARCHITECTURES)."""
    raw, arch = cfg.raw, cfg.architecture
    activation = raw.get("hidden_act") or _DEFAULT_ACTIVATION[arch]
    if arch in (COHERE, COHERE2):  # Cohere 2 has no q/k norms
        bias = bool(raw.get("attention_bias", False))
        qk_norm = arch == COHERE and bool(raw.get("use_qk_norm", False))
        return LayerNormSpec(raw.get("layer_norm_eps", 1e-5), False, bias, bias, False, qk_norm, True,
                             raw.get("logit_scale", 0.0625), activation)
    if arch == PHI:  # biases everywhere; qk_layernorm: one LayerNorm (with a bias) shared by every q head, one by k's
        return LayerNormSpec(raw.get("layer_norm_eps", 1e-5), True, True, True, True,
                             bool(raw.get("qk_layernorm", False)), True, 1.0, activation)
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
        whose = {STARCODER2: " (use_bias sets them)", PHI: " (its fc1 and fc2 always have one)"}
        raise ValueError(f"MLP biases (mlp_bias=true in config.json) are not read by transformers' {arch}"
                         + whose.get(arch, ", whose MLP has none") + ", so what the checkpoint expects is unclear; "
                         "remove the field")
    if arch == PHI and cfg.tie_word_embeddings:
        raise ValueError("an output layer tied to the embedding (tie_word_embeddings=true in config.json) is "
                         f"{_NOT_YET} for {arch}: its lm_head has a bias of its own beside the shared weight")
    if not (isinstance(spec.eps, (int, float)) and spec.eps > 0):
        raise ValueError(f"LayerNorm epsilon {spec.eps!r} in config.json: {arch} needs a positive number")
    if not (isinstance(spec.logit_scale, (int, float)) and math.isfinite(spec.logit_scale)):
        raise ValueError(f"logit_scale={spec.logit_scale!r} in config.json: {arch} multiplies its logits by it, "
                         "which needs a finite number")
    _check_head_dim(cfg, spec)


def _check_head_dim(cfg: ModelConfig, spec: LayerNormSpec) -> None:
    """Where transformers' code reads hidden_size / num_attention_heads rather than head_dim, a head_dim that differs
    leaves the checkpoint's shapes unclear."""
    arch, heads_dim = cfg.architecture, cfg.hidden_size // cfg.num_heads
    uses = {STABLELM: "splits its attention into heads of", COHERE2: "sets head_dim to",
            PHI: "normalises each q and k head (qk_layernorm=true) over" if spec.qk_norm else None}.get(arch)
    if uses and cfg.head_dim != heads_dim:
        raise ValueError(f"head_dim={cfg.raw.get('head_dim')!r} in config.json: transformers' {arch} {uses} "
                         f"hidden_size / num_attention_heads = {heads_dim} whatever head_dim says"
                         + (", but rotates by head_dim" if arch == STABLELM else "")
                         + ", so what the checkpoint expects is unclear; remove the field")
