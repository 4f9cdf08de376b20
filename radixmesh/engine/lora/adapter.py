"""A LoRA adapter in peft's format, read and checked against the base model before anything is loaded.

peft saves `adapter_config.json` (`peft_type` LORA, `r`, `lora_alpha`, `target_modules`, `use_rslora`, ...) and
`adapter_model.safetensors` with, per adapted projection, `<prefix>.layers.<i>.<block>.<proj>.lora_A.weight`
[r, in_features] and `...lora_B.weight` [out_features, r]. A projection's output becomes
W x + (B (A x)) * scaling, scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), as peft computes it.

What this engine would serve wrong is refused here with the field that says so: DoRA, per-module rank or alpha
patterns, adapted biases, modules other than the attention and MLP projections (embeddings, the LM head, saved
whole modules; in a mixture of experts, its experts, router and shared expert: a sparse layer's adaptable
projections are its attention's, a dense layer's all seven), fan-in/fan-out layouts, a rank over --max-lora-rank,
shapes that do not fit the base model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from radixmesh.engine.model_config import ModelConfig

# peft's module names -> where they live in a decoder layer
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    targets: frozenset[str]  # peft module names it adapts (q_proj, ...)
    # (layer, projection) -> (A [rank, in], B [out, rank]), float32 on the host
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False, default_factory=dict)


def _fail(path: str, message: str) -> None:
    raise ValueError(f"LoRA adapter {path}: {message}")


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each adaptable projection of the base model."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def adaptable(cfg: ModelConfig, layer: int, proj: str) -> bool:
    """Whether `layer` has the projection `proj` to adapt: every attention projection does; the MLP's only where the
    layer's MLP is dense (a mixture of experts' sparse layers hold experts there)."""
    return PROJECTIONS[proj] == "self_attn" or cfg.moe is None or not cfg.moe.sparse(layer)


def _not_adaptable(key: str) -> str:
    if any(f".mlp.{part}" in key for part in ("experts", "gate.", "shared_expert")):
        return (f"tensor {key}: a mixture of experts' experts, router and shared expert cannot be adapted yet (the "
                "attention projections, and the MLP projections of its dense layers, can)")
    return f"tensor {key}: only the attention and MLP projections ({', '.join(PROJECTIONS)}) can be adapted"


def read_config(path: str) -> dict:
    cfg_file = Path(path) / "adapter_config.json"
    if not cfg_file.is_file():
        _fail(path, "no adapter_config.json (a directory peft's save_pretrained wrote is expected)")
    raw = json.loads(cfg_file.read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        _fail(path, f"peft_type {raw.get('peft_type')!r}: only LORA adapters are served")
    if raw.get("target_parameters"):
        _fail(path, f"target_parameters={raw['target_parameters']} (LoRA on parameters, which is how peft adapts a "
              "mixture of experts' fused experts) is not supported: a mixture of experts' experts, router and shared "
              "expert cannot be adapted yet (its attention projections can)")
    for flag, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights")):
        if raw.get(flag):
            _fail(path, f"{flag}=true ({what}) is not supported")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if raw.get(pattern):
            _fail(path, f"{pattern} (per-module ranks or alphas) is not supported")
    if raw.get("bias", "none") != "none":
        _fail(path, f"bias={raw['bias']!r}: adapted biases are not supported")
    if raw.get("modules_to_save"):
        _fail(path, f"modules_to_save={raw['modules_to_save']}: whole saved modules are not supported")
    return raw


def adapted_projections(path: str) -> frozenset[str]:
    """The projections (peft names) an adapter's weights adapt, from its tensors' names (nothing read but the
    safetensors header); ValueError when the file is missing."""
    weights_file = Path(path) / "adapter_model.safetensors"
    if not weights_file.is_file():
        _fail(path, "no adapter_model.safetensors")
    with safe_open(str(weights_file), framework="pt") as f:
        return frozenset(m.group(3) for m in map(_KEY.match, f.keys()) if m is not None and m.group(3) in PROJECTIONS)


def load_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int, allowed: frozenset[str] | None = None
                 ) -> LoraAdapter:
    """The adapter at `path`, checked against the base model `cfg` (ValueError naming the problem)."""
    raw = read_config(path)
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        _fail(path, f"r={rank!r} is not a positive rank")
    if rank > max_rank:
        _fail(path, f"rank {rank} is over --max-lora-rank {max_rank}")
    alpha = raw.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    weights_file = Path(path) / "adapter_model.safetensors"
    if not weights_file.is_file():
        _fail(path, "no adapter_model.safetensors")
    tensors = load_file(str(weights_file))
    shapes = projection_shapes(cfg)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in PROJECTIONS or PROJECTIONS[m.group(3)] != m.group(2):
            _fail(path, _not_adaptable(key))
        layer, proj = int(m.group(1)), m.group(3)
        if layer >= cfg.num_layers:
            _fail(path, f"tensor {key}: the base model has {cfg.num_layers} layers")
        if not adaptable(cfg, layer, proj):
            _fail(path, f"tensor {key}: layer {layer} of {cfg.architecture} is a mixture-of-experts layer, whose MLP "
                  "is its experts (which cannot be adapted yet)")
        parts.setdefault((layer, proj), {})[m.group(4)] = tensor.to(torch.float32)
    weights = {}
    for (layer, proj), ab in parts.items():
        if set(ab) != {"A", "B"}:
            _fail(path, f"layer {layer} {proj}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[proj]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            _fail(path, f"layer {layer} {proj}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                  f"this base model ({cfg.path}: A [{rank}, {fan_in}], B [{fan_out}, {rank}] expected); an adapter "
                  "for another base model?")
        weights[(layer, proj)] = (a, b)
    if not weights:
        _fail(path, "adapter_model.safetensors holds no LoRA weights")
    targets = frozenset(proj for _, proj in weights)
    if allowed is not None and not targets <= allowed:
        _fail(path, f"adapts {', '.join(sorted(targets - allowed))}, outside --lora-target-modules: this engine "
              f"holds LoRA weights for {', '.join(sorted(allowed))} only (the flag's modules; without the flag, those "
              "the adapters of --lora-paths adapt). Start it with --lora-target-modules naming every module the "
              "adapters will need, or all")
    return LoraAdapter(name, path, rank, scaling, targets, weights)
