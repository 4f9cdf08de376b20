"""GPT-OSS (GptOssForCausalLM): a mixture of experts in every layer, attention with sinks over alternating sliding
and full layers.

Differences from Llama, all of transformers' GptOss code:
- attention: q/k/v/o biases; each query head's sink, a learned logit that joins its softmax's denominator and
  weighs no value (the attention backends take it: engine.attention.base, kernels.online_softmax); every other layer
  from layer 0 slides over `sliding_window` tokens (layer_types says where config.json lists them); YaRN RoPE
  (its `truncate: false` correction range) on whole heads, rotate-half;
- every layer's MLP is `mlp`: a router with a bias (`mlp.router`, the model dtype) whose top `num_experts_per_tok`
  logits are softmaxed into the weights (the same weights as a softmax over all experts renormalized over the top
  ones), and experts with biases on both products whose activation is the clamped SwiGLU (gate clamped above at
  `swiglu_limit`, up to [-limit, limit], (up + 1) * gate * sigmoid(`swiglu_alpha` * gate):
  kernels.moe_extras.ExpertExtras);
- the checkpoint holds each layer's experts stacked: `mlp.experts.gate_up_proj` [experts, hidden, 2 x inter] with
  gate and up columns interleaved, `down_proj` [experts, inter, hidden], transposed against a linear layer's
  weight, and their biases. They load as stored (cut for tensor or expert parallelism) and become
  engine.layers.moe.FusedMoE's `w13` / `w2` right after (`after_load`), so its kernels and twin run them.

Published GPT-OSS checkpoints hold the experts in MXFP4 (`quantization_config.quant_method: mxfp4`), which is refused
by name (engine.models.support); the bf16 checkpoints (and MXFP4 ones dequantized to bf16) are served. The experts
stay in the model dtype under `--quantization fp8` (kernels.moe_fp8 computes neither their biases nor their
activation); the attention's projections go fp8 as any model's.
"""

from __future__ import annotations

import torch
from torch import nn

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.layers.linear import WHOLE, Shard
from radixmesh.engine.layers.moe import ExpertNames, FusedMoE
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.llama import Attention, DecoderSpec
from radixmesh.engine.models.moe import MoeForCausalLM, Router, SparseMoeBlock
from radixmesh.kernels.moe_extras import ExpertExtras


class GptOssAttention(Attention):
    """Llama's attention with biases on every projection and a sink per query head (`sinks`, this rank's heads)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__(cfg, DecoderSpec(qkv_bias=True), layer_id, tp)
        self.heads_from, _ = tp.shard(cfg.num_heads, "the number of attention heads")
        self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def checkpoint_shards(self, leaf: str) -> list[tuple[str | None, Shard]]:
        return [(None, Shard(None, 0, self.heads_from, self.num_heads))]


class BiasedRouter(Router):
    """The router's weight and bias (checkpoint: `mlp.router.weight`, `mlp.router.bias`), whole on every rank."""

    def __init__(self, num_experts: int, hidden: int):
        super().__init__(num_experts, hidden)
        self.bias = nn.Parameter(torch.empty(num_experts))

    def checkpoint_shards(self, leaf: str) -> list[tuple[str | None, Shard]]:
        return [("router", WHOLE)]


