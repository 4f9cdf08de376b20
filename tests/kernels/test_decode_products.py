"""Which kernel runs each decode-sized product (engine.decode_products, kernels.runtime.use_pdl): a plan by weight
shape sends each product to kernels.gemv with the tiles chosen for its shape or to cuBLAS, and a product of one row
to gemv_row where the plan chose that. On CPU the plan's
semantics and the candidate tiles; on a Hopper GPU the products engine.layers.linear runs under a plan, bit for bit
against the kernel the plan names, and the plan that --decode-gemm auto times on the model's own weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixmesh.engine.decode_products import CANDIDATES, candidates
from radixmesh.kernels import runtime
from radixmesh.kernels.gemv import ROW_CONFIG, default_config, gemv, gemv_row
from radixmesh.kernels.runtime import gemv_enabled, gemv_plan, pdl_supported, row_plan, use_pdl


@pytest.fixture
def restore_pdl():
    yield
    use_pdl(True, True)


def test_candidates_start_with_the_defaults_and_fit_k():
    wide = candidates(4096, 14336)
    assert wide[0] == default_config(4096, 14336)
    assert set(CANDIDATES) <= set(wide) and len(wide) == len(set(wide))
    narrow = candidates(96, 128)  # K below the tiles' 512 columns: capped at the next power of two, as the defaults
    assert narrow[0] == default_config(96, 128)
    assert all(block_k <= 128 and pull <= 128 for _, block_k, _, _, pull in narrow)
    assert (32, 128, 4, 4, 128) in narrow


def test_a_plan_by_shape(monkeypatch, restore_pdl):
    monkeypatch.setattr(runtime, "pdl_enabled", lambda device: runtime._pdl["enabled"])  # as on a Hopper GPU
    t = torch.empty(0)
    tiles = (32, 512, 4, 4, 2048)
    use_pdl(True, {(4096, 4096): tiles, (6144, 4096): None})
    assert gemv_plan(t, (4096, 4096)) == (True, tiles)
    assert gemv_plan(t, (6144, 4096)) == (False, None)  # cuBLAS by the plan
    assert gemv_plan(t, (28672, 4096)) == (False, None)  # not in the plan: cuBLAS
    assert gemv_enabled(t)
    use_pdl(True, {(6144, 4096): None})
    assert not gemv_enabled(t)  # a plan that keeps every shape on cuBLAS
    use_pdl(True, True)
    assert gemv_plan(t, (6144, 4096)) == (True, None)  # every product, default tiles
    use_pdl(True, False)
    assert gemv_plan(t, (6144, 4096)) == (False, None)
    use_pdl(False, {(4096, 4096): tiles})
    assert gemv_plan(t, (4096, 4096)) == (False, None)  # PDL off: cuBLAS, whatever the plan
    use_pdl(True, {(4096, 4096): tiles}, row={(6144, 4096): (2, 1024, 4)})
    assert row_plan(t, (6144, 4096)) == (2, 1024, 4) and gemv_plan(t, (6144, 4096)) == (False, None)
    assert row_plan(t, (4096, 4096)) is None  # no one-row choice: the plan's kernel for every row count
    use_pdl(False, {}, row={(6144, 4096): (2, 1024, 4)})
    assert row_plan(t, (6144, 4096)) is None  # PDL off
    use_pdl(True, True)
    assert row_plan(t, (6144, 4096)) is None  # a new setting forgets the rows


@pytest.mark.gpu
def test_linear_runs_the_plans_kernel_bit_for_bit(restore_pdl):
    if not pdl_supported():
        pytest.skip("programmatic dependent launch needs Hopper and a Triton with gdc_wait")
    from radixmesh.engine.layers.linear import linear

    g = torch.Generator(device="cuda").manual_seed(0)
    o = torch.randn((4096, 4096), device="cuda", dtype=torch.bfloat16, generator=g) / 64
    qkv = torch.randn((6144, 4096), device="cuda", dtype=torch.bfloat16, generator=g) / 64
    x = torch.randn((1, 4096), device="cuda", dtype=torch.bfloat16, generator=g)
    tiles = (32, 512, 4, 4, 2048)
    use_pdl(True, {(4096, 4096): tiles, (6144, 4096): None})
    assert torch.equal(linear(x, o), gemv(x, o, config=tiles))
    assert torch.equal(linear(x, qkv), F.linear(x, qkv))
    other = torch.randn((512, 4096), device="cuda", dtype=torch.bfloat16, generator=g) / 64
    assert torch.equal(linear(x, other), F.linear(x, other))  # a shape the plan does not name
    use_pdl(True, {(4096, 4096): tiles, (6144, 4096): None}, row={(6144, 4096): (4, 1024, 8)})
    assert torch.equal(linear(x, qkv), gemv_row(x, qkv, config=(4, 1024, 8)))  # one row: gemv_row
    x2 = torch.randn((2, 4096), device="cuda", dtype=torch.bfloat16, generator=g)
    assert torch.equal(linear(x2, qkv), F.linear(x2, qkv))  # two rows: the plan's kernel for the shape


@pytest.mark.gpu
def test_auto_plans_every_shape_of_the_model(restore_pdl):
    """--decode-gemm auto (the default) with graphs: the engine plans each weight shape before capturing, and
    generates as it should."""
    if not pdl_supported():
        pytest.skip("programmatic dependent launch needs Hopper and a Triton with gdc_wait")
    from radixmesh.engine.decode_products import _weights
    from tests.engine_utils import running_engine

    with running_engine("models/tiny-llama", device="cuda", dtype="bfloat16", mem_fraction_static=0.3) as llm:
        chosen = runtime._pdl["gemv"]
        assert isinstance(chosen, dict)
        assert set(chosen) == {tuple(w.shape) for w in _weights(llm.runner.model)}
        assert all(c is None or c in candidates(*s) for s, c in chosen.items())
        rows = runtime._pdl["row"]
        # one row: gemv_row for the shapes where its own timing was not clearly slower (on an H200: all of them)
        assert set(rows) <= set(chosen) and all(c == ROW_CONFIG for c in rows.values())
        out = llm.generate(input_ids=[1, 2, 3, 4], sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert len(out["output_ids"]) == 4


def test_a_mixture_of_experts_plans_its_routers_products_too():
    """A MoE layer's router ([experts, hidden], once a layer) is a decode product like the projections: the plan
    times it and a one-row step runs it on gemv_row (under PDL) rather than cuBLAS where that is faster; the stacked
    experts are not (kernels.moe runs them)."""
    from radixmesh.engine.decode_products import _weights
    from radixmesh.engine.model_config import ModelConfig
    from radixmesh.engine.models.loader import load_model
    from tests.conftest import model_path

    cfg = ModelConfig.from_path(model_path("tiny-qwen3-moe"))
    model = load_model(cfg, "dummy", torch.float32, torch.device("cpu"), 64)
    planned = {id(w) for w in _weights(model)}
    routers = [layer.mlp.gate.weight for layer in model.model.layers if hasattr(layer.mlp, "gate")
               and not hasattr(layer.mlp, "gate_up_proj")]
    assert routers and all(id(w) in planned for w in routers)
    assert all(id(layer.mlp.experts.w13.weight) not in planned for layer in model.model.layers
               if hasattr(layer.mlp, "experts"))
    assert tuple(routers[0].shape) == (cfg.moe.num_experts, cfg.hidden_size)


def test_column_parallel_projections_are_planned():
    """ColumnParallelLinear's products (DeepSeek's q_proj, q_a_proj, q_b_proj and kv_a_proj_with_mqa; Phi's fc1,
    StarCoder2's c_fc) are decode products like the others: an H100's V2-Lite step ran its two on cuBLAS."""
    from torch import nn

    from radixmesh.engine.decode_products import _weights
    from radixmesh.engine.distributed import TensorParallel
    from radixmesh.engine.layers.linear import ColumnParallelLinear

    model = nn.Module()
    model.q_proj = ColumnParallelLinear(8, 16, False, TensorParallel.single(), "q_proj's rows")
    model.lm_head = nn.Linear(8, 32)
    assert [tuple(w.shape) for w in _weights(model)] == [(16, 8), (32, 8)]
