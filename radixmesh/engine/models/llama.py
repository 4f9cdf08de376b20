"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

Differences within the family are flags on `DecoderSpec`: q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3), tied
embeddings. q/k/v and gate/up projections are fused; the loader maps Hugging Face tensor names onto the fused weights.
Model `forward` takes flat input ids and positions; attention reads its batch layout from the forward context.
Under tensor parallelism (engine.distributed) each rank holds its heads, its MLP rows and its vocabulary share
(engine.layers.linear); one rank is the plain model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.forward_context import get_forward_context
from radixmesh.engine.layers.activation import silu_and_mul
from radixmesh.engine.layers.linear import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                            RowParallelLinear, VocabParallelEmbedding, vocab_logits)
from radixmesh.engine.layers.norm import RMSNorm
from radixmesh.engine.layers.rotary import RopeInputs, RotaryEmbedding


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    qkv_bias: bool = False
    qk_norm: bool = False



class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, layer_id: int, tp: TensorParallel):
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = cfg.head_dim
        bias = spec.qkv_bias or cfg.attention_bias
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, bias, tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.attention_bias, tp,
                                        "the number of attention heads x head_dim")
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if spec.qk_norm else None

    def forward(self, hidden: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # in the rotary kernel's launch where it runs
            q, k, rope = rope.norm_qk(q, k, self.q_norm, self.k_norm)
        out = get_forward_context().attend(self.layer_id, q, k, v, rope)
        return self.o_proj(out.reshape(n, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel | None = None):
        super().__init__()
        tp = tp or TensorParallel.single()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, intermediate, tp, ("gate_proj", "up_proj"))
        self.down_proj = RowParallelLinear(intermediate, hidden, False, tp, "intermediate_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def pre_norm(norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's input norm: (normed input, residual). The first layer's input is its own residual; a later
    one's norm adds the previous layer's output to the residual first (one fused kernel where the norm has one)."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, layer_id: int, tp: TensorParallel):
        super().__init__()
        self.self_attn = Attention(cfg, spec, layer_id, tp)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: RopeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream: returns (this layer's MLP output, the residual before it); the next norm adds them,
        which rounds exactly as `hidden + mlp(...)` does."""
        hidden, residual = pre_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(hidden, rope)
        fused = getattr(self.mlp, "forward_with_norm", None)  # an MLP that may take its norm into its own kernels
        if fused is not None:
            return fused(self.post_attention_layernorm, hidden, residual)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    spec = DecoderSpec()

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.config = cfg
        self.tp = tp or TensorParallel.single()
        self.model = self.body(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.tp)
        self.rotary: RotaryEmbedding | None = None

    def body(self, cfg: ModelConfig) -> nn.Module:
        """The decoder under `model.`: embedding, layers, final norm."""
        return DecoderModel(cfg, self.spec, self.tp)

    def init_rotary(self, max_positions: int, device: torch.device) -> None:
        self.rotary = RotaryEmbedding.for_model(self.config, max_positions, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final hidden states [num_tokens, hidden]."""
        hidden = self.model.embed_tokens(input_ids)
        rope = self.rotary.prepare(positions, hidden.dtype)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, rope)
        return self.model.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> float32 logits [n, vocab] (gathered from every rank under tensor parallelism)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return vocab_logits(self.tp, hidden, weight, self.config.vocab_size)


class MistralForCausalLM(LlamaForCausalLM):
    pass
