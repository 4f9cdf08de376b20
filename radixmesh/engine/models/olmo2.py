"""OLMo 2 (Olmo2ForCausalLM): a Llama-shaped decoder that normalises after its sublayers instead of before.

Differences from Llama, all of transformers' Olmo2 code:
- no norm before attention or MLP; each sublayer's output is RMS-normalised, then added to the residual stream:
  h = h + post_attention_layernorm(attn(h)); h = h + post_feedforward_layernorm(mlp(h));
- q and k are RMS-normalised over the whole projection (every head at once), before RoPE;
- its RMSNorm applies the weight in float32, then rounds to the model dtype (Llama rounds first).
Under tensor parallelism a rank holds its heads' share of the q/k norm weights, and the mean square over the whole
projection is summed over the ranks.

On CUDA (one rank) each norm is one kernel (kernels.norm.olmo2_rmsnorm) and each `h + post_norm(sublayer)` one more
(olmo2_post_add): in torch a norm is ~8 launches, four of them a layer.
"""

from __future__ import annotations

import torch
from torch import nn

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.forward_context import get_forward_context
from radixmesh.engine.layers.linear import QKVParallelLinear, RowParallelLinear, Shard, VocabParallelEmbedding
from radixmesh.engine.layers.rotary import RopeInputs
from radixmesh.engine.layers.triton_ops import use_kernels
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.llama import MLP, LlamaForCausalLM


class Olmo2RMSNorm(nn.Module):
    """RMSNorm over the last dim with the weight applied in float32 before the cast back; with `tp` and `shard` it
    holds rows [start, start + length) of the weight of a dim split over the ranks, and normalises over all of it."""

    def __init__(self, dim: int, eps: float, tp: TensorParallel | None = None, shard: Shard | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim if shard is None else shard.length))
        self.eps, self.tp, self.shard = eps, tp, shard

    def checkpoint_shards(self, leaf: str) -> list[tuple[str | None, Shard]]:
        return [(None, self.shard or Shard())]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._one_rank_kernel(x):
            from radixmesh.kernels.norm import olmo2_rmsnorm

            return olmo2_rmsnorm(x, self.weight, self.eps)
        return (self.weight * self.normed(x)).to(x.dtype)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x): OLMo 2's step between sublayers (one launch on CUDA)."""
        if self._one_rank_kernel(x):
            from radixmesh.kernels.norm import olmo2_post_add

            return olmo2_post_add(x, residual, self.weight, self.eps)
        return residual + self(x)

    def _one_rank_kernel(self, x: torch.Tensor) -> bool:
        return use_kernels(x) and (self.tp is None or self.tp.size == 1)

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        """x over the root mean square of its whole last dim (every rank's part of it), in float32."""
        h = x.float()
        if self.tp is None or self.tp.size == 1:
            variance = h.pow(2).mean(-1, keepdim=True)
        else:  # every rank holds as many elements (replicated KV heads counted as often as each other)
            variance = self.tp.all_reduce(h.pow(2).sum(-1, keepdim=True)) / (h.shape[-1] * self.tp.size)
        return h * torch.rsqrt(variance + self.eps)


def _norm_shard(qkv: QKVParallelLinear, part: str) -> Shard:
    """The rows of a q or k norm weight this rank holds: those of its heads in the q_proj / k_proj tensor."""
    shard = dict(qkv.checkpoint_shards("weight"))[part]
    return Shard(None, 0, shard.start, shard.length)


class Olmo2Attention(nn.Module):
    norm = Olmo2RMSNorm  # the q/k norms' class

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__()
        self.layer_id, self.head_dim = layer_id, cfg.head_dim
        bias = cfg.attention_bias
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, bias, tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias, tp,
                                        "the number of attention heads x head_dim")
        eps = cfg.rms_norm_eps
        self.q_norm = self.norm(cfg.num_heads * cfg.head_dim, eps, tp, _norm_shard(self.qkv_proj, "q_proj"))
        self.k_norm = self.norm(cfg.num_kv_heads * cfg.head_dim, eps, tp, _norm_shard(self.qkv_proj, "k_proj"))

    def forward(self, hidden: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.normed_qkv(hidden)
        q = q.view(n, self.num_heads, self.head_dim)  # normalised over all heads, then split
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = get_forward_context().attend(self.layer_id, q, k, v, rope)
        return self.o_proj(out.reshape(n, self.q_size))


    def normed_qkv(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.q_norm(q), self.k_norm(k), v


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, layer_id, tp)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp)
        self.post_attention_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        hidden = self.post_attention_layernorm.add_to(self.self_attn(hidden, rope), hidden)
        return self.post_feedforward_layernorm.add_to(self.mlp(hidden), hidden)


class Olmo2Model(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(Olmo2DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Olmo2ForCausalLM(LlamaForCausalLM):
    def body(self, cfg: ModelConfig) -> nn.Module:
        return Olmo2Model(cfg, self.tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final hidden states [num_tokens, hidden]."""
        hidden = self.model.embed_tokens(input_ids)
        rope = self.rotary.prepare(positions, hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(hidden, rope)
        return self.model.norm(hidden)
