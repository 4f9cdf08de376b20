"""The roofline's weight bytes and FLOPs for a mixture of experts (engine.bench_roofline): a batch-1 decode step reads
the router, the dense parts and the top-k experts a token takes, not every expert; a token's FLOPs count its top-k
experts. Checked on the tiny Qwen3-MoE against the sum written out by hand."""

from __future__ import annotations

import types

import torch

from radixmesh.engine.bench_roofline import decode_weight_bytes, linear_flops
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.loader import load_model
from tests.conftest import model_path


def test_a_decode_step_reads_the_top_k_experts_not_all():
    cfg = ModelConfig.from_path(model_path("tiny-qwen3-moe"))
    model = load_model(cfg, "dummy", torch.float32, torch.device("cpu"), 64)
    runner = types.SimpleNamespace(model=model)
    moe, hidden = cfg.moe, cfg.hidden_size
    expert = 3 * hidden * moe.intermediate_size  # gate, up, down of one expert
    sparse = sum(moe.sparse(i) for i in range(cfg.num_layers))
    every = sum(p.numel() for p in model.parameters())
    stacked = sparse * moe.num_experts * expert
    embed = cfg.vocab_size * hidden
    assert decode_weight_bytes(runner) == 4 * (every - stacked + sparse * moe.top_k * expert - embed)
    matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n
                   and "lm_head" not in n)
    lm_head = model.lm_head.weight.numel()
    assert linear_flops(runner, 10) == 2 * (matrices + sparse * moe.top_k * expert) * 10 + 2 * lm_head


def test_the_roofline_knows_a_model_holding_fp8_weights():
    """bench_one_batch --roofline measures the fp8 product's rate beside bf16's for a model whose weights stay in fp8
    (--quantization fp8 with the Triton kernels), and not for one that holds none."""
    from radixmesh.engine.bench_roofline import holds_fp8

    cfg = ModelConfig.from_path(model_path("tiny-qwen3-moe"))
    plain = load_model(cfg, "dummy", torch.float32, torch.device("cpu"), 64)
    held = load_model(cfg, "dummy", torch.float32, torch.device("cpu"), 64, quantization="fp8",
                      fp8_gemm_backend="triton")
    assert not holds_fp8(plain) and holds_fp8(held)
