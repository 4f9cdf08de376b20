"""benchmarks.tune_fp8_gemm's shapes: the [n, k] weights a rank's dense projections hold, as engine.layers.linear
builds them (q/k/v with KV heads replicated past their count, o, gate/up and down; a mixture of experts' dense layers
and shared expert, not its routed experts, which kernels.moe_fp8 runs)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from radixmesh.benchmarks.tune_fp8_gemm import dense_shapes
from radixmesh.engine.model_config import ModelConfig, MoeConfig
from tests.conftest import model_path

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def test_the_8b_shapes_and_their_tensor_parallel_shards():
    cfg = ModelConfig.from_path(str(CONFIGS / "llama-3.1-8b"))
    assert dense_shapes(cfg, 1) == [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    assert dense_shapes(cfg, 2) == [(3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168)]
    assert dense_shapes(cfg, 16)[0] == ((2 + 2 * 1) * 128, 4096)  # 8 KV heads over 16 ranks: one a rank


def test_the_engine_builds_the_shapes_the_tuner_names():
    """On a tiny Llama built by the loader: the tuner's shapes are exactly its projections' weight shapes."""
    import torch

    from radixmesh.engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from radixmesh.engine.models.loader import load_model

    cfg = ModelConfig.from_path(model_path("tiny-llama"))
    model = load_model(cfg, "dummy", torch.float32, torch.device("cpu"), 64)
    kinds = (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear)
    built = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, kinds)}
    assert set(dense_shapes(cfg, 1)) == built


def test_a_mixture_of_experts_tunes_its_dense_layers_and_shared_expert_only():
    cfg = ModelConfig.from_path(str(CONFIGS / "qwen3-30b-a3b"))
    attention = [(32 * 128 + 2 * 4 * 128, 2048), (2048, 32 * 128)]
    assert dense_shapes(cfg, 1) == attention  # every layer sparse: the experts are kernels.moe_fp8's
    dense = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, mlp_only_layers=(0,)))
    assert dense_shapes(dense, 1) == attention + [(2 * cfg.intermediate_size, 2048), (2048, cfg.intermediate_size)]
    shared = dataclasses.replace(cfg, moe=MoeConfig(num_experts=60, top_k=4, intermediate_size=1408,
                                                    shared_expert_intermediate_size=5632))
    assert dense_shapes(shared, 1) == attention + [(2 * 5632, 2048), (2048, 5632)]
