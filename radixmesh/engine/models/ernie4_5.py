"""ERNIE 4.5 (Ernie4_5ForCausalLM) and ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM).

Differences from Llama, all of transformers' Ernie4_5 / Ernie4_5_Moe code:
- RoPE on interleaved pairs (dimensions 2i and 2i + 1 by frequency i, GLM's layout), q and k rotated in float32 with
  cos and sin kept in float32, rounded back once;
- the mixture (from `moe_layer_start_index` to `moe_layer_end_index`, every `moe_layer_interval`-th layer): a float32
  router whose softmax scores plus `moe_statics.e_score_correction_bias` choose the `moe_k` experts, weighed by their
  scores over max(their sum, `moe_norm_min`), cast to the activations' dtype; `moe_num_shared_experts` x
  `moe_intermediate_size` of ungated shared expert added (engine.models.moe.BiasRoutedMoeBlock);
- `use_bias` (biases on every projection) is refused (engine.models.support): our MLPs have none, and no published
  ERNIE 4.5 text model sets it. Multi-token-prediction layers past the last decoder layer are skipped at load.
"""

from __future__ import annotations

import torch
from torch import nn

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.layers.rotary import RotaryEmbedding
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.llama import LlamaForCausalLM
from radixmesh.engine.models.moe import BiasRoutedMoeBlock, MoeForCausalLM, NextnLayers

# transformers' Ernie4_5_MoeConfig default for moe_norm_min
DEFAULT_NORM_MIN = 1e-12


class ErnieRotary:
    """ERNIE 4.5's RoPE table (module docstring)."""

    def init_rotary(self, max_positions: int, device: torch.device) -> None:
        self.rotary = RotaryEmbedding.for_model(self.config, max_positions, device, interleaved=True,
                                                upcast_pairs=True, float32_table=True)


class Ernie4_5ForCausalLM(ErnieRotary, LlamaForCausalLM):
    pass


class Ernie4_5_MoeForCausalLM(ErnieRotary, MoeForCausalLM):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__(cfg, tp)
        self.skipped_tensors = NextnLayers(cfg.num_layers)

    def sparse_block(self, cfg: ModelConfig) -> nn.Module:
        moe = cfg.moe
        norm_min = float(cfg.raw.get("moe_norm_min") or DEFAULT_NORM_MIN)
        return BiasRoutedMoeBlock(cfg, self.tp, self.names, True, scoring="softmax", bias_at="statics",
                                  float32_weights=False, norm_min=norm_min,
                                  shared_intermediate=moe.shared_expert_intermediate_size)
