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
    "OlmoeForCausalLM": "radixmesh.engine.models.olmoe:OlmoeForCausalLM",
    "Glm4MoeForCausalLM": "radixmesh.engine.models.glm4_moe:Glm4MoeForCausalLM",
    "MiniMaxM2ForCausalLM": "radixmesh.engine.models.minimax_m2:MiniMaxM2ForCausalLM",
    "Dots1ForCausalLM": "radixmesh.engine.models.dots1:Dots1ForCausalLM",
    "Ernie4_5_MoeForCausalLM": "radixmesh.engine.models.ernie4_5:Ernie4_5_MoeForCausalLM",
    "Ernie4_5ForCausalLM": "radixmesh.engine.models.ernie4_5:Ernie4_5ForCausalLM",
    "GptOssForCausalLM": "radixmesh.engine.models.gpt_oss:GptOssForCausalLM",
    "DeepseekV2ForCausalLM": "radixmesh.engine.models.deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "radixmesh.engine.models.deepseek:DeepseekV3ForCausalLM",
    "Glm4MoeLiteForCausalLM": "radixmesh.engine.models.deepseek:Glm4MoeLiteForCausalLM",
    "GemmaForCausalLM": "radixmesh.engine.models.gemma:GemmaForCausalLM",
    "Gemma2ForCausalLM": "radixmesh.engine.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "radixmesh.engine.models.gemma:Gemma3ForCausalLM",
    # served text-only (engine.models.gemma)
    "Gemma3ForConditionalGeneration": "radixmesh.engine.models.gemma:Gemma3ForConditionalGeneration",
    "Phi3ForCausalLM": "radixmesh.engine.models.phi3:Phi3ForCausalLM",
    "OlmoForCausalLM": "radixmesh.engine.models.olmo:OlmoForCausalLM",
    "Olmo2ForCausalLM": "radixmesh.engine.models.olmo2:Olmo2ForCausalLM",
    "GraniteForCausalLM": "radixmesh.engine.models.granite:GraniteForCausalLM",
    "CohereForCausalLM": "radixmesh.engine.models.cohere:CohereForCausalLM",
    "StableLmForCausalLM": "radixmesh.engine.models.stablelm:StableLmForCausalLM",
    "Starcoder2ForCausalLM": "radixmesh.engine.models.starcoder2:Starcoder2ForCausalLM",
    "Cohere2ForCausalLM": "radixmesh.engine.models.cohere2:Cohere2ForCausalLM",
    "PhiForCausalLM": "radixmesh.engine.models.phi:PhiForCausalLM",
    "GlmForCausalLM": "radixmesh.engine.models.glm:GlmForCausalLM",
    "Glm4ForCausalLM": "radixmesh.engine.models.glm:Glm4ForCausalLM",
    # speculative decoding's EAGLE draft heads (served only as drafts: --speculative-draft-model-path)
    "LlamaForCausalLMEagle": "radixmesh.engine.speculative.eagle_head:EagleHead",
    "LlamaForCausalLMEagle3": "radixmesh.engine.speculative.eagle_head:Eagle3Head",
    # DeepSeek-V3's multi-token-prediction layer (speculative_algorithm NEXTN, or EAGLE with the model as the draft)
    "DeepseekV3ForCausalLMNextN": "radixmesh.engine.speculative.nextn:NextnHead",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}")
    module, cls = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(module), cls)
