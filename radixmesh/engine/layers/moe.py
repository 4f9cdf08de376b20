"""Mixture-of-experts MLP: a router picks each token's top-k experts, and the token's output is the weighted sum of
those experts' SiLU MLPs. This is the plain-PyTorch path (also the reference a fused kernel is tested against):
tokens are grouped by expert and each expert runs once on its tokens.

Weights are stacked at load time from the per-expert tensors Hugging Face checkpoints publish: `w13` [experts,
2 x intermediate, hidden] (gate rows, then up rows) and `w2` [experts, hidden, intermediate]. Under tensor
parallelism each rank holds every expert's share of the intermediate dimension (as a dense MLP's rows and columns
are cut) and the partial outputs are summed over the ranks.

The experts run kernels.moe: its grouped-GEMM kernels with --moe-runner-backend triton (the default on a GPU, where
decode runs in CUDA graphs), its plain-torch twin with torch (the default on CPU; graphs off: it reads each step's
experts on the host). Experts of an fp8 checkpoint (or of --quantization fp8) that engine.quantization.fp8_load holds
in fp8, `w13` and `w2` together, run kernels.moe_fp8 the same way (its kernels, a few tokens kernels.moe_decode_fp8's,
or its twin with torch).

Routing follows transformers (kernels.moe.route_reference; `route` in one launch): softmax over the router logits
in float32, the top-k, optionally renormalized to sum to one (Mixtral always; Qwen3-MoE and Qwen2-MoE when
`norm_topk_prob`), then cast to the activations' dtype before weighting (the Qwen models; Mixtral weighs in
float32)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.layers.linear import ELSEWHERE, Shard


@dataclass(frozen=True, slots=True)
class ExpertNames:
    """How a checkpoint names one expert's projections (Mixtral: w1 gate, w3 up, w2 down)."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


class _Stacked(nn.Module):
    """One stacked weight of the experts (`weight`), filled from every expert's checkpoint tensor; held in fp8 with
    a `weight_scale` buffer where `fp8` says so (engine.quantization.fp8_load)."""

    def __init__(self, shape: tuple[int, ...], shards: list[tuple[str, Shard]]):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))
        self._shards = shards
        self.fp8 = None  # engine.quantization.fp8_linear.Fp8Weights once the weight is held in fp8 (fp8_load)

    def checkpoint_shards(self, leaf: str) -> list[tuple[str, Shard]]:
        return self._shards


