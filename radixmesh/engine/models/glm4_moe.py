"""GLM-4.5 and GLM-4.5-Air (Glm4MoeForCausalLM): a mixture of experts routed by group-limited sigmoid scores.

Differences from Llama, all of transformers' Glm4Moe code:
- attention: q/k/v biases with `attention_bias` (o_proj has none), per-head q/k RMSNorm with `use_qk_norm` (as
  Qwen3), RoPE on the first half of each head's dimensions (`partial_rotary_factor`, 0.5 by default; rotate-half);
- the first `first_k_dense_replace` layers keep a dense MLP (`intermediate_size`); every later one is sparse;
- a sparse layer's router keeps its [experts, hidden] weight and a per-expert `e_score_correction_bias` in float32
  and computes its logits in float32; each expert's score is the logit's sigmoid, the choice adds the bias, the
  experts of the best `topk_group` of `n_group` groups compete (a group scores its two best choices), the top
  `num_experts_per_tok` choices weigh by their scores (renormalized with `norm_topk_prob`), times
  `routed_scaling_factor` (kernels.moe.route_grouped_reference, and route_grouped in one launch);
- the experts' outputs are weighed in float32, and an ungated shared expert (`n_shared_experts` x
  `moe_intermediate_size` wide, `shared_experts.*` in the checkpoint) is added to them.
Published checkpoints also hold `num_nextn_predict_layers` multi-token-prediction layers after the last decoder layer
(`model.layers.<num_hidden_layers + i>.*`); they serve only its own speculative decoding and are skipped at load.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn.functional as F
from torch import nn

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.llama import MLP, DecoderModel, DecoderSpec
from radixmesh.engine.models.moe import MoeForCausalLM, SparseMoeBlock


class SigmoidRouter(nn.Module):
    """The router's [experts, hidden] weight and its per-expert choice bias (checkpoint: `gate.weight`,
    `gate.e_score_correction_bias`), both held in float32 as transformers holds them, whatever the model dtype."""

    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32))


class GroupedMoeBlock(SparseMoeBlock):
    """A sparse layer's MLP routed by group-limited sigmoid scores, plus an ungated shared expert."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, block: MoeForCausalLM):
        moe = cfg.moe
        super().__init__(cfg, tp, block.names, moe.norm_topk_prob, True)
        self.gate = SigmoidRouter(moe.num_experts, cfg.hidden_size)
        shared = moe.shared_expert_intermediate_size
        self.shared_experts = MLP(cfg.hidden_size, shared, tp) if shared else None
        self.groups, self.top_groups, self.scaling = moe.groups, moe.top_groups, moe.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight)
        weights, ids = self.experts.route_grouped(logits, self.gate.e_score_correction_bias, self.top_k, self.groups,
                                                  self.top_groups, self.renormalize, self.scaling)
        return self._routed(x, weights, ids)

    def _gate_fuses(self, norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor) -> bool:
        return False  # kernels.moe_gate routes by softmax

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = super()._routed(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class NextnLayers:
    """The checkpoint names of the layers past the last decoder layer (GLM-4.5's multi-token-prediction layers):
    `name in NextnLayers(n)` for every tensor of `model.layers.<i>.` with i >= n."""

    _LAYER = re.compile(r"model\.layers\.(\d+)\.")

    def __init__(self, num_layers: int):
        self.num_layers = num_layers

    def __contains__(self, name: object) -> bool:
        m = self._LAYER.match(name) if isinstance(name, str) else None
        return m is not None and int(m.group(1)) >= self.num_layers


class Glm4MoeForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        from radixmesh.kernels.moe import check_grouping

        if cfg.moe is not None:
            check_grouping(cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.groups, cfg.moe.top_groups)
        super().__init__(cfg, tp)
        self.skipped_tensors = NextnLayers(cfg.num_layers)

    def body(self, cfg: ModelConfig) -> nn.Module:
        spec = DecoderSpec(qkv_bias=cfg.attention_bias, qk_norm=bool(cfg.raw.get("use_qk_norm")))
        return DecoderModel(dataclasses.replace(cfg, attention_bias=False), spec, self.tp)  # (o_proj: no bias)

    def sparse_block(self, cfg: ModelConfig) -> nn.Module:
        return GroupedMoeBlock(cfg, self.tp, self)
