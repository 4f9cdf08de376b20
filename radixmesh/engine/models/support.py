"""What the engine can serve of a `config.json`: a feature that changes a model's outputs and that no layer of ours
implements is refused at load, before any weight is read, with a ValueError that names the feature and the field.

`check_servable` reads the config (once the context length is known: a sliding window matters only when it is shorter);
`check_tensor_dtype` and `check_unexpected_tensors` read what the weight files' headers hold. The reference for what a
field does is transformers' modeling code for the architectures we accept (Llama, Mistral, Qwen2, Qwen3, Gemma 2/3,
...). Gemma's own fields are checked by engine.models.gemma_config, Cohere's, Cohere 2's, StableLM's, Starcoder2's and
Phi's by engine.models.layernorm_config, which layers slide by engine.models.attention_spec.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from typing import TYPE_CHECKING, Any

from radixmesh.engine.layers.rope_scaling import (ROPE_TYPES, exact_context, frequencies, longrope_notice, rope_field,
                                                  rope_spec, rope_type, types_for)
from radixmesh.engine.models.attention_spec import sliding_layers
from radixmesh.engine.models.gemma_config import (GEMMA1, GEMMA3_ARCHITECTURES, GEMMA_ARCHITECTURES, GEMMA_FIELDS,
                                                  check_gemma, check_gemma1)
from radixmesh.engine.models.layernorm_config import LAYERNORM_ARCHITECTURES, READ_FIELDS, check_layernorm

if TYPE_CHECKING:
    from radixmesh.engine.model_config import ModelConfig

log = logging.getLogger(__name__)

_NOT_YET = "not implemented by radixmesh yet"
_UNQUANTIZED = "serve an unquantized (bfloat16, float16 or float32) checkpoint"
# Quantization files that sit beside config.json (AutoGPTQ, AutoAWQ) -> the method they imply (NVIDIA ModelOpt's
# hf_quant_config.json is read as the config's quantization_config: engine.model_config.with_quant_file)
_QUANT_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}
_QUANT_DETAILS = ("weight_block_size", "bits", "group_size", "format", "fmt", "load_in_4bit", "load_in_8bit")
# Granite's scalars (engine.models.granite computes them)
GRANITE_FIELDS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
OLMO = "OlmoForCausalLM"  # reads clip_qkv (engine.models.olmo clamps q, k and v)
CLIP_QKV = (OLMO, "OlmoeForCausalLM")  # the architectures whose layers read clip_qkv (engine.models.olmoe too)
# the architectures whose layers read use_qk_norm (engine.models.glm4_moe, engine.models.minimax_m2)
QK_NORM_FLAG = ("Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM")
# the architectures whose every projection takes a bias with use_bias (transformers' ERNIE 4.5)
_USE_BIAS = ("Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM")
# Activations our MLP computes (transformers' ACT2FN maps both names to SiLU)
_SILU = ("silu", "swish")


def check_servable(model: ModelConfig, context_length: int) -> None:
    """Raises ValueError if serving `model` up to `context_length` tokens would compute something other than the
    model: quantized weights, sliding layers without a usable window, RoPE we do not compute, or a config field
    that changes the math away from its neutral value. Reads config.json's fields and the model directory only. A
    multi-token-prediction head (engine.speculative.nextn) is checked as the model whose layer it holds."""
    if "nextn_of" in model.raw:
        model = dataclasses.replace(model, architecture=model.raw["nextn_of"])
    _check_quantization(model)
    _check_sliding_window(model, context_length)
    if model.architecture in GEMMA_ARCHITECTURES:  # its activation, soft-caps, score scale, Gemma 3's RoPE tables
        check_gemma(model)
    elif model.architecture == GEMMA1:
        check_gemma1(model)
    elif model.architecture in LAYERNORM_ARCHITECTURES:  # activation, biases, epsilon, logit scale
        check_layernorm(model)
    else:
        _check_activation_and_biases(model)
    if model.architecture in CLIP_QKV:
        _check_clip_qkv(model)
    if model.architecture in _DEEPSEEK_ROUTING:
        _check_deepseek_routing(model)
    if model.architecture not in GEMMA3_ARCHITECTURES:  # (two tables: sliding and global layers, checked above)
        _check_rope(model, context_length)
    _check_neutral_fields(model)


def _check_quantization(model: ModelConfig) -> None:
    from radixmesh.engine.quantization import mxfp4
    from radixmesh.engine.quantization.fp8 import checkpoint_scheme

    if checkpoint_scheme(model.raw) is not None:  # fp8 weights we read (engine.quantization.fp8); fields checked
        return
    if mxfp4.is_mxfp4(model.raw):  # GPT-OSS's experts, dequantized at load (engine.quantization.mxfp4)
        if model.architecture in mxfp4.ARCHITECTURES:
            return
        raise ValueError(f"mxfp4 quantization (quantization_config.quant_method='mxfp4' in config.json) is read "
                         f"for {', '.join(mxfp4.ARCHITECTURES)}'s experts, not {model.architecture}'s: its quantized "
                         f"weights would be read as plain floats and answer wrong; {_UNQUANTIZED}")
    for key in ("quantization_config", "compression_config"):
        quant = model.raw.get(key)
        if quant:
            quant = quant if isinstance(quant, dict) else {}
            method = quant.get("quant_method", "unknown")
            details = "".join(f", {k}={quant[k]!r}" for k in _QUANT_DETAILS if k in quant)
            raise ValueError(f"{method} quantization ({key}.quant_method={method!r}{details} in config.json) "
                             f"is {_NOT_YET}: its quantized weights would be read as plain floats and answer "
                             f"wrong; {_UNQUANTIZED}")
    for name, implied in _QUANT_FILES.items():
        file = os.path.join(model.path, name)
        if os.path.isfile(file):
            method = _json_field(file, "quant_method") or implied
            raise ValueError(f"{method} quantization ({name} in {model.path}) is {_NOT_YET}: its quantized "
                             f"weights would be read as plain floats and answer wrong; {_UNQUANTIZED}")


def _json_field(file: str, key: str) -> Any:
    try:
        with open(file) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data.get(key) if isinstance(data, dict) else None


def _check_sliding_window(model: ModelConfig, context_length: int) -> None:
    """Every attention backend computes sliding windows, on the layers transformers slides
    (engine.models.attention_spec). Refused: sliding layers without a usable window, and a window in the config of an
    architecture whose transformers attention ignores it (Llama), where the window would matter: the config
    contradicts its architecture. A window of w tokens masks nothing in sequences of at most w tokens, and the engine
    bounds every sequence by the context length."""
    spec = sliding_layers(model)
    if spec.count == 0:
        return
    layers = f"{spec.count} of {model.num_layers} layers"
    if spec.window is None:
        raise ValueError(f"sliding-window attention ({spec.where} in config.json: {layers} slide, but there is no "
                         "window size) cannot be computed: transformers cannot run it without a window either")
    if not isinstance(spec.window, int) or spec.window < 1:
        raise ValueError(f"sliding-window attention ({spec.where} in config.json: {layers}) needs a window of at "
                         "least one token")
    if not spec.implemented and spec.window < context_length:
        raise ValueError(f"sliding-window attention ({spec.where} in config.json: {layers}) is not read by "
                         f"transformers' {model.architecture}, which attends to every earlier token, so the config "
                         f"contradicts its architecture; the context length {context_length} is longer than the "
                         f"window, where the two would differ: pass --context-length {spec.window} or less")


# architectures whose transformers attention rotates only the first int(head_dim * partial_rotary_factor) dimensions
# (engine.layers.rotary); elsewhere transformers' rotary multiplies whole heads by a shorter table and fails
_PARTIAL_ROTARY = ("Phi3ForCausalLM", "StableLmForCausalLM", "PhiForCausalLM", "GlmForCausalLM", "Glm4ForCausalLM",
                   "Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM")


def _check_rope(model: ModelConfig, context_length: int) -> None:
    """RoPE we compute exactly as transformers does (engine.layers.rope_scaling), up to `context_length` tokens."""
    raw, arch = model.raw, model.architecture
    field, rope = rope_field(raw)
    nested = sorted(k for k, v in rope.items() if isinstance(v, dict))
    if nested:
        raise ValueError(f"per-layer-type RoPE ({field} keyed by {', '.join(nested)} in config.json) "
                         f"is {_NOT_YET}: every layer rotates with one table")
    kind, key = rope_type(arch, rope)
    named = rope.get(key) or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"RoPE scaling {named!r} ({field}.{key}={named!r} in config.json) "
                         f"is {_NOT_YET} (it implements {', '.join(ROPE_TYPES)}): positions would be encoded "
                         "differently from the model's training")
    if kind not in types_for(arch):
        raise ValueError(f"RoPE scaling {named!r} ({field}.{key}={named!r} in config.json) is not one transformers' "
                         f"{arch} computes (it accepts {', '.join(types_for(arch))})")
    for where, location in ((raw, "partial_rotary_factor"), (rope, f"{field}.partial_rotary_factor")):
        factor = where.get("partial_rotary_factor")
        if factor is not None and factor != 1 and arch not in _PARTIAL_ROTARY:
            raise ValueError(f"partial rotary embedding ({location}={factor} in config.json) is {_NOT_YET} for "
                             f"{arch}: it rotates every dimension of each head")
    spec = dataclasses.replace(rope_spec(model), context=context_length)
    frequencies(spec)  # ValueError for a dict the rule cannot compute
    notice = longrope_notice(spec)
    if notice is not None:
        log.warning(notice)
    limit = exact_context(spec)
    if limit is not None and context_length > limit[0]:
        raise ValueError(f"{limit[1]}. A context of {context_length} tokens would rotate some tokens otherwise than "
                         f"transformers does; pass --context-length {limit[0]} or less")


def _check_activation_and_biases(model: ModelConfig) -> None:
    """transformers' Llama reads mlp_bias (Mistral's and Qwen's MLPs have none whatever it says): a config that sets
    it declares biases we have no parameter for, refused here for every architecture rather than as missing tensors."""
    act = model.raw.get("hidden_act", "silu")
    if act not in _SILU:
        raise ValueError(f"the MLP activation {act!r} (hidden_act={act!r} in config.json) is {_NOT_YET}: "
                         "radixmesh's MLP computes silu(gate) * up")
    if model.raw.get("mlp_bias"):
        raise ValueError(f"MLP biases (mlp_bias=true in config.json) are {_NOT_YET}: radixmesh's MLP "
                         "projections have no bias")
    if model.architecture in _USE_BIAS and model.raw.get("use_bias"):  # (other architectures do not read it)
        raise ValueError(f"biases on every projection (use_bias=true in config.json, which {model.architecture} "
                         f"reads) are {_NOT_YET}: radixmesh's MLP projections have no bias; no published ERNIE 4.5 "
                         "text model sets it")


# DeepSeek's routing fields that transformers computes one way per architecture (engine.models.deepseek): (the
# scoring_func its code computes, the topk_method values it computes). DeepSeek's own modeling code reads both, and
# moe_layer_freq and (V2) norm_topk_prob, which transformers ignores: a config that sets them otherwise was written
# for other code, and is refused rather than served as transformers would.
_DEEPSEEK_ROUTING = {"DeepseekV2ForCausalLM": ("softmax", ("greedy", "group_limited_greedy")),
                     "DeepseekV3ForCausalLM": ("sigmoid", ("noaux_tc",))}


def _check_deepseek_routing(model: ModelConfig) -> None:
    raw, arch = model.raw, model.architecture
    scoring, methods = _DEEPSEEK_ROUTING[arch]
    method = raw.get("topk_method", "greedy" if arch == "DeepseekV2ForCausalLM" else None)
    if method is not None and method not in methods:
        raise ValueError(f"expert routing topk_method={method!r} in config.json is {_NOT_YET} for {arch}, which "
                         f"routes by {' or '.join(methods)}")
    if raw.get("scoring_func", scoring) != scoring:
        raise ValueError(f"expert scores scoring_func={raw['scoring_func']!r} in config.json are {_NOT_YET} for "
                         f"{arch}, whose experts are scored by {scoring}")
    if raw.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq={raw['moe_layer_freq']!r} in config.json (a sparse layer every that many "
                         f"layers) is {_NOT_YET}: every layer from first_k_dense_replace on is sparse")
    if arch == "DeepseekV2ForCausalLM" and raw.get("norm_topk_prob"):
        raise ValueError(f"norm_topk_prob=true in config.json is {_NOT_YET} for {arch}: its routing weights are "
                         "the chosen experts' softmax scores as they are (times routed_scaling_factor)")


def _check_clip_qkv(model: ModelConfig) -> None:
    clip = model.raw.get("clip_qkv")
    if clip is not None and not (isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip > 0
                                 and math.isfinite(clip)):
        raise ValueError(f"clip_qkv={clip!r} in config.json: {model.architecture} clamps q, k and v to "
                         "[-clip_qkv, clip_qkv], which needs a positive number (or null: no clamping)")


def _neutral_values(model: ModelConfig) -> dict[str, tuple[str, Any]]:
    """config.json field -> (the feature it turns on, the value at which it changes nothing). None: only absent (or
    null) is neutral. None of these is read by transformers' Llama/Mistral/Qwen2/Qwen3 code: a config that sets one
    was written for a model that computes it (Gemma 2, Granite, Cohere, MiniCPM, OLMo, Llama 4), mislabelled."""
    return {
        "attn_logit_softcapping": ("attention logit soft-capping", None),
        "final_logit_softcapping": ("final logit soft-capping", None),
        "query_pre_attn_scalar": ("query pre-attention scaling", model.head_dim),
        "attention_multiplier": ("attention score scaling", model.head_dim ** -0.5),
        "embedding_multiplier": ("embedding scaling", 1.0),
        "scale_emb": ("embedding scaling", 1.0),
        "residual_multiplier": ("residual scaling", 1.0),
        "logits_scaling": ("logit scaling", 1.0),
        "logit_scale": ("logit scaling", 1.0),
        "clip_qkv": ("q/k/v clipping", None),
        "use_qk_norm": ("q/k normalisation", False),
    }


def _is_neutral(value: Any, neutral: Any) -> bool:
    if value is None:
        return True
    if neutral is None or not isinstance(value, (int, float)):
        return False
    return math.isclose(value, neutral, rel_tol=1e-6)


def _check_neutral_fields(model: ModelConfig) -> None:
    read = (GEMMA_FIELDS if model.architecture in GEMMA_ARCHITECTURES  # fields its layers compute
            else GRANITE_FIELDS if model.architecture == "GraniteForCausalLM"
            else ("clip_qkv",) if model.architecture in CLIP_QKV
            else ("use_qk_norm",) if model.architecture in QK_NORM_FLAG  # q/k norms their layers compute
            else READ_FIELDS.get(model.architecture, ()))
    for name, (feature, neutral) in _neutral_values(model).items():
        if name in read:
            continue
        value = model.raw.get(name)
        if not _is_neutral(value, neutral):
            raise ValueError(f"{feature} ({name}={value!r} in config.json) is {_NOT_YET}: the "
                             f"{model.architecture} layers compute without it")


# Checkpoint tensors' last name component -> the quantization scheme that stores it (bitsandbytes' 4-bit quant
# state also ends `quant_state.bitsandbytes__nf4` / `__fp4`). KV cache scales where a decoder layer's attention has
# them are read, not refused (engine.quantization.kv_scales); these names anywhere else are.
_KV_SCALE = "fp8 KV cache"
_QUANT_TENSORS = {
    "weight_scale_inv": "block-wise fp8", "weight_scale": "fp8 or compressed-tensors",
    "weight_scale_2": "ModelOpt fp4", "input_scale": "fp8 (static activation scales)",
    "output_scale": "fp8", "k_scale": _KV_SCALE, "v_scale": _KV_SCALE, "kv_scale": _KV_SCALE,
    "qweight": "GPTQ/AWQ int4", "qzeros": "GPTQ/AWQ int4", "scales": "GPTQ/AWQ int4", "g_idx": "GPTQ",
    "weight_packed": "compressed-tensors", "weight_zero_point": "compressed-tensors",
    "weight_shape": "compressed-tensors", "weight_global_scale": "NVFP4", "input_global_scale": "NVFP4",
    "SCB": "bitsandbytes int8", "weight_format": "bitsandbytes int8", "absmax": "bitsandbytes 4-bit",
    "quant_map": "bitsandbytes 4-bit", "nested_absmax": "bitsandbytes 4-bit", "nested_quant_map": "bitsandbytes 4-bit",
}
# safetensors dtype names the model's float parameters take (copied and cast exactly)
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def quantization_scheme(tensor: str) -> str | None:
    """The quantization scheme a checkpoint tensor's name says it belongs to, or None."""
    leaf = tensor.rsplit(".", 1)[-1]
    return _QUANT_TENSORS.get(leaf) or ("bitsandbytes 4-bit" if leaf.startswith("bitsandbytes__") else None)


