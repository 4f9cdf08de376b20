"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE. Their attention is their dense family's
(Mistral's, Qwen2's with q/k/v bias, Qwen3's with q/k RMSNorm); the MLP of a sparse layer is a router and stacked
experts (engine.layers.moe), plus, in Qwen2-MoE, a shared expert whose output is gated by a sigmoid. Which layers
are sparse follows the config (Qwen: `mlp_only_layers` are dense, and every `decoder_sparse_step`-th layer is sparse;
Mixtral: all; MoeConfig.sparse). The families whose experts are chosen by scores plus a correction bias (GLM-4.5,
dots.llm1, MiniMax-M2, ERNIE 4.5: their own modules) take `BiasRoutedMoeBlock` here."""

from __future__ import annotations

import os
import re

import torch
import torch.nn.functional as F
from torch import nn

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.forward_context import current_forward_context
from radixmesh.engine.layers.linear import linear
from radixmesh.engine.layers.moe import ExpertNames, FusedMoE
from radixmesh.engine.layers.norm import RMSNorm
from radixmesh.engine.layers.triton_ops import use_kernels
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.llama import MLP, DecoderSpec, LlamaForCausalLM


# One token's post-attention norm, router product and routing in one launch on the GPU (kernels.moe_gate);
# RADIXMESH_MOE_FUSED_GATE=0 runs the three kernels instead (benchmarks compare the two).
FUSED_GATE = os.environ.get("RADIXMESH_MOE_FUSED_GATE", "1") != "0"


class Router(nn.Module):
    """The router's [experts, hidden] weight, whole on every rank (checkpoint: `gate.weight`). Its product is one
    of a decode step's (engine.decode_products times it: at one row on an H100, cuBLAS's took ~5 us a layer)."""

    decode_product = True

    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, names: ExpertNames, renormalize: bool,
                 float32_weights: bool, shared_intermediate: int = 0):
        super().__init__()
        moe = cfg.moe
        self.top_k, self.renormalize, self.float32_weights = moe.top_k, renormalize, float32_weights
        self.gate = Router(moe.num_experts, cfg.hidden_size)
        self.experts = FusedMoE(moe.num_experts, cfg.hidden_size, moe.intermediate_size, tp, names)
        self.shared_expert = MLP(cfg.hidden_size, shared_intermediate, tp) if shared_intermediate else None
        self.shared_expert_gate = Router(1, cfg.hidden_size) if shared_intermediate else None
        self.counts: torch.Tensor | None = None  # tokens routed to each expert so far (expert_counters)
        self.gate_counter: torch.Tensor | None = None  # kernels.moe_gate's arrival counter (made at the first use)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.experts.route(linear(x, self.gate.weight), self.top_k, self.renormalize,
                                          self._weights_dtype(x))
        return self._routed(x, weights, ids)

    def forward_with_norm(self, norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's post-attention norm (`norm`, adding `hidden` to `residual`) and then this block: (its output,
        the new residual). One token on the GPU takes kernels.moe_gate, one launch for the residual add, the norm,
        the router's product and the routing (RADIXMESH_MOE_FUSED_GATE=0: the three kernels, for comparison)."""
        if self._gate_fuses(norm, hidden, residual):
            from radixmesh.kernels.moe_gate import new_counter

            if self.gate_counter is None or self.gate_counter.device != hidden.device:
                self.gate_counter = new_counter(hidden.device)
            x, residual, weights, ids = self._fused_gate(norm, hidden, residual)
            return self._routed(x, weights, ids), residual
        hidden, residual = norm(hidden, residual)
        return self(hidden), residual

    def _fused_gate(self, norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor) -> tuple:
        """(normed row, new residual, routing weights, expert ids) from kernels.moe_gate's one launch."""
        from radixmesh.kernels.moe_gate import moe_gate

        return moe_gate(hidden, residual, norm.weight, norm.eps, self.gate.weight, self.top_k, self.renormalize,
                        self._weights_dtype(hidden), self.gate_counter, pdl=True)

    def _gate_fuses(self, norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor) -> bool:
        return _one_token_gate(self, norm, hidden, residual) and self.gate.weight.dtype == hidden.dtype

    def _weights_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        return None if self.float32_weights else x.dtype

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts (and the shared expert) on the normed rows x, routed by (weights, ids)."""
        if self.counts is not None:  # on the device, no host round trip (and capturable in a CUDA graph)
            self.counts.index_add_(0, ids.flatten(), _real_tokens(x.shape[0], x.device).repeat_interleave(self.top_k))
        out = self.experts(x, weights, ids)
        if self.shared_expert is None:
            return out
        shared, gate = self.shared_expert(x), self.shared_expert_gate.weight
        if use_kernels(x) and gate.dtype == x.dtype:  # the gate's product, sigmoid, product and sum in one launch
            from radixmesh.kernels.moe_shared import gated_shared_add

            return gated_shared_add(out, shared, x, gate)
        return out + torch.sigmoid(linear(x, gate)) * shared


def _one_token_gate(block: SparseMoeBlock, norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether a sparse block's gate may run as kernels.moe_gate's one launch: one contiguous token on the GPU's
    kernels, an RMSNorm of its dtype before it (the router's dtype is each block's own condition)."""
    return (FUSED_GATE and type(norm) is RMSNorm and hidden.dim() == 2 and hidden.shape[0] == 1
            and use_kernels(hidden) and block.experts.backend == "triton"
            and hidden.dtype == residual.dtype == norm.weight.dtype
            and hidden.is_contiguous() and residual.is_contiguous())


