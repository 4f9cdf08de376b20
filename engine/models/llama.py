"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

Differences within the family are flags on `DecoderSpec`: q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3), tied
embeddings. q/k/v and gate/up projections are fused; the loader maps Hugging Face tensor names onto the fused weights.
Model `forward` takes flat input ids and positions; attention reads its batch layout from the forward context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.forward_context import get_forward_context
from engine.layers.activation import silu_and_mul
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RopeInputs, RotaryEmbedding


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    qkv_bias: bool = False
    qk_norm: bool = False


# (fused parameter, checkpoint name, shard id) for weights stored split in Hugging Face checkpoints.
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = spec.qkv_bias or cfg.attention_bias
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if spec.qk_norm else None

    def shard_slices(self) -> dict[str, slice]:
        q, kv = self.q_size, self.kv_size
        return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}

    def forward(self, hidden: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, k)
        out = get_forward_context().attend(self.layer_id, q, k, v.contiguous())
        return self.o_proj(out.reshape(n, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def shard_slices(self) -> dict[int, slice]:
        return {0: slice(0, self.intermediate), 1: slice(self.intermediate, 2 * self.intermediate)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, layer_id: int):
        super().__init__()
        self.self_attn = Attention(cfg, spec, layer_id)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: RopeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream: returns (this layer's MLP output, the residual before it); the next norm adds them,
        which rounds exactly as `hidden + mlp(...)` does."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: DecoderSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    spec = DecoderSpec()

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, self.spec)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None

    def init_rotary(self, max_positions: int, device: torch.device) -> None:
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final hidden states [num_tokens, hidden]."""
        hidden = self.model.embed_tokens(input_ids)
        rope = self.rotary.prepare(positions, hidden.dtype)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, rope)
        return self.model.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> float32 logits [n, vocab]."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def stacked_params(self):
        return STACKED_PARAMS


class MistralForCausalLM(LlamaForCausalLM):
    pass
