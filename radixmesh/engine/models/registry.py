"""`config.json` architectures -> model class, imported on first use."""

from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": "radixmesh.engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "radixmesh.engine.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "radixmesh.engine.models.qwen:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "radixmesh.engine.models.qwen:Qwen3ForCausalLM",
    "MixtralForCausalLM": "radixmesh.engine.models.moe:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "radixmesh.engine.models.moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "radixmesh.engine.models.moe:Qwen3MoeForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}")
    module, cls = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(module), cls)