def _real_tokens(n: int, device: torch.device) -> torch.Tensor:
    """[n] int64: 1 for a request's token, 0 for a CUDA graph's padding row (it writes the scratch slot 0, which no
    request's token does: engine.cuda_graph_runner)."""
    ctx = current_forward_context()
    if ctx is None or ctx.batch.out_cache_loc.shape[0] != n:
        return torch.ones(n, dtype=torch.int64, device=device)
    return (ctx.batch.out_cache_loc != 0).to(torch.int64)


def expert_counters(model: nn.Module) -> dict[int, torch.Tensor]:
    """Layer index -> a zeroed [experts] int64 counter on the model's device that the layer's router adds each
    token's top-k experts to from now on (--enable-expert-distribution-metrics)."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, SparseMoeBlock):
            gate = layer.mlp.gate.weight
            layer.mlp.counts = torch.zeros(gate.shape[0], dtype=torch.int64, device=gate.device)
            out[i] = layer.mlp.counts
    return out


class NextnLayers:
    """The checkpoint names of the layers past the last decoder layer (multi-token-prediction layers):
    `name in NextnLayers(n)` for every tensor of `model.layers.<i>.` with i >= n."""

    _LAYER = re.compile(r"model\.layers\.(\d+)\.")

    def __init__(self, num_layers: int):
        self.num_layers = num_layers

    def __contains__(self, name: object) -> bool:
        m = self._LAYER.match(name) if isinstance(name, str) else None
        return m is not None and int(m.group(1)) >= self.num_layers


class Float32Router(nn.Module):
    """A router whose [experts, hidden] weight (and, with `bias`, its per-expert choice bias) is held in float32
    whatever the model dtype, as transformers holds GLM-4.5's, dots.llm1's and ERNIE 4.5's (checkpoint: `gate.weight`,
    `gate.e_score_correction_bias`)."""

    def __init__(self, num_experts: int, hidden: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        if bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32))


class CorrectionStatics(nn.Module):
    """ERNIE 4.5's `moe_statics`: the choice bias as a [1, experts] float32 tensor."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.e_score_correction_bias = nn.Parameter(torch.empty(1, num_experts, dtype=torch.float32))


