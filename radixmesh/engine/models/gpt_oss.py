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

Published GPT-OSS checkpoints hold the experts in MXFP4 (`quantization_config.quant_method: mxfp4`:
`..._blocks` codes and `..._scales` beside each). Where Triton's kernels run (a CUDA device, or the interpreter) the
experts stay MXFP4 (`w13`/`w2` are `HeldMxfp4`: kernels.moe_mxfp4 decodes them in registers), loaded as stored and
only reordered (gate rows, then up rows) after; on CPU they are dequantized once after the load; under a
tensor-parallel cut that splits a group of 32 inputs (an intermediate share not a multiple of 32) they are
dequantized as the checkpoint is read (engine.quantization.mxfp4.LazyMxfp4). bf16 checkpoints load as they are. The
experts stay as they are under `--quantization fp8` (kernels.moe_fp8 computes neither their biases nor their
activation); the attention's projections go fp8 as any model's.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.layers.linear import WHOLE, Shard
from radixmesh.engine.layers.moe import ExpertNames, FusedMoE
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.llama import Attention, DecoderSpec
from radixmesh.engine.models.moe import MoeForCausalLM, Router, SparseMoeBlock
from radixmesh.engine.quantization.mxfp4 import GROUP, dequantize, is_mxfp4
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
        self.raw = is_mxfp4(cfg.raw) and start % GROUP == 0 and local % GROUP == 0  # (module docstring)
        e = self.local_experts
        if tp.config.expert_parallel:
            experts = Shard(None, 0, self.first, self.local_experts)
            self._shards = dict.fromkeys(("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias",
                                          *_RAW), experts)
        else:
            rows, groups = Shard(None, 1, 2 * start, 2 * local), Shard(None, 2, start // GROUP, local // GROUP)
            self._shards = {"gate_up_proj": Shard(None, 2, 2 * start, 2 * local), "gate_up_proj_bias": rows,
                            "down_proj": Shard(None, 1, start, local), "down_proj_bias": WHOLE,
                            "gate_up_proj_blocks": rows, "gate_up_proj_scales": rows, "down_proj_blocks": groups,
                            "down_proj_scales": groups}
        if self.raw:  # the stored codes and scales, as stored ([.., out, in / 32, 16] and [.., out, in / 32])
            self.gate_up_proj_blocks = _raw(e, 2 * local, hidden // GROUP, GROUP // 2)
            self.gate_up_proj_scales = _raw(e, 2 * local, hidden // GROUP)
            self.down_proj_blocks = _raw(e, hidden, local // GROUP, GROUP // 2)
            self.down_proj_scales = _raw(e, hidden, local // GROUP)
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(e, hidden, 2 * local))
            self.down_proj = nn.Parameter(torch.empty(e, local, hidden))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * local))
        self.down_proj_bias = nn.Parameter(torch.empty(e, hidden))
        self.alpha, self.limit = float(cfg.raw["swiglu_alpha"]), float(cfg.raw["swiglu_limit"])

    def checkpoint_shards(self, leaf: str) -> list[tuple[str | None, Shard]]:
        return [(None, self._shards[leaf])]

    def after_load(self) -> None:
        """The stored layout made FusedMoE's, one layer at a time (a layer's experts twice, briefly: each gate and up
        half copied straight into its rows)."""
        bias = self.gate_up_proj_bias.data
        b13 = torch.cat([bias[..., 0::2], bias[..., 1::2]], dim=1)
        if self.raw:
            self._after_raw(b13.dtype)
        else:
            gate_up = self.gate_up_proj.data
            experts, hidden, two_inter = gate_up.shape
            w13 = gate_up.new_empty((experts, two_inter, hidden))
            w13[:, :two_inter // 2].copy_(gate_up[..., 0::2].transpose(1, 2))
            w13[:, two_inter // 2:].copy_(gate_up[..., 1::2].transpose(1, 2))
            del self.gate_up_proj
            self.w13 = _Held(w13)
            self.w2 = _Held(self.down_proj.data.transpose(1, 2).contiguous())
            del self.down_proj
        down_bias = self.down_proj_bias.data
        del self.gate_up_proj_bias, self.down_proj_bias
        keeps_down_bias = self.tp.config.expert_parallel or self.tp.rank == 0
        self.register_buffer("b13", b13)  # (buffers: counted and moved with the model's tensors)
        self.register_buffer("b2", down_bias if keeps_down_bias else None)
        self.extras = ExpertExtras(self.b13, self.b2, self.alpha, self.limit)

    def _after_raw(self, dtype: torch.dtype) -> None:
        """MXFP4 codes and scales as loaded -> FusedMoE's row order (gate rows, then up rows), held as they are where
        Triton's kernels read them, else dequantized once."""
        q, s = self.gate_up_proj_blocks.data, self.gate_up_proj_scales.data  # [e, 2 x inter (interleaved), ...]
        experts, two_inter, groups, _ = q.shape
        q13 = torch.cat([q[:, 0::2], q[:, 1::2]], dim=1).reshape(experts, two_inter, groups * GROUP // 2)
        s13 = torch.cat([s[:, 0::2], s[:, 1::2]], dim=1)
        q2 = self.down_proj_blocks.data.flatten(2)
        s2 = self.down_proj_scales.data
        del self.gate_up_proj_blocks, self.gate_up_proj_scales, self.down_proj_blocks, self.down_proj_scales
        if q13.is_cuda or _interpreting():
            self.w13, self.w2 = HeldMxfp4(q13, s13), HeldMxfp4(q2.contiguous(), s2)
        else:  # (a chunk of rows at a time)
            self.w13 = _Held(dequantize(q13.unflatten(-1, (-1, GROUP // 2)), s13, dtype))
            self.w2 = _Held(dequantize(q2.unflatten(-1, (-1, GROUP // 2)), s2, dtype))


def _interpreting() -> bool:
    """Triton's interpreter on (kernels.runtime.interpreting's test, without importing Triton: a CPU install may
    have none)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_RAW = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")


def _raw(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)


class HeldMxfp4(nn.Module):
    """A stacked weight of the experts held in MXFP4 (kernels.moe_mxfp4's layout): codes `q` [experts, N, K / 2] and
    scales `s` [experts, N, K / 32]."""

    mxfp4 = True
    fp8 = None

    def __init__(self, q: torch.Tensor, s: torch.Tensor):
        super().__init__()
        self.q = nn.Parameter(q, requires_grad=False)
        self.s = nn.Parameter(s, requires_grad=False)


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
        return super()._gate_fuses(norm, hidden, residual) and self.gate.bias.dtype == hidden.dtype

    def _fused_gate(self, norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor) -> tuple:
        """kernels.moe_gate with the router's bias: the residual add, the norm, the biased router and the routing in
        one launch."""
        from radixmesh.kernels.moe_gate import moe_gate

        return moe_gate(hidden, residual, norm.weight, norm.eps, self.gate.weight, self.top_k, self.renormalize,
                        self._weights_dtype(hidden), self.gate_counter, pdl=True, router_bias=self.gate.bias)


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
