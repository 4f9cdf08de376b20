"""dots.llm1 (Dots1ForCausalLM): Qwen3's attention over GLM-4.5's (and DeepSeek-V3's) mixture of experts.

Differences from Llama, all of transformers' Dots1 code:
- per-head q/k RMSNorm before RoPE (as Qwen3), q/k/v and o biases with `attention_bias`;
- the first `first_k_dense_replace` layers keep a dense MLP; the others route by group-limited sigmoid scores with a
  float32 router and `e_score_correction_bias`, scaled by `routed_scaling_factor`, plus an ungated shared expert of
  `n_shared_experts` x `moe_intermediate_size` (engine.models.moe.BiasRoutedMoeBlock, as engine.models.glm4_moe);
- layers from `max_window_layers` on slide over `sliding_window` tokens where `layer_types` does not say otherwise
  (engine.models.attention_spec).
"""

from __future__ import annotations

from torch import nn

from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.llama import DecoderSpec
from radixmesh.engine.models.moe import MoeForCausalLM, noaux_tc_block


class Dots1ForCausalLM(MoeForCausalLM):
    spec = DecoderSpec(qk_norm=True)

    def sparse_block(self, cfg: ModelConfig) -> nn.Module:
        return noaux_tc_block(cfg, self.tp)
