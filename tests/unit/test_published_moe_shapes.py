"""The published shapes of GLM-4.5-Air, MiniMax-M2, ERNIE 4.5 21B-A3B, DeepSeek-V3, DeepSeek-V2-Lite and Kimi K2 (their
config.json, in benchmarks/configs/; ERNIE's as transformers' Ernie4_5_MoeConfig defaults it) pass the engine's checks
and build with the layout their checkpoints fill (on the meta device: no memory, no weights), and a batch-1 decode
step's floor reads what their model cards say a token activates: ~12B parameters of 106B (GLM-4.5-Air), ~10B of 230B
(MiniMax-M2), ~3B of 21B (ERNIE 4.5), 37B of 671B (DeepSeek-V3), 2.4B of 15.7B (DeepSeek-V2-Lite), 32B of 1T (Kimi
K2, DeepSeek-V3's architecture with 384 experts in one group and 64 heads); Qwen1.5-MoE-A2.7B's too."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from radixmesh.engine.bench_roofline import decode_weight_bytes
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.registry import model_class
from radixmesh.engine.models.support import check_servable

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def _build(name: str):
    cfg = ModelConfig.from_path(str(CONFIGS / name))
    check_servable(cfg, 32768)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = model_class(cfg.architecture)(cfg)
    finally:
        torch.set_default_dtype(default)
    return cfg, model


@pytest.mark.parametrize("name,total,active,sparse,experts", [
    ("glm-4.5-air", 106e9, 12e9, 45, (128, 2 * 1408, 4096)), ("minimax-m2", 230e9, 10e9, 62, (256, 2 * 1536, 3072)),
    ("ernie-4.5-21b-a3b", 21e9, 3e9, 27, (64, 2 * 1536, 2560)), ("deepseek-v3", 671e9, 37e9, 58, (256, 2 * 2048, 7168)),
    ("deepseek-v2-lite", 15.7e9, 2.4e9, 26, (64, 2 * 1408, 2048)),
    ("kimi-k2", 1.03e12, 32e9, 60, (384, 2 * 2048, 7168))])
def test_published_moe_shapes_build_as_their_checkpoints_are_laid_out(name, total, active, sparse, experts):
    cfg, model = _build(name)
    blocks = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert len(blocks) == sparse and all(tuple(b.experts.w13.weight.shape) == experts for b in blocks)
    params = sum(p.numel() for p in model.parameters())
    assert params == pytest.approx(total, rel=0.05)
    read = decode_weight_bytes(types.SimpleNamespace(model=model)) / 2  # bf16: parameters a token reads
    assert read == pytest.approx(active, rel=0.15)
    names = model.skipped_tensors  # multi-token-prediction layers past the last decoder layer
    assert f"model.layers.{cfg.num_layers}.eh_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names


def test_qwen1_5_moe_builds_with_its_gated_shared_expert():
    """Qwen1.5-MoE-A2.7B's published shape (Qwen2MoeForCausalLM: 60 experts, top 4, a 5632-wide shared expert with its
    one-row gate in every layer): 14.3B parameters, and a token reads the 2.7B its model card activates less the
    embedding table (one row of it)."""
    cfg, model = _build("qwen1.5-moe-a2.7b")
    blocks = [layer.mlp for layer in model.model.layers]
    assert all(tuple(b.experts.w13.weight.shape) == (60, 2 * 1408, 2048) for b in blocks) and len(blocks) == 24
    assert all(tuple(b.shared_expert_gate.weight.shape) == (1, 2048) for b in blocks)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(14.3e9, rel=0.01)
    read = decode_weight_bytes(types.SimpleNamespace(model=model)) / 2
    assert read + cfg.vocab_size * cfg.hidden_size == pytest.approx(2.7e9, rel=0.02)


def test_glm_router_and_bias_stay_float32_and_rope_turns_half_of_each_head():
    cfg, model = _build("glm-4.5-air")
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    attn = model.model.layers[1].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None  # attention_bias: q, k and v only
    from radixmesh.engine.layers.rope_scaling import rope_spec

    assert rope_spec(cfg).dim == 64 and rope_spec(ModelConfig.from_path(str(CONFIGS / "minimax-m2"))).dim == 64


def test_ernie_ties_its_output_layer_by_default(tmp_path):
    """Ernie4_5_MoeConfig (and Ernie4_5Config) tie the output layer to the embedding where config.json does not say."""
    import json

    raw = json.loads((CONFIGS / "ernie-4.5-21b-a3b" / "config.json").read_text())
    del raw["tie_word_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_path(str(tmp_path)).tie_word_embeddings


def test_deepseek_v3_caches_one_latent_a_token_and_scales_its_scores_by_yarn():
    """DeepSeek-V3's KV cache: one 576-wide latent (kv_lora_rank 512 + qk_rope_head_dim 64) a token and layer,
    70,272 bytes a token in bf16 over 61 layers (128 heads of 192 + 128 would take 4.8 MB); RoPE turns 64 dimensions;
    the scores' scale is 1 / sqrt(192) times YaRN's mscale at factor 40 squared (mscale_all_dim 1.0)."""
    import math

    from radixmesh.engine.layers.rope_scaling import rope_spec
    from radixmesh.engine.models.attention_spec import attention_shape

    cfg, model = _build("deepseek-v3")
    assert (cfg.num_kv_heads, cfg.head_dim, rope_spec(cfg).dim) == (1, 576, 64)
    assert cfg.kv_bytes_per_token(torch.bfloat16) == 61 * 576 * 2
    shape = attention_shape(cfg, 128, 1, 32768)
    assert shape.scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)
    attn = model.model.layers[0].self_attn
    assert tuple(attn.kv_b_proj.weight.shape) == (128 * 256, 512)
    assert tuple(attn.q_b_proj.weight.shape) == (128 * 192, 1536)


@pytest.mark.parametrize("name,layers,experts,total,active", [("gpt-oss-20b", 24, 32, 20.9e9, 3.6e9),
                                                              ("gpt-oss-120b", 36, 128, 116.8e9, 5.1e9)])
def test_gpt_oss_builds_as_its_checkpoint_is_laid_out(name, layers, experts, total, active):
    """gpt-oss-20b and -120b as published (MXFP4 experts, held so where the kernels run): their experts' codes and
    scales as stored ([experts, 2 x inter (gate and up interleaved), hidden / 32, 16] and [..., hidden / 32]) until
    the load orders them as FusedMoE's rows; the weights and what a token reads as their model cards say (21B and
    3.6B active, 117B and 5.1B; the experts' bytes 17/32 of their weights); every other layer slides over 128
    tokens; each of 64 heads has a sink; YaRN of factor 32 on whole heads."""
    from radixmesh.engine.bench_roofline import _experts
    from radixmesh.engine.layers.rope_scaling import rope_spec
    from radixmesh.engine.models.attention_spec import attention_shape

    cfg, model = _build(name)
    blocks = [layer.mlp.experts for layer in model.model.layers]
    assert len(blocks) == layers and all(tuple(e.gate_up_proj_blocks.shape) == (experts, 5760, 90, 16)
                                         and tuple(e.down_proj_scales.shape) == (experts, 2880, 90) for e in blocks)
    weights = sum(p.numel() * (2 if n.endswith("_blocks") else 0 if n.endswith("_scales") else 1)
                  for n, p in model.named_parameters())
    assert weights == pytest.approx(total, rel=0.02)
    for e in blocks:
        e.after_load()
    assert all(tuple(e.w13.q.shape) == (experts, 5760, 1440) and tuple(e.w2.s.shape) == (experts, 2880, 90)
               and e.extras.swiglu_limit == 7.0 for e in blocks)
    stacked = _experts(model)
    dense = sum(p.numel() for n, p in model.named_parameters() if p.dtype != torch.uint8 and "embed_tokens" not in n)
    assert dense + sum(elements * top_k for _, elements, top_k, _ in stacked) == pytest.approx(active, rel=0.1)
    assert all(nbytes * 32 == elements * 17 for nbytes, elements, _, _ in stacked)
    read = decode_weight_bytes(types.SimpleNamespace(model=model))
    assert read == pytest.approx(2 * dense + sum(nbytes * top_k for nbytes, _, top_k, _ in stacked), rel=1e-6)
    shape = attention_shape(cfg, 64, 8, 32768)
    assert shape.sinks and shape.windows == (128, None) * (layers // 2)
    spec = rope_spec(cfg)
    assert (spec.rope_type, spec.dim, spec.params["factor"]) == ("yarn", 64, 32.0)
