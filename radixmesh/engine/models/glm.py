"""GLM-4 (GlmForCausalLM: glm-4-9b; Glm4ForCausalLM: GLM-4-0414), transformers' modeling_glm / modeling_glm4: the
Llama decoder with

- biases on q, k and v (attention_bias, default true) and none on the output projection;
- RoPE on the first int(head_dim * partial_rotary_factor) dimensions of each head (default 0.5), rotating interleaved
  pairs (2i, 2i + 1) in the model dtype (engine.layers.rotary);
- the MLP's gate and up projections stored as one gate_up_proj tensor, as Phi-3's (engine.models.phi3);
- Glm4 only: each sublayer's output RMS-normed before it joins the residual stream (post_self_attn_layernorm,
  post_mlp_layernorm), beside Llama's pre-norms (input_layernorm, post_attention_layernorm).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.layers.norm import RMSNorm
from radixmesh.engine.layers.rotary import RopeInputs, RotaryEmbedding
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.llama import DecoderModel, DecoderSpec, LlamaForCausalLM, pre_norm
from radixmesh.engine.models.phi3 import FusedGateUpLinear


class GlmForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__(cfg, tp)
        for layer in self.model.layers:  # silu(gate) * up, read from the fused checkpoint tensor
            layer.mlp.gate_up_proj = FusedGateUpLinear(cfg, self.tp)

    def body(self, cfg: ModelConfig) -> nn.Module:
        """Llama's decoder with q/k/v biases (GlmConfig's attention_bias) and an output projection without one."""
        spec = DecoderSpec(qkv_bias=bool(cfg.raw.get("attention_bias", True)))
        return DecoderModel(dataclasses.replace(cfg, attention_bias=False), spec, self.tp)

    def init_rotary(self, max_positions: int, device: torch.device) -> None:
        self.rotary = RotaryEmbedding.for_model(self.config, max_positions, device, interleaved=True,
                                                upcast_pairs=False)


class Glm4DecoderLayer(nn.Module):
    """Llama's decoder layer (its modules, taken over) with the sublayers' outputs normed too."""

    def __init__(self, llama_layer: nn.Module, cfg: ModelConfig):
        super().__init__()
        self.self_attn, self.mlp = llama_layer.self_attn, llama_layer.mlp
        self.input_layernorm = llama_layer.input_layernorm
        self.post_attention_layernorm = llama_layer.post_attention_layernorm
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: RopeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's normed MLP output, the residual before it), as Llama's DecoderLayer."""
        hidden, residual = pre_norm(self.input_layernorm, hidden, residual)
        hidden = self.post_self_attn_layernorm(self.self_attn(hidden, rope))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.post_mlp_layernorm(self.mlp(hidden)), residual


class Glm4ForCausalLM(GlmForCausalLM):
    def body(self, cfg: ModelConfig) -> nn.Module:
        model = super().body(cfg)
        model.layers = nn.ModuleList(Glm4DecoderLayer(layer, cfg) for layer in model.layers)
        return model
