"""Per-layer scales of an fp8 KV cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): layer i stores
clamp(k / k_scale[i]) rounded to fp8 and reads the stored value times k_scale[i] back (v likewise), so activations
larger than fp8's range (448 for e4m3) or too small for its precision keep their relative precision.

Checkpoints made for an fp8 KV cache hold one float per layer for keys and one for values, named (under the decoder
layer `layers.<i>.self_attn.`, with or without the leading `model.`):
  k_scale, v_scale                        vLLM, SGLang, llm-compressor's kv_cache_scheme, Quark
  kv_scale                                older exporters (AutoFP8): one scale for both
  k_proj.output_scale, v_proj.output_scale  exporters that name the projections' static output scales
  k_proj.k_scale, v_proj.v_scale          NVIDIA ModelOpt
  attn.k_scale, attn.v_scale              vLLM's own module names
A layer the checkpoint gives no scale keeps 1.0 (SGLang's default). The scales are read only when the KV cache is fp8;
a float cache holds the model's values unscaled and ignores them, as SGLang does. Under tensor parallelism every rank
reads the same scalars (one per layer, for all its KV heads); pages moved between tiers or workers as raw bytes are
read with the scales both sides load: the storage tiers' page keys bind a digest of every rank's scales, and a
prefill/decode handoff compares the two workers' (`digest`).

SGLang's `--quantization-param-path` names a JSON file of scales instead (vLLM's format, written by calibration tools
for an fp8_e4m3 cache): {"model_type": ..., "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"<tp rank>":
{"<layer>": scale, ...}, ...}}}, one scale a layer for both keys and values, per tensor-parallel rank (each rank holds
other KV heads). It takes the place of the checkpoint's scales (`from_param_file`)."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable
from typing import NamedTuple

import torch

# name tail after `layers.<i>.self_attn.` -> which scales it sets ("kv": both)
_NAMES = {"k_scale": "k", "v_scale": "v", "kv_scale": "kv", "k_proj.output_scale": "k", "v_proj.output_scale": "v",
          "k_proj.k_scale": "k", "v_proj.v_scale": "v", "attn.k_scale": "k", "attn.v_scale": "v"}
_PATTERN = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\.(" + "|".join(map(re.escape, _NAMES)) + r")$")
_FLOATS = ("F64", "F32", "F16", "BF16")


class KvScales(NamedTuple):
    """Per layer: the scale an fp8 cache's keys and values are stored divided by (1.0 where none is given)."""

    k: tuple[float, ...]
    v: tuple[float, ...]


def kv_scale_of(name: str, num_layers: int) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") for a checkpoint tensor that is a KV cache scale, else None; ValueError for a scale
    of a layer the config does not have."""
    match = _PATTERN.match(name)
    if match is None:
        return None
    layer = int(match.group(1))
    if layer >= num_layers:
        raise ValueError(f"KV cache scale {name!r} belongs to layer {layer}, but config.json has "
                         f"num_hidden_layers={num_layers} (do the config and the weights match?)")
    return layer, _NAMES[match.group(2)]


def check_scale(name: str, dtype: str, shape: tuple[int, ...], where: str) -> None:
    """Raises ValueError unless the tensor (safetensors `dtype` name, `shape`) can be one layer's scale."""
    if dtype not in _FLOATS:
        raise ValueError(f"KV cache scale {name!r} in {where} is stored as {dtype}: a scale is a float")
    if math.prod(shape) != 1:
        raise ValueError(f"KV cache scale {name!r} in {where} has shape {tuple(shape)}: radixmesh reads one scale per "
                         "layer (a scalar or a single element); per-head or per-channel KV cache scales are not "
                         "implemented by radixmesh yet")


def _value(name: str, tensor: torch.Tensor, where: str) -> float:
    value = float(tensor.reshape(()).to(torch.float32))
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"KV cache scale {name!r} in {where} is {value}: a scale must be a positive finite number")
    return value


