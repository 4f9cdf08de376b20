"""Phi-3 (Phi3ForCausalLM): the Llama decoder with q/k/v and gate/up fused in the checkpoint too.

Phi-3 computes what Llama computes (RMSNorm before attention and MLP, SiLU-gated MLP, no biases, RoPE with LongRoPE
scaling for its long-context versions: engine.layers.rope_scaling). Its checkpoint stores the attention input
projection as one `qkv_proj` tensor (rows: the q, then k, then v of every head) and the MLP's as one `gate_up_proj`
(gate rows, then up rows). Our fused layers hold the same rows per rank; here they say where their parts sit in
the fused tensors, so each rank reads only its own rows of them.
"""

from __future__ import annotations

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, Shard
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.llama import LlamaForCausalLM


def _fused(parts: list[tuple[str, Shard]], name: str, offsets: dict[str, int]) -> list[tuple[str, Shard]]:
    """`parts` (separate checkpoint tensors) as parts of the fused tensor `name`, each at its row offset."""
    return [(name, Shard(s.dest, s.dim, s.start + offsets[part], s.length)) for part, s in parts]


class FusedQKVLinear(QKVParallelLinear):
    """QKVParallelLinear read from one qkv_proj tensor: rows [0, q) the query heads, then the key and value heads."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, False, tp)
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self._offsets = {"q_proj": 0, "k_proj": q, "v_proj": q + kv}

    def checkpoint_shards(self, leaf: str) -> list[tuple[str, Shard]]:
        return _fused(super().checkpoint_shards(leaf), "qkv_proj", self._offsets)


class FusedGateUpLinear(MergedColumnParallelLinear):
    """MergedColumnParallelLinear read from one gate_up_proj tensor: the gate rows, then the up rows."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__(cfg.hidden_size, cfg.intermediate_size, tp, ("gate_proj", "up_proj"))
        self._offsets = {"gate_proj": 0, "up_proj": cfg.intermediate_size}

    def checkpoint_shards(self, leaf: str) -> list[tuple[str, Shard]]:
        return _fused(super().checkpoint_shards(leaf), "gate_up_proj", self._offsets)


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__(cfg, tp)
        for layer in self.model.layers:  # the same products, read from the fused checkpoint tensors
            layer.self_attn.qkv_proj = FusedQKVLinear(cfg, self.tp)
            layer.mlp.gate_up_proj = FusedGateUpLinear(cfg, self.tp)
