"""MiniMax-M2 (MiniMaxM2ForCausalLM): a mixture of experts in every layer, routed by sigmoid scores with a bias.

Differences from Llama, all of transformers' MiniMaxM2 code:
- q and k are RMS-normalised over the whole projection (every head at once, OLMoE's norm: engine.models.olmoe;
  under tensor parallelism the mean square is summed over the ranks), before RoPE;
- RoPE rotates the first `rotary_dim` dimensions of each head (published configs say `rotary_dim`; transformers 5
  writes it as partial_rotary_factor), rotate-half;
- every layer's MLP is `block_sparse_moe`: Mixtral's expert names (w1 gate, w3 up, w2 down), a router in the model
  dtype whose logits' sigmoid scores the experts, the choice adding the block's `e_score_correction_bias` (held in
  float32), the top `num_experts_per_tok` weighed by their scores renormalized to sum to one, weighed in float32
  (engine.models.moe.BiasRoutedMoeBlock); no shared expert.
Fields of MiniMax's own code that transformers computes one way only are checked to say that way (all layers full
attention, per-layer q/k norms, sigmoid scoring with the routing bias, no shared expert); multi-token-prediction layers
after the last decoder layer are skipped at load.
"""

from __future__ import annotations

from torch import nn

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.layers.moe import ExpertNames
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.moe import BiasRoutedMoeBlock, MoeForCausalLM, NextnLayers
from radixmesh.engine.models.olmoe import OlmoeAttention

_NOT_COMPUTED = "is not what transformers' MiniMaxM2ForCausalLM computes, nor radixmesh"


def check_fields(raw: dict) -> None:
    """ValueError for a MiniMaxM2 config.json field (of MiniMax's own modeling code) set to a value other than the one
    transformers' code computes unconditionally."""
    kinds = raw.get("attn_type_list")
    if kinds is not None and any(k != 1 for k in kinds):
        raise ValueError(f"attn_type_list={kinds} in config.json: layers of type 0 (lightning attention, "
                         f"MiniMax-Text-01's) {_NOT_COMPUTED}: every layer attends in full")
    for field, want in (("qk_norm_type", "per_layer"), ("scoring_func", "sigmoid"), ("use_qk_norm", True),
                        ("use_routing_bias", True)):
        if field in raw and raw[field] != want:
            raise ValueError(f"{field}={raw[field]!r} in config.json {_NOT_COMPUTED} (it computes {field}={want!r})")
    if raw.get("shared_intermediate_size"):
        raise ValueError(f"shared_intermediate_size={raw['shared_intermediate_size']} in config.json: a shared expert "
                         f"{_NOT_COMPUTED}")


class MiniMaxM2ForCausalLM(MoeForCausalLM):
    block = "block_sparse_moe"
    names = ExpertNames(gate="w1", up="w3", down="w2")

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        check_fields(cfg.raw)
        super().__init__(cfg, tp)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = OlmoeAttention(cfg, i, self.tp)
        self.skipped_tensors = NextnLayers(cfg.num_layers)

    def sparse_block(self, cfg: ModelConfig) -> nn.Module:
        return BiasRoutedMoeBlock(cfg, self.tp, self.names, True, bias_at="block")
