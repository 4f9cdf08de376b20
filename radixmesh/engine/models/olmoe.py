"""OLMoE (OlmoeForCausalLM): a Llama-shaped mixture of experts with OLMo 2's q/k norms.

Differences from Llama, all of transformers' Olmoe code:
- q and k are RMS-normalised over the whole projection (every head at once) before RoPE, as in OLMo 2
  (engine.models.olmo2, which also sums the mean square over tensor-parallel ranks), but with Llama's RMSNorm
  numerics: the normed value is rounded to the model dtype, then multiplied by the weight;
- with `clip_qkv`, the normed q and k and the value are clamped to [-clip_qkv, clip_qkv] (OLMo 1 clamps the
  projection before any norm: engine.models.olmo);
- every layer's MLP is a mixture of experts (engine.models.moe: softmax routing over `num_experts`, the top
  `num_experts_per_tok`, renormalised only with `norm_topk_prob`, the weights rounded to the activations' dtype),
  norms before attention and MLP as Llama's.
"""

from __future__ import annotations

import torch

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.moe import MoeForCausalLM
from radixmesh.engine.models.olmo2 import Olmo2Attention, Olmo2RMSNorm


class OlmoeRMSNorm(Olmo2RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._one_rank_kernel(x):  # Llama's numerics over the whole projection: kernels.norm's rmsnorm
            from radixmesh.kernels.norm import rmsnorm

            return rmsnorm(x, self.weight, self.eps)
        return self.weight * self.normed(x).to(x.dtype)


class OlmoeAttention(Olmo2Attention):
    norm = OlmoeRMSNorm

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__(cfg, layer_id, tp)
        self.clip = cfg.raw.get("clip_qkv")

    def normed_qkv(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().normed_qkv(hidden)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        return q, k, v


class OlmoeForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__(cfg, tp)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = OlmoeAttention(cfg, i, self.tp)
