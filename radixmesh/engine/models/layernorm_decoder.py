"""Decoders with LayerNorm in place of RMSNorm (Cohere, Cohere 2, StableLM, Starcoder2, Phi): Llama's attention with
the biases and per-head q/k norms each config asks for (engine.models.layernorm_config), a sequential or a parallel
residual block, and Llama's forward (`LlamaForCausalLM.forward`), whose contract both blocks keep: a layer returns (its
last sublayer's output, the residual stream before it), and the next norm adds the two.

- sequential (StableLM by default, Starcoder2): h = h + attn(ln1(h)); h = h + mlp(ln2(h));
- parallel (Cohere, Cohere 2, StableLM under use_parallel_residual): x = ln(h); h = h + attn(x) + mlp(x), added in that
  order (the layer returns (mlp(x), h + attn(x)), whose sum rounds as transformers' does); Phi adds
  (attn(x) + mlp(x)) + h (engine.models.phi).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.layers.linear import QKVParallelLinear, VocabParallelEmbedding
from radixmesh.engine.layers.norm import HeadLayerNorm, LayerNorm
from radixmesh.engine.layers.rotary import RopeInputs, RotaryEmbedding
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.layernorm_config import LayerNormSpec, layernorm_spec
from radixmesh.engine.models.llama import MLP, Attention, DecoderSpec, LlamaForCausalLM, pre_norm


def _first_head(qkv: QKVParallelLinear, part: str, head_dim: int) -> int:
    """The checkpoint's index of this rank's first head of `part` (q_proj or k_proj)."""
    return dict(qkv.checkpoint_shards("weight"))[part].start // head_dim


def attention(cfg: ModelConfig, spec: LayerNormSpec, layer_id: int, tp: TensorParallel,
              per_head: tuple[str, str] | None = None) -> Attention:
    """Llama's attention with `spec`'s biases and, under spec.qk_norm, a LayerNorm per q and k head before RoPE;
    `per_head`: the checkpoint names of q's and k's norms when it stores one tensor per head (engine.layers.norm)."""
    attn = Attention(dataclasses.replace(cfg, attention_bias=spec.o_bias), DecoderSpec(qkv_bias=spec.qkv_bias),
                     layer_id, tp)
    if spec.qk_norm:
        hd, names = cfg.head_dim, per_head or (None, None)
        attn.q_norm = HeadLayerNorm(attn.num_heads, hd, spec.eps, _first_head(attn.qkv_proj, "q_proj", hd),
                                    cfg.num_heads, names[0])
        attn.k_norm = HeadLayerNorm(attn.num_kv_heads, hd, spec.eps, _first_head(attn.qkv_proj, "k_proj", hd),
                                    cfg.num_kv_heads, names[1])
    return attn


class SequentialDecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: nn.Module, hidden: int, spec: LayerNormSpec):
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm = LayerNorm(hidden, spec.eps, spec.norm_bias)
        self.post_attention_layernorm = LayerNorm(hidden, spec.eps, spec.norm_bias)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: RopeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual before it), as Llama's DecoderLayer."""
        hidden, residual = pre_norm(self.input_layernorm, hidden, residual)
        hidden, residual = self.post_attention_layernorm(self.self_attn(hidden, rope), residual)
        return self.mlp(hidden), residual


class ParallelDecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: nn.Module, hidden: int, spec: LayerNormSpec):
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm = LayerNorm(hidden, spec.eps, spec.norm_bias)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: RopeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual plus its attention output): the next norm adds them (module
        docstring)."""
        hidden, residual = pre_norm(self.input_layernorm, hidden, residual)
        return self.mlp(hidden), residual + self.self_attn(hidden, rope)


class LayerNormModel(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerNormSpec, layers: list[nn.Module], tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(layers)
        self.norm = LayerNorm(cfg.hidden_size, spec.eps, spec.norm_bias)


class LayerNormForCausalLM(LlamaForCausalLM):
    """Llama's forward over LayerNorm layers; a family says how its checkpoint names per-head q/k norms, how it
    rotates, and builds its MLP."""

    per_head_norms: tuple[str, str] | None = None  # (q's, k's) checkpoint names when stored one tensor per head
    interleaved_rope = False  # GPT-J's rotation pairs (engine.layers.rotary)

    def mlp(self, cfg: ModelConfig, spec: LayerNormSpec) -> nn.Module:
        return MLP(cfg.hidden_size, cfg.intermediate_size, self.tp)

    def body(self, cfg: ModelConfig) -> nn.Module:
        self.layout = spec = layernorm_spec(cfg)
        block = ParallelDecoderLayer if spec.parallel else SequentialDecoderLayer
        layers = [block(attention(cfg, spec, i, self.tp, self.per_head_norms), self.mlp(cfg, spec), cfg.hidden_size,
                        spec) for i in range(cfg.num_layers)]
        return LayerNormModel(cfg, spec, layers, self.tp)

    def init_rotary(self, max_positions: int, device: torch.device) -> None:
        self.rotary = RotaryEmbedding.for_model(self.config, max_positions, device, self.interleaved_rope)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> float32 logits [n, vocab], times the logit scale (rounded to the model dtype as
        transformers scales them) where the family has one."""
        logits = super().compute_logits(hidden)
        if self.layout.logit_scale == 1.0:
            return logits
        logits = logits * self.layout.logit_scale
        return logits if hidden.dtype == torch.float32 else logits.to(hidden.dtype).float()