def _set(scales: list[float | None], layer: int, value: float, name: str) -> None:
    if scales[layer] is not None and scales[layer] != value:
        raise ValueError(f"layer {layer} has two different KV cache scales in the checkpoint ({scales[layer]} and "
                         f"{value}, the second from {name!r})")
    scales[layer] = value


def collect(tensors: Iterable[tuple[str, torch.Tensor]], num_layers: int, where: str) -> tuple[KvScales, int]:
    """The per-layer scales of (name, tensor) pairs that are all KV cache scales (kv_scale_of, check_scale passed),
    and how many layers the checkpoint gave one; 1.0 for the rest."""
    k: list[float | None] = [None] * num_layers
    v: list[float | None] = [None] * num_layers
    for name, tensor in tensors:
        layer, which = kv_scale_of(name, num_layers)
        value = _value(name, tensor, where)
        if "k" in which:
            _set(k, layer, value, name)
        if "v" in which:
            _set(v, layer, value, name)
    given = sum(a is not None or b is not None for a, b in zip(k, v))
    return KvScales(tuple(1.0 if s is None else s for s in k), tuple(1.0 if s is None else s for s in v)), given


def from_param_file(path: str, tp_rank: int, tp_size: int, num_layers: int, model_type: str | None) -> KvScales:
    """This rank's per-layer scales from a --quantization-param-path file (module docstring); ValueError naming what
    does not fit: a file for another cache dtype, model type, TP size or layer count, or a scale that is not one
    positive finite number."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"quantization_param_path {path!r} is not a readable JSON file: {e}") from None
    kv = doc.get("kv_cache") if isinstance(doc, dict) else None
    if not isinstance(kv, dict) or not isinstance(kv.get("scaling_factor"), dict):
        raise ValueError(f"quantization_param_path {path!r} has no kv_cache.scaling_factor map (the file SGLang and "
                         "vLLM read: {\"kv_cache\": {\"dtype\": \"float8_e4m3fn\", \"scaling_factor\": {rank: {layer: "
                         "scale}}}})")
    if kv.get("dtype") != "float8_e4m3fn":
        raise ValueError(f"quantization_param_path {path!r} holds scales for a {kv.get('dtype')!r} KV cache; they are "
                         "for float8_e4m3fn (--kv-cache-dtype fp8_e4m3)")
    file_type = doc.get("model_type")
    if file_type is not None and model_type is not None and file_type != model_type:
        raise ValueError(f"quantization_param_path {path!r} was made for model_type {file_type!r}, but this model is "
                         f"{model_type!r}")
    ranks = kv["scaling_factor"]  # (JSON keys are strings)
    if len(ranks) != tp_size or str(tp_rank) not in ranks:
        raise ValueError(f"quantization_param_path {path!r} has scales for TP ranks {sorted(ranks)}, but the engine "
                         f"runs with tp_size {tp_size} (rank {tp_rank})")
    layers = ranks[str(tp_rank)]
    if not isinstance(layers, dict) or set(layers) != {str(i) for i in range(num_layers)}:
        raise ValueError(f"quantization_param_path {path!r} gives TP rank {tp_rank} scales for layers "
                         f"{sorted(layers) if isinstance(layers, dict) else layers!r}; the model has layers "
                         f"0-{num_layers - 1}, each needs one")
    scales = []
    for i in range(num_layers):
        value = layers[str(i)]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"quantization_param_path {path!r}: layer {i}'s scale is {value!r}, not a number")
        scales.append(_value(f"layer {i}", torch.tensor(float(value)), path))
    return KvScales(tuple(scales), tuple(scales))


def digest(ranks: Iterable[KvScales | None]) -> str | None:
    """A digest of the scale values of each rank in turn (None: 1.0 for every layer), or None where every scale is
    1.0: pages stored under the same values mean the same, wherever the values came from (a checkpoint, a
    --quantization-param-path file, its formatting)."""
    ranks = [r or KvScales((), ()) for r in ranks]
    if all(s == 1.0 for r in ranks for s in r.k + r.v):
        return None
    return hashlib.sha256(repr([(tuple(r.k), tuple(r.v)) for r in ranks]).encode()).hexdigest()[:16]