class FusedMoE(nn.Module):
    """The experts of one layer, stacked (`w13`, `w2`; checkpoint names `experts.<e>.<projection>.weight` beside
    them); `forward(x, weights, ids)` runs the routed tokens. Under tensor parallelism a rank holds every expert's
    share of the intermediate rows, or, with expert parallelism (TPConfig.expert_parallel, --ep-size), whole experts:
    its 1/size of them, the other ranks' checkpoint tensors skipped at load. Either way every rank sees every token
    and the ranks' partial outputs are summed."""

    holds_fp8 = True  # engine.quantization.fp8_load may hold w13 and w2 in fp8 (kernels.moe_fp8 computes them)

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TensorParallel, names: ExpertNames):
        super().__init__()
        start, local = self._place(num_experts, intermediate, tp, "moe_intermediate_size")
        local_experts = self.local_experts
        w13, w2 = [], []
        for e in range(num_experts):
            i = e - self.first
            if not 0 <= i < local_experts:
                w13 += [(f"{e}.{names.gate}", ELSEWHERE), (f"{e}.{names.up}", ELSEWHERE)]
                w2.append((f"{e}.{names.down}", ELSEWHERE))
                continue
            w13 += [(f"{e}.{names.gate}", Shard((i, slice(0, local)), 0, start, local)),
                    (f"{e}.{names.up}", Shard((i, slice(local, 2 * local)), 0, start, local))]
            w2.append((f"{e}.{names.down}", Shard((i,), 1, start, local)))
        self.w13 = _Stacked((local_experts, 2 * local, hidden), w13)
        self.w2 = _Stacked((local_experts, hidden, local), w2)

    def _place(self, num_experts: int, intermediate: int, tp: TensorParallel, label: str) -> tuple[int, int]:
        """Which experts this rank holds (`first`, `local_experts`: all of them, or its whole share under expert
        parallelism) and which run of their intermediate dimension: (start, length); the kernels' defaults."""
        self.tp = tp
        self.backend = "torch"  # or "triton": kernels.moe.fused_experts (--moe-runner-backend)
        self.extras = None  # kernels.moe_extras.ExpertExtras: biases, the clamped SwiGLU (GPT-OSS's experts)
        if tp.config.expert_parallel:
            self.first, self.local_experts = tp.shard(num_experts, "the number of experts")
            return 0, intermediate
        self.first, self.local_experts = 0, num_experts
        return tp.shard(intermediate, label)

    def route(self, logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [tokens, experts] -> (weights, expert ids) [tokens, top_k]: kernels.moe.route (one launch)
        with the triton backend, its twin route_reference otherwise. `dtype`: the weights' (None: float32)."""
        from radixmesh.kernels.moe import route, route_reference

        return (route if self.backend == "triton" else route_reference)(logits, top_k, renormalize, dtype)

    def route_grouped(self, logits: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int, top_groups: int,
                      renormalize: bool, scale: float, softmax: bool = False, norm_min: float = 0.0,
                      group_best: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing by scores plus a choice bias (GLM-4.5, DeepSeek-V2/V3, ERNIE 4.5): kernels.moe.route_grouped with
        the triton backend, its twin route_grouped_reference otherwise; float32 weights."""
        from radixmesh.kernels.moe import route_grouped, route_grouped_reference

        fn = route_grouped if self.backend == "triton" else route_grouped_reference
        return fn(logits, bias, top_k, groups, top_groups, renormalize, scale, softmax, norm_min, group_best)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.config.expert_parallel:  # this rank's experts by local index; the others' slots are -1
            ids = ids - self.first
            ids = torch.where((ids >= 0) & (ids < self.local_experts), ids, -1)
        out = self._experts(x, weights, ids)
        return self.tp.all_reduce(out) if self.tp.size > 1 else out

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the routed tokens: kernels.moe (16-bit experts), kernels.moe_fp8 (fp8 experts) or
        kernels.moe_mxfp4 (MXFP4 experts), the grouped GEMMs with the triton backend, their twin otherwise."""
        elsewhere = self.tp.config.expert_parallel
        if getattr(self.w13, "mxfp4", False):  # GPT-OSS's MXFP4 experts as stored (engine.models.gpt_oss)
            from radixmesh.kernels.moe_mxfp4 import fused_experts_mxfp4, fused_experts_mxfp4_reference

            mx = (self.w13.q, self.w13.s, self.w2.q, self.w2.s)
            if self.backend == "triton":
                return fused_experts_mxfp4(x, *mx, weights, ids, elsewhere=elsewhere, extras=self.extras)
            return fused_experts_mxfp4_reference(x, *mx, weights, ids, self.extras)
        if self.w13.fp8 is not None:
            from radixmesh.kernels.moe_fp8 import fused_experts_fp8, fused_experts_fp8_reference

            fp8 = (self.w13.weight, self.w13.weight_scale, self.w2.weight, self.w2.weight_scale, self.w13.fp8.block)
            if self.backend == "triton":
                return fused_experts_fp8(x, *fp8, weights, ids, elsewhere=elsewhere)
            return fused_experts_fp8_reference(x, *fp8, weights, ids)
        from radixmesh.kernels.moe import fused_experts, fused_experts_reference

        if self.backend == "triton":
            return fused_experts(x, self.w13.weight, self.w2.weight, weights, ids, elsewhere=elsewhere,
                                 extras=self.extras)
        return fused_experts_reference(x, self.w13.weight, self.w2.weight, weights, ids, self.extras)
