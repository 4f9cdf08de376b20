"""StarCoder2 (Starcoder2ForCausalLM, transformers' modeling_starcoder2): a sequential LayerNorm decoder
(engine.models.layernorm_decoder).

What sets it apart from Llama:
- LayerNorms with a bias (norm_epsilon);
- an un-gated MLP: c_proj(gelu(c_fc(x))), GELU with the tanh approximation (hidden_act gelu_pytorch_tanh) or exact
  (gelu);
- use_bias (default true) puts a bias on q, k, v, o, c_fc and c_proj;
- every layer slides over sliding_window tokens when the config sets one (engine.models.attention_spec);
- the output layer is tied to the embedding by default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.layernorm_config import LayerNormSpec
from radixmesh.engine.models.layernorm_decoder import LayerNormForCausalLM


class GeluMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerNormSpec, tp: TensorParallel):
        super().__init__()
        self.c_fc = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, spec.mlp_bias, tp,
                                         "intermediate_size")
        self.c_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, spec.mlp_bias, tp, "intermediate_size")
        self.approximate = "tanh" if spec.activation == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class Starcoder2ForCausalLM(LayerNormForCausalLM):
    def mlp(self, cfg: ModelConfig, spec: LayerNormSpec) -> nn.Module:
        return GeluMLP(cfg, spec, self.tp)