class BiasRoutedMoeBlock(SparseMoeBlock):
    """A sparse layer whose experts are chosen by their scores plus a per-expert correction bias and weighed by their
    scores alone (DeepSeek-V3's noaux_tc rule and its kin): kernels.moe.route_grouped, group-limited with n_group > 1,
    renormalized (by the sum, or by the sum clamped below at `norm_min`), scaled by routed_scaling_factor; plus an
    ungated shared expert (`shared_experts.*`) where `shared_intermediate` > 0.

    `scoring`: "sigmoid" (GLM-4.5, dots.llm1, MiniMax-M2, DeepSeek-V3) or "softmax" (ERNIE 4.5, DeepSeek-V2).
    `bias_at`: where the checkpoint keeps the bias: "gate" (in the float32 router: GLM-4.5, dots.llm1, DeepSeek-V3),
    "block" (MiniMax-M2, whose router is the model dtype's), "statics" (ERNIE 4.5's `moe_statics`) or "none" (no bias:
    DeepSeek-V2, float32 router). `float32_weights`: weigh the experts in float32 (else the weights are cast to the
    activations' dtype first, as ERNIE does). `groups`: the groups to route within (default: the config's n_group);
    `group_best`: a group scores its two best choices (2) or its best (1, DeepSeek-V2)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, names: ExpertNames, renormalize: bool, *,
                 scoring: str = "sigmoid", bias_at: str = "gate", float32_weights: bool = True,
                 norm_min: float = 0.0, shared_intermediate: int = 0, groups: int | None = None,
                 group_best: int = 2):
        from radixmesh.kernels.moe import check_grouping

        moe = cfg.moe
        groups = moe.groups if groups is None else groups
        top_groups = moe.top_groups if groups > 1 else 1
        check_grouping(moe.num_experts, moe.top_k, groups, top_groups, group_best)  # (groups that cannot route)
        super().__init__(cfg, tp, names, renormalize, float32_weights)
        self.float32_router = bias_at != "block"
        if self.float32_router:
            self.gate = Float32Router(moe.num_experts, cfg.hidden_size, bias=bias_at == "gate")
        if bias_at == "block":
            self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts, dtype=torch.float32))
        elif bias_at == "statics":
            self.moe_statics = CorrectionStatics(moe.num_experts)
        self.zero_bias: torch.Tensor | None = None  # bias_at "none": zeros, made at the first use (not a weight)
        self.bias_at, self.softmax, self.norm_min = bias_at, scoring == "softmax", norm_min
        self.shared_experts = MLP(cfg.hidden_size, shared_intermediate, tp) if shared_intermediate else None
        self.groups, self.top_groups, self.group_best, self.scaling = groups, top_groups, group_best, moe.scaling

    def _bias(self) -> torch.Tensor:
        if self.bias_at == "gate":
            return self.gate.e_score_correction_bias
        if self.bias_at == "none":
            if self.zero_bias is None or self.zero_bias.device != self.gate.weight.device:
                self.zero_bias = torch.zeros(self.gate.weight.shape[0], device=self.gate.weight.device)
            return self.zero_bias
        return self.e_score_correction_bias if self.bias_at == "block" else self.moe_statics.e_score_correction_bias[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight) if self.float32_router else linear(x, self.gate.weight)
        weights, ids = self.experts.route_grouped(logits, self._bias(), self.top_k, self.groups, self.top_groups,
                                                  self.renormalize, self.scaling, self.softmax, self.norm_min,
                                                  self.group_best)
        if not self.float32_weights:
            weights = weights.to(x.dtype)
        return self._routed(x, weights, ids)

    def _gate_fuses(self, norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor) -> bool:
        # (a router of the model's dtype, MiniMax-M2's, rounds its logits to that dtype: left to the kernels apart)
        return _one_token_gate(self, norm, hidden, residual) and self.float32_router

    def _fused_gate(self, norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor) -> tuple:
        """kernels.moe_gate.moe_gate_grouped: the residual add, the norm, the float32 router's product and the
        grouped routing in one launch."""
        from radixmesh.kernels.moe_gate import moe_gate_grouped

        x, residual, weights, ids = moe_gate_grouped(
            hidden, residual, norm.weight, norm.eps, self.gate.weight, self._bias(), self.top_k, self.groups,
            self.top_groups, self.renormalize, self.scaling, self.softmax, self.norm_min, self.group_best,
            self.gate_counter, pdl=True)
        return x, residual, (weights if self.float32_weights else weights.to(x.dtype)), ids

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = super()._routed(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def noaux_tc_block(cfg: ModelConfig, tp: TensorParallel) -> BiasRoutedMoeBlock:
    """DeepSeek-V3's noaux_tc block as DeepSeek-V3, GLM-4.5 and dots.llm1 lay it out: sigmoid scores, the bias in the
    float32 router, renormalized with norm_topk_prob, the config's shared expert, the usual expert names."""
    moe = cfg.moe
    return BiasRoutedMoeBlock(cfg, tp, ExpertNames(), moe.norm_topk_prob,
                              shared_intermediate=moe.shared_expert_intermediate_size)


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose sparse layers' MLPs are SparseMoeBlocks (at `block`, the checkpoint's name)."""

    block = "mlp"
    names = ExpertNames()
    renormalize_always = False  # Mixtral; the Qwen models follow norm_topk_prob
    float32_weights = False  # Mixtral weighs the experts' outputs in float32; the Qwen models in the activations' dtype
    shared_expert = False

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture} is a mixture of experts, but config.json gives no num_experts (or "
                             "num_local_experts, n_routed_experts, moe_num_experts): the experts cannot be laid out")
        super().__init__(cfg, tp)
        for i, layer in enumerate(self.model.layers):
            if cfg.moe.sparse(i):
                del layer.mlp
                setattr(layer, self.block, self.sparse_block(cfg))
                if self.block != "mlp":
                    layer.mlp = getattr(layer, self.block)  # the layer's forward calls .mlp

    def sparse_block(self, cfg: ModelConfig) -> nn.Module:
        """A sparse layer's MLP: softmax routing, and Qwen2-MoE's gated shared expert where the class has one."""
        moe = cfg.moe
        return SparseMoeBlock(cfg, self.tp, self.names, self.renormalize_always or moe.norm_topk_prob,
                              self.float32_weights, moe.shared_expert_intermediate_size if self.shared_expert else 0)


class MixtralForCausalLM(MoeForCausalLM):
    block = "block_sparse_moe"
    names = ExpertNames(gate="w1", up="w3", down="w2")
    renormalize_always = True
    float32_weights = True


class Qwen2MoeForCausalLM(MoeForCausalLM):
    spec = DecoderSpec(qkv_bias=True)
    shared_expert = True


class Qwen3MoeForCausalLM(MoeForCausalLM):
    spec = DecoderSpec(qk_norm=True)
