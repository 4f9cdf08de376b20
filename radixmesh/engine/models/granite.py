"""IBM Granite (GraniteForCausalLM): the Llama decoder with four scalars from config.json.

- embedding_multiplier: the token embeddings are multiplied by it;
- residual_multiplier: each sublayer's output is multiplied by it before it joins the residual stream;
- attention_multiplier: the attention score scale, in place of 1 / sqrt(head_dim) (engine.models.attention_spec);
- logits_scaling: the logits are divided by it, in the model dtype as transformers does.
GraniteConfig's defaults are all 1.0, the attention score scale too.
"""

from __future__ import annotations

import torch
from torch import nn

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.layers.linear import VocabParallelEmbedding
from radixmesh.engine.layers.rotary import RopeInputs
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.llama import DecoderLayer, DecoderSpec, LlamaForCausalLM, pre_norm


def multiplier(cfg: ModelConfig, name: str) -> float:
    return cfg.raw.get(name, 1.0)


class ScaledEmbedding(VocabParallelEmbedding):
    """The token embedding times embedding_multiplier (the weight itself is the checkpoint's, tied or not)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__(cfg.vocab_size, cfg.hidden_size, tp)
        self.multiplier = multiplier(cfg, "embedding_multiplier")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.multiplier


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, layer_id: int, tp: TensorParallel):
        super().__init__(cfg, spec, layer_id, tp)
        self.residual_multiplier = multiplier(cfg, "residual_multiplier")

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: RopeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecoderLayer's, with the attention's and the MLP's outputs scaled by residual_multiplier before they
        join the residual stream (the returned pair still sums to the next layer's input)."""
        hidden, residual = pre_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(hidden, rope) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__(cfg, tp)
        self.model.embed_tokens = ScaledEmbedding(cfg, self.tp)
        self.model.layers = nn.ModuleList(GraniteDecoderLayer(cfg, self.spec, i, self.tp)
                                          for i in range(cfg.num_layers))
        self.logits_scaling = multiplier(cfg, "logits_scaling")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> float32 logits [n, vocab], divided by logits_scaling and rounded to the model dtype
        as transformers divides them."""
        logits = super().compute_logits(hidden) / self.logits_scaling
        return logits if hidden.dtype == torch.float32 else logits.to(hidden.dtype).float()
