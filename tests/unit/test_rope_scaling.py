"""RoPE tables bit for bit transformers' (engine.layers.rope_scaling): every rope type we compute, read from
config.json as transformers resolves it (rope_scaling over rope_parameters, the top-level
original_max_position_embeddings over the rope dict's, per-architecture defaults and aliases), compared with the cos
and sin of the model's own rotary embedding over every position the served context allows. Where transformers'
rotation depends on the sequence length (dynamic past max_position_embeddings, longrope past the original context),
the tests show it, that dynamic's longer contexts are refused and that longrope past its original context rotates
every position with long_factor."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from radixmesh.engine.config import EngineArgs, resolve_args
from radixmesh.engine.layers.rope_scaling import exact_context, longrope_notice, rope_spec
from radixmesh.engine.layers.rotary import RotaryEmbedding
from radixmesh.engine.model_config import ModelConfig

MAX_POSITIONS = 1024
SHORT, LONG = [1.0 + 0.1 * i for i in range(8)], [2.0 + i for i in range(8)]
TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM", "phi3": "Phi3ForCausalLM"}
CASES = {
    "yarn": ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})),
    "yarn-top-level-original": ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 256},
                                              original_max_position_embeddings=200)),
    "yarn-mscale-beta": ("qwen2", dict(rope_theta=1e6, rope_scaling={
        "type": "yarn", "factor": 3.7, "original_max_position_embeddings": 300, "beta_fast": 16, "beta_slow": 2,
        "mscale": 0.8, "mscale_all_dim": 0.5})),
    "yarn-attention-factor-untruncated": ("qwen2", dict(rope_scaling={
        "type": "yarn", "factor": 3.7, "original_max_position_embeddings": 300, "truncate": False,
        "attention_factor": 1.3})),
    "yarn-null-factor": ("qwen2", dict(rope_scaling={"type": "yarn", "factor": None,
                                                     "original_max_position_embeddings": 300})),
    "yarn-rope-parameters": ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 5e4})),
    "linear": ("qwen3", dict(head_dim=24, rope_scaling={"rope_type": "linear", "factor": 2.5})),
    "dynamic": ("mistral", dict(rope_theta=123456.0, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "dynamic-mixtral-default-base": ("mixtral", dict(head_dim=16, num_local_experts=2, num_experts_per_tok=1,
                                                     rope_scaling={"rope_type": "dynamic", "factor": 1.7})),
    "llama3-top-level-original": ("llama", dict(original_max_position_embeddings=200, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128})),
    "llama3-no-original": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0})),
    "longrope-llama": ("llama", dict(rope_scaling={"rope_type": "longrope", "short_factor": SHORT,
                                                   "long_factor": LONG, "original_max_position_embeddings": 512})),
    "longrope-phi3": ("phi3", dict(original_max_position_embeddings=256, rope_scaling={
        "type": "longrope", "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": 64})),
    "su-phi3-default-original": ("phi3", dict(rope_scaling={"type": "su", "short_factor": SHORT, "long_factor": LONG,
                                                            "attention_factor": 1.2, "factor": 3.0})),
    "yarn-is-longrope-on-phi3": ("phi3", dict(original_max_position_embeddings=512, rope_scaling={
        "type": "yarn", "short_factor": SHORT, "long_factor": LONG})),
    "rope-dict-base-wins": ("llama", dict(rope_theta=10000.0, rope_scaling={"rope_type": "default",
                                                                            "rope_theta": 5e5})),
    "rope-scaling-over-rope-parameters": ("qwen2", dict(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
        rope_parameters={"rope_type": "default", "rope_theta": 5e5})),
}


def _write(path, kind: str, **fields) -> str:
    raw = dict(architectures=[TYPES[kind]], model_type=kind, hidden_size=64, num_attention_heads=4,
               num_key_value_heads=2, num_hidden_layers=1, intermediate_size=64, vocab_size=100,
               max_position_embeddings=MAX_POSITIONS, pad_token_id=0, bos_token_id=1, eos_token_id=2, **fields)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    return str(path)


def _transformers_rotary(path: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).model.rotary_emb


def _transformers_table(rotary, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rotary(torch.zeros(1), torch.arange(positions)[None])
    return cos[0], sin[0]


def _served_positions(path: str) -> int:
    limit = exact_context(rope_spec(ModelConfig.from_path(path)))
    return min(MAX_POSITIONS, limit[0]) if limit else MAX_POSITIONS


@pytest.mark.parametrize("case", CASES)
def test_tables_are_transformers_bit_for_bit(tmp_path, case):
    kind, fields = CASES[case]
    path = _write(tmp_path, kind, **fields)
    positions = _served_positions(path)
    cos, sin = _transformers_table(_transformers_rotary(path), positions)
    ours = RotaryEmbedding.for_model(ModelConfig.from_path(path), positions, torch.device("cpu"))
    assert torch.equal(ours.cos, cos) and torch.equal(ours.sin, sin)
    resolve_args(EngineArgs(model_path=path, device="cpu", load_format="dummy", context_length=positions),
                 ModelConfig.from_path(path))


def test_scaled_types_differ_from_plain_rope(tmp_path):
    """The cases above are not plain RoPE in disguise (dynamic aside, which is plain up to its limit)."""
    plain = RotaryEmbedding.for_model(ModelConfig.from_path(_write(tmp_path / "plain", "llama")), 256,
                                      torch.device("cpu"))
    for case in ("yarn", "linear", "llama3-no-original", "longrope-phi3"):
        kind, fields = CASES[case]
        ours = RotaryEmbedding.for_model(ModelConfig.from_path(_write(tmp_path / case, kind, **fields)), 256,
                                         torch.device("cpu"))
        assert not torch.equal(ours.cos, plain.cos), case


def test_dynamic_ntk_depends_on_what_transformers_saw_before(tmp_path):
    """Past max_position_embeddings transformers rescales every position, and keeps the new base for later sequences
    shorter than the one that grew it: keys cached earlier no longer match. Up to it the table is exact (above);
    longer contexts are refused."""
    kind, fields = CASES["dynamic"]
    path = _write(tmp_path, kind, **fields)
    rotary = _transformers_rotary(path)
    before, _ = _transformers_table(rotary, 16)
    _transformers_table(rotary, MAX_POSITIONS + 200)
    after, _ = _transformers_table(rotary, MAX_POSITIONS + 100)
    assert not torch.equal(after[:16], before)
    with pytest.raises(ValueError, match="dynamic NTK RoPE") as err:
        resolve_args(EngineArgs(model_path=path, device="cpu", context_length=MAX_POSITIONS + 1),
                     ModelConfig.from_path(path))
    assert f"--context-length {MAX_POSITIONS} or less" in str(err.value)


def test_longrope_rotates_a_long_prompt_with_its_long_factors(tmp_path):
    """A forward past original_max_position_embeddings rotates every position with long_factor, a shorter one with
    short_factor: the keys of a prefix depend on the length of the request. Served past the original context, every
    position takes long_factor (engine.layers.rope_scaling's decision): transformers' table of a longer forward, and
    a start-up warning says so; served within it, short_factor."""
    kind, fields = CASES["longrope-phi3"]
    path = _write(tmp_path, kind, **fields)
    rotary = _transformers_rotary(path)
    short, _ = _transformers_table(rotary, 256)
    long, _ = _transformers_table(rotary, 257)
    assert not torch.equal(long[:16], short[:16])
    cfg = ModelConfig.from_path(path)
    assert torch.equal(RotaryEmbedding.for_model(cfg, 256, torch.device("cpu")).cos, short)
    assert torch.equal(RotaryEmbedding.for_model(cfg, 257, torch.device("cpu")).cos, long)
    assert longrope_notice(replace(rope_spec(cfg), context=256)) is None
    notice = longrope_notice(replace(rope_spec(cfg), context=MAX_POSITIONS))
    assert "original_max_position_embeddings=256" in notice and "--context-length 256 or less" in notice
    resolve_args(EngineArgs(model_path=path, device="cpu"), cfg)


@pytest.mark.parametrize("kind,rope,words", [
    ("llama", {"rope_type": "yarn", "original_max_position_embeddings": 64}, "rope_scaling.factor"),
    ("llama", {"rope_type": "linear"}, "rope_scaling.factor"),
    ("llama", {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "rope_scaling.low_freq_factor"),
    ("phi3", {"type": "longrope", "long_factor": LONG}, "rope_scaling.short_factor"),
    ("phi3", {"type": "longrope", "short_factor": SHORT[:3], "long_factor": LONG}, "a list of 8 numbers"),
    ("phi3", {"type": "linear", "factor": 2.0}, "not one transformers' Phi3ForCausalLM computes"),
])
def test_rope_dicts_transformers_cannot_compute_are_refused(tmp_path, kind, rope, words):
    path = _write(tmp_path, kind, rope_scaling=rope)
    with pytest.raises(ValueError, match=words):
        resolve_args(EngineArgs(model_path=path, device="cpu", context_length=64), ModelConfig.from_path(path))
