"""GLM-4.5 and GLM-4.5-Air (Glm4MoeForCausalLM): a mixture of experts routed by group-limited sigmoid scores.

Differences from Llama, all of transformers' Glm4Moe code:
- attention: q/k/v biases with `attention_bias` (o_proj has none), per-head q/k RMSNorm with `use_qk_norm` (as
  Qwen3), RoPE on the first half of each head's dimensions (`partial_rotary_factor`, 0.5 by default; rotate-half);
- the first `first_k_dense_replace` layers keep a dense MLP (`intermediate_size`); every later one is sparse;
- a sparse layer's router keeps its [experts, hidden] weight and a per-expert `e_score_correction_bias` in float32
  and computes its logits in float32; each expert's score is the logit's sigmoid, the choice adds the bias, the
  experts of the best `topk_group` of `n_group` groups compete (a group scores its two best choices), the top
  `num_experts_per_tok` choices weigh by their scores (renormalized with `norm_topk_prob`), times
  `routed_scaling_factor` (engine.models.moe.BiasRoutedMoeBlock);
- the experts' outputs are weighed in float32, and an ungated shared expert (`n_shared_experts` x
  `moe_intermediate_size` wide, `shared_experts.*` in the checkpoint) is added to them.
Published checkpoints also hold `num_nextn_predict_layers` multi-token-prediction layers after the last decoder layer
(`model.layers.<num_hidden_layers + i>.*`); they serve only its own speculative decoding (engine.speculative.nextn,
whose head holds one sparse layer: `glm_decoder_layer`) and are skipped at load.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.llama import DecoderLayer, DecoderModel, DecoderSpec
from radixmesh.engine.models.moe import MoeForCausalLM, NextnLayers, noaux_tc_block


def _spec(cfg: ModelConfig) -> DecoderSpec:
    return DecoderSpec(qkv_bias=cfg.attention_bias, qk_norm=bool(cfg.raw.get("use_qk_norm")))


def glm_decoder_layer(cfg: ModelConfig, tp: TensorParallel) -> DecoderLayer:
    """One sparse GLM-4.5 decoder layer alone (the multi-token-prediction head's): layer 0 of a cache of its own."""
    layer = DecoderLayer(dataclasses.replace(cfg, attention_bias=False), _spec(cfg), 0, tp)
    layer.mlp = noaux_tc_block(cfg, tp)
    return layer


class Glm4MoeForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__(cfg, tp)
        self.skipped_tensors = NextnLayers(cfg.num_layers)

    def body(self, cfg: ModelConfig) -> nn.Module:
        return DecoderModel(dataclasses.replace(cfg, attention_bias=False), _spec(cfg), self.tp)  # (o_proj: no bias)

    def sparse_block(self, cfg: ModelConfig) -> nn.Module:
        return noaux_tc_block(cfg, self.tp)
