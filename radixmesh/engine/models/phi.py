"""Phi-1, Phi-1.5 and Phi-2 (PhiForCausalLM, transformers' modeling_phi): a parallel-residual LayerNorm decoder
(engine.models.layernorm_decoder) with biases everywhere.

What sets it apart from Llama:
- LayerNorms with a bias (layer_norm_eps), one per layer, read by attention and MLP alike; the block adds
  (attn(x) + mlp(x)) + h, in that order; the final norm is `model.final_layernorm`;
- q, k, v and the output projection (`dense`) have biases;
- RoPE rotates the first int(head_dim * partial_rotary_factor) dimensions of each head (default 0.5);
- under qk_layernorm, q and k are LayerNormed per head before RoPE, by one LayerNorm with a bias shared by every q
  head (`q_layernorm`) and one by every k head (`k_layernorm`);
- an un-gated MLP, fc2(gelu(fc1(x))) with biases, GELU as hidden_act names it (gelu_new by default);
- the output layer has a bias (lm_head.bias).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.layers.activation import GELUS
from radixmesh.engine.layers.linear import WHOLE, ColumnParallelLinear, ParallelLMHead, RowParallelLinear, Shard
from radixmesh.engine.layers.linear import VocabParallelEmbedding, vocab_logits
from radixmesh.engine.layers.norm import LayerNorm
from radixmesh.engine.layers.rotary import RopeInputs
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.layernorm_config import LayerNormSpec, layernorm_spec
from radixmesh.engine.models.layernorm_decoder import LayerNormForCausalLM, ParallelDecoderLayer, attention
from radixmesh.engine.models.llama import Attention, pre_norm


class StoredLayerNorm(LayerNorm):
    """A LayerNorm with a bias that the checkpoint stores under another name beside it (`stored`)."""

    def __init__(self, dim: int, eps: float, stored: str):
        super().__init__(dim, eps, True)
        self.stored = stored

    def checkpoint_shards(self, leaf: str) -> list[tuple[str | None, Shard]]:
        return [(self.stored, WHOLE)]


class DenseLinear(RowParallelLinear):
    """The attention output projection, stored as `dense`."""

    def checkpoint_shards(self, leaf: str) -> list[tuple[str | None, Shard]]:
        return [("dense", shard) for _, shard in super().checkpoint_shards(leaf)]


class BiasedLMHead(ParallelLMHead):
    """The LM head with its bias, both cut to this rank's share of the vocabulary."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel):
        super().__init__(vocab_size, hidden, tp)
        self.bias = nn.Parameter(torch.empty(self.per_rank))


class PhiMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerNormSpec, tp: TensorParallel):
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, True, tp, "intermediate_size")
        self.fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, True, tp, "intermediate_size")
        self.act = GELUS[spec.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class PhiDecoderLayer(ParallelDecoderLayer):
    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: RopeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(attn(x) + mlp(x), the residual before them): the next norm adds them, as transformers' Phi rounds."""
        hidden, residual = pre_norm(self.input_layernorm, hidden, residual)
        return self.self_attn(hidden, rope) + self.mlp(hidden), residual


def phi_attention(cfg: ModelConfig, spec: LayerNormSpec, layer_id: int, tp: TensorParallel) -> Attention:
    attn = attention(cfg, dataclasses.replace(spec, qk_norm=False), layer_id, tp)
    attn.o_proj = DenseLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, True, tp,
                              "the number of attention heads x head_dim")
    if spec.qk_norm:
        attn.q_norm = StoredLayerNorm(cfg.head_dim, spec.eps, "q_layernorm")
        attn.k_norm = StoredLayerNorm(cfg.head_dim, spec.eps, "k_layernorm")
    return attn


class PhiModel(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerNormSpec, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            PhiDecoderLayer(phi_attention(cfg, spec, i, tp), PhiMLP(cfg, spec, tp), cfg.hidden_size, spec)
            for i in range(cfg.num_layers))
        self.norm = StoredLayerNorm(cfg.hidden_size, spec.eps, "final_layernorm")


class PhiForCausalLM(LayerNormForCausalLM):
    """Llama's forward over Phi's layers (module docstring); tied output layers are refused by
    engine.models.layernorm_config."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__(cfg, tp)
        self.lm_head = BiasedLMHead(cfg.vocab_size, cfg.hidden_size, self.tp)

    def body(self, cfg: ModelConfig) -> nn.Module:
        self.layout = spec = layernorm_spec(cfg)
        return PhiModel(cfg, spec, self.tp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> float32 logits [n, vocab], the head's bias added."""
        return vocab_logits(self.tp, hidden, self.lm_head.weight, self.config.vocab_size, self.lm_head.bias)