def check_tensor_dtype(tensor: str, dtype: str, path: str) -> None:
    """Raises ValueError unless `dtype` (a safetensors dtype name) is a float our parameters can hold."""
    if dtype in _FLOAT_DTYPES:
        return
    if dtype == "F8_E4M3":
        raise ValueError(f"tensor {tensor!r} in {path} is stored as {dtype}, but config.json declares no fp8 "
                         "quantization (quantization_config with quant_method 'fp8' and its scales): read as plain "
                         f"floats it would answer wrong; {_UNQUANTIZED}")
    kind = "fp8 (e5m2)" if dtype.startswith("F8") else "low-bit float" if dtype.startswith("F") else "integer (packed)"
    raise ValueError(f"tensor {tensor!r} in {path} is stored as {dtype}, but {kind} quantized weights are {_NOT_YET} "
                     f"(and config.json declares no quantization); {_UNQUANTIZED}")


def check_unexpected_tensors(tensors: list[str], model: ModelConfig) -> None:
    """Raises ValueError if the checkpoint holds tensors the model has no parameter for: quantization data first
    (named with its scheme), then any other weight, since a model served without weights it has answers wrong."""
    for tensor in tensors:
        scheme = quantization_scheme(tensor)
        if scheme == _KV_SCALE:
            raise ValueError(f"tensor {tensor!r} in {model.path} looks like an fp8 KV cache scale, but not one of a "
                             "decoder layer's attention (radixmesh reads model.layers.<i>.self_attn.k_scale, v_scale, "
                             "kv_scale, k_proj.output_scale, v_proj.output_scale): serving without it may answer wrong")
        if scheme:
            raise ValueError(f"tensor {tensor!r} in {model.path} holds {scheme} quantization data, but quantized "
                             f"weights are {_NOT_YET}; {_UNQUANTIZED}")
    if tensors:
        shown = ", ".join(tensors[:8]) + (f" and {len(tensors) - 8} more" if len(tensors) > 8 else "")
        raise ValueError(f"checkpoint {model.path} holds {len(tensors)} tensor(s) that radixmesh's "
                         f"{model.architecture} has no parameter for ({shown}): serving without them would answer "
                         "wrong (do config.json's architectures and num_hidden_layers match the weights?)")
