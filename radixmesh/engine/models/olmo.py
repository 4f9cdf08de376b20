"""OLMo (OlmoForCausalLM, transformers' modeling_olmo: OLMo-1B-hf, OLMo-7B-hf, OLMo-7B-0424-hf): the Llama decoder
with

- LayerNorms without weight or bias (epsilon 1e-5, whatever the config says), in float32, rounded once, in place of
  Llama's RMSNorms (engine.layers.norm.LayerNorm);
- under clip_qkv, every q, k and v element clamped to [-clip_qkv, clip_qkv] before RoPE; on the fused projection, so a
  rank clamps its own heads.
attention_bias puts a bias on q, k, v and o, as Llama's does. RoPE is Llama's; transformers' OLMo rotates in float32
(its table is not rounded to the model dtype first), which float32 models and the CUDA rotary kernel compute alike.
"""

from __future__ import annotations

import torch

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.layers.linear import QKVParallelLinear
from radixmesh.engine.layers.norm import LayerNorm
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.llama import LlamaForCausalLM

EPS = 1e-5  # transformers' OlmoLayerNorm


class ClippedQKVLinear(QKVParallelLinear):
    """The fused q/k/v projection with every output element clamped to [-clip, clip]."""

    def __init__(self, cfg: ModelConfig, clip: float, tp: TensorParallel):
        super().__init__(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias, tp)
        self.clip = clip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).clamp_(-self.clip, self.clip)


def _plain_norm(hidden: int) -> LayerNorm:
    return LayerNorm(hidden, EPS, bias=False, weight=False)


class OlmoForCausalLM(LlamaForCausalLM):
    """Llama's layers with OLMo's norms and clipping (module docstring)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__(cfg, tp)
        clip = cfg.raw.get("clip_qkv")
        for layer in self.model.layers:
            layer.input_layernorm = _plain_norm(cfg.hidden_size)
            layer.post_attention_layernorm = _plain_norm(cfg.hidden_size)
            if clip is not None:
                layer.self_attn.qkv_proj = ClippedQKVLinear(cfg, float(clip), self.tp)
        self.model.norm = _plain_norm(cfg.hidden_size)