class GptOssExperts(FusedMoE):
    """A layer's experts as GPT-OSS stores them while the checkpoint loads (module docstring), FusedMoE's stacked
    `w13` [experts, 2 x inter, hidden] (gate rows, then up rows) and `w2` [experts, hidden, inter] after, with the
    biases and the clamped SwiGLU in `extras`. Under tensor parallelism a rank reads its intermediate columns (gate
    and up interleaved, so one contiguous run of 2 x its share) and rank 0 alone adds the down bias; under expert
    parallelism a rank reads its experts whole."""

    holds_fp8 = False  # (kernels.moe_fp8 computes neither the biases nor the activation)

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        nn.Module.__init__(self)  # (FusedMoE's placement, not its per-expert checkpoint tensors)
        moe, hidden = cfg.moe, cfg.hidden_size
        start, local = self._place(moe.num_experts, moe.intermediate_size, tp, "intermediate_size")
        if tp.config.expert_parallel:
            experts = Shard(None, 0, self.first, self.local_experts)
            self._shards = {"gate_up_proj": experts, "gate_up_proj_bias": experts, "down_proj": experts,
                            "down_proj_bias": experts}
        else:
            self._shards = {"gate_up_proj": Shard(None, 2, 2 * start, 2 * local),
                            "gate_up_proj_bias": Shard(None, 1, 2 * start, 2 * local),
                            "down_proj": Shard(None, 1, start, local), "down_proj_bias": WHOLE}
        e = self.local_experts
        self.gate_up_proj = nn.Parameter(torch.empty(e, hidden, 2 * local))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * local))
        self.down_proj = nn.Parameter(torch.empty(e, local, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(e, hidden))
        self.alpha, self.limit = float(cfg.raw["swiglu_alpha"]), float(cfg.raw["swiglu_limit"])

    def checkpoint_shards(self, leaf: str) -> list[tuple[str | None, Shard]]:
        return [(None, self._shards[leaf])]

    def after_load(self) -> None:
        """The stored layout made FusedMoE's, one layer at a time (a layer's experts twice, briefly: each gate and up
        half copied straight into its rows)."""
        gate_up, bias = self.gate_up_proj.data, self.gate_up_proj_bias.data
        experts, hidden, two_inter = gate_up.shape
        w13 = gate_up.new_empty((experts, two_inter, hidden))
        w13[:, :two_inter // 2].copy_(gate_up[..., 0::2].transpose(1, 2))
        w13[:, two_inter // 2:].copy_(gate_up[..., 1::2].transpose(1, 2))
        b13 = torch.cat([bias[..., 0::2], bias[..., 1::2]], dim=1)
        del self.gate_up_proj, self.gate_up_proj_bias
        self.w13 = _Held(w13)
        self.w2 = _Held(self.down_proj.data.transpose(1, 2).contiguous())
        down_bias = self.down_proj_bias.data
        del self.down_proj, self.down_proj_bias
        keeps_down_bias = self.tp.config.expert_parallel or self.tp.rank == 0
        self.register_buffer("b13", b13)  # (buffers: counted and moved with the model's tensors)
        self.register_buffer("b2", down_bias if keeps_down_bias else None)
        self.extras = ExpertExtras(self.b13, self.b2, self.alpha, self.limit)


class _Held(nn.Module):
    """A stacked weight made after the load (no checkpoint tensor of its own), as FusedMoE's kernels read it."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.fp8 = None


class GptOssMoeBlock(SparseMoeBlock):
    """The router with its bias and the experts (module docstring); the weights in the activations' dtype."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__(cfg, tp, ExpertNames(), renormalize=True, float32_weights=False)
        self.gate = BiasedRouter(cfg.moe.num_experts, cfg.hidden_size)
        self.experts = GptOssExperts(cfg, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from radixmesh.engine.layers.linear import linear

        logits = linear(x, self.gate.weight, self.gate.bias)
        weights, ids = self.experts.route(logits, self.top_k, True, x.dtype)
        return self._routed(x, weights, ids)

    def _gate_fuses(self, norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor) -> bool:
        return False  # kernels.moe_gate's router has no bias


class GptOssForCausalLM(MoeForCausalLM):
    spec = DecoderSpec(qkv_bias=True)

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__(cfg, tp)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = GptOssAttention(cfg, i, self.tp)

    def sparse_block(self, cfg: ModelConfig) -> nn.Module:
        return GptOssMoeBlock(cfg, self.tp)

    def attention_sinks(self) -> list[torch.Tensor]:
        """Each layer's sinks (this rank's heads), for the attention backend (AttentionBackend.attach_sinks)."""
        return [layer.self_attn.sinks for layer in self.model.layers]
