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


def test_a_batch_floor_reads_the_union_of_its_tokens_experts():
    """bench_one_batch --roofline (issue 51: at batch 64 the step should read close to the union of active experts):
    a step of one token reads its top-k experts a layer; a batch's step reads the distinct experts its tokens took,
    counted here by hand from the routing itself, and its floor's weight bytes follow that count."""
    from radixmesh.engine.bench_one_batch import run_once
    from radixmesh.engine.bench_roofline import moe_blocks
    from radixmesh.engine.cache.manager import CacheManager
    from radixmesh.engine.config import EngineArgs, resolve_args
    from radixmesh.engine.model_runner import ModelRunner

    cfg = ModelConfig.from_path(model_path("tiny-qwen3-moe"))
    args = resolve_args(EngineArgs(model_path=model_path("tiny-qwen3-moe"), device="cpu", dtype="float32",
                                   load_format="dummy", max_running_requests=8, context_length=64,
                                   disable_radix_cache=True), cfg)
    runner = ModelRunner(args, cfg)
    cache = CacheManager(runner.kv_pool, runner.req_to_token, None)
    blocks = moe_blocks(runner.model)
    routed: list[list[set[int]]] = []  # per forward, per sparse layer: the experts its tokens took
    originals = [b.experts.route for b in blocks]

    def spy(i, route):
        def wrapped(*a, **kw):
            weights, ids = route(*a, **kw)
            if i == 0:
                routed.append([])
            routed[-1].append(set(ids.flatten().tolist()))
            return weights, ids
        return wrapped

    for i, b in enumerate(blocks):
        b.experts.route = spy(i, originals[i])
    one = run_once(runner, cache, 1, 8, 2, count_experts=True)
    assert one["experts_read"] == [cfg.moe.top_k] * len(blocks)
    routed.clear()
    six = run_once(runner, cache, 6, 8, 2, count_experts=True)
    counted = routed[-2:]  # the two counting steps come last
    by_hand = [sum(len(step[i]) for step in counted) / 2 for i in range(len(blocks))]
    assert six["experts_read"] == by_hand
    assert all(cfg.moe.top_k < n <= cfg.moe.num_experts for n in by_hand)
    assert runner.graphs is None and all(b.counts is None for b in blocks)  # the counters come off again
    per_expert = 4 * 3 * cfg.hidden_size * cfg.moe.intermediate_size
    assert (decode_weight_bytes(runner, six["experts_read"]) - decode_weight_bytes(runner)
            == round(sum(n - cfg.moe.top_k for n in by_hand) * per_expert))
    assert cache.available_tokens() == cache.max_total_tokens  # every request's pages back
