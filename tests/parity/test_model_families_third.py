"""Cohere 2 (Command-R7B / Command-A), Phi (1, 1.5, 2), GLM-4 (GlmForCausalLM, Glm4ForCausalLM), ERNIE 4.5 and OLMo (1)
token-exact with transformers (float32, CPU), each a tiny random checkpoint written here by transformers itself (no
download), norms drawn away from their neutral weights and biases away from zero, every generated token's logprob
compared too (tests/parity/test_model_families_more.py's method and helpers): a weight read from the wrong rows, a
rotation of the wrong pairs, dimensions or layers, a norm or clamp left out, a wrong default or a bias left out moves
those far beyond the tolerance. Prompts longer than the sliding window go in one batch with shorter ones. (What only
rounds otherwise cannot show there: the order of Phi's residual sum; GELU variants and GLM's rotation in bfloat16 are
compared bit for bit below.)

Also here: the configs these families' layers would compute otherwise are refused naming the field."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from tests.engine_utils import force_rotary_kernel, running_engine
from tests.parity.test_model_families_more import WINDOW, _check, _config_dir, _refused, build_family

FAMILIES = {
    # 4 layers: sliding (rotated, every 12 tokens), sliding, global (unrotated, every token), sliding, by layer_types;
    # q/k/v/o biases; the logit scale; an output layer of its own
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM",
                dict(num_hidden_layers=4, sliding_window=WINDOW, attention_bias=True, logit_scale=0.5,
                     layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])),
    # written tied (config.json edited: _cohere2_pattern), layers 1 and 3 global
    "cohere2-pattern": ("Cohere2Config", "Cohere2ForCausalLM",
                        dict(num_hidden_layers=4, sliding_window=WINDOW, tie_word_embeddings=True)),
    # Phi-2's layout: 8 of each head's 16 dimensions rotate (PhiConfig's default 0.5: _legacy), gelu_new, biases
    "phi": ("PhiConfig", "PhiForCausalLM", {}),
    # q/k LayerNorms shared by the heads, 4 rotated dimensions, torch's tanh GELU
    "phi-qk-layernorm": ("PhiConfig", "PhiForCausalLM",
                         dict(qk_layernorm=True, partial_rotary_factor=0.25, hidden_act="gelu_pytorch_tanh")),
    # head_dim 24 with 4 heads (96 != hidden 64): 12 interleaved dimensions rotate (the default 0.5); q/k/v biases by
    # GlmConfig's default (_glm_defaults)
    "glm": ("GlmConfig", "GlmForCausalLM", dict(head_dim=24, rms_norm_eps=1e-5)),
    # post-sublayer norms; the output layer tied to the embedding
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=True)),
    # ERNIE 4.5: interleaved pairs over whole heads, rotated in float32 with float32 cos/sin; tied by its default
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(head_dim=16)),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}),
    # q, k and v clamped: about half of their elements at this scale; q/k/v/o biases
    "olmo-clip": ("OlmoConfig", "OlmoForCausalLM", dict(clip_qkv=0.8, attention_bias=True)),
}


def _legacy(raw: dict) -> None:
    """config.json as transformers 4 wrote it: rope_theta at the top level, and no partial_rotary_factor (the
    architecture's default applies)."""
    raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"]


def _glm_defaults(raw: dict) -> None:
    """No attention_bias (GlmConfig's default: q/k/v biases) and no partial_rotary_factor (0.5)."""
    _legacy(raw)
    del raw["attention_bias"]


def _cohere2_pattern(raw: dict) -> None:
    """A Command-R7B-style config.json: no layer_types, every second layer global (sliding_window_pattern), the
    output layer tied to the embedding by Cohere2Config's default."""
    del raw["layer_types"], raw["tie_word_embeddings"]
    raw["sliding_window_pattern"] = 2


CONFIG_EDITS = {"phi": _legacy, "glm": _glm_defaults, "cohere2-pattern": _cohere2_pattern}


def build(name: str, path) -> str:
    return build_family(FAMILIES, CONFIG_EDITS, 400, name, path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> its checkpoint's path, written on first use."""
    return functools.cache(lambda name: build(name, tmp_path_factory.mktemp(name)))


def _edited(tmp_path, config_cls: str, edits: dict, **fields) -> str:
    """_config_dir's config.json with `edits` written over it (fields a config class would reset)."""
    path = _config_dir(tmp_path, config_cls, **fields)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **edits}))
    return path


@pytest.mark.parametrize("name", FAMILIES)
def test_families_match_transformers(checkpoint, name):
    _check(checkpoint(name))


@pytest.mark.parametrize("name", ["cohere2", "glm4", "phi-qk-layernorm"])
def test_the_rotary_kernel_matches_transformers(checkpoint, name, monkeypatch):
    """The rotation in kernels.rotary, as on CUDA (forced here in Triton's interpreter): Cohere 2's interleaved pairs
    in float32 (its sliding layers), GLM-4's interleaved half-rotary heads in the model dtype, Phi's 4 rotated
    dimensions a head after its shared q/k LayerNorms (weight and bias), computed in the same launch."""
    launches = force_rotary_kernel(monkeypatch)
    _check(checkpoint(name))
    assert launches
    if name.startswith("phi"):
        assert all(norm is not None and norm.layer and norm.q_bias is not None for norm in launches)


def test_a_float32_table_keeps_the_torch_rotation(checkpoint, monkeypatch):
    """ERNIE 4.5's table stays float32 at lookup, which the kernel (cos and sin rounded to the model dtype) does not
    compute: its forwards look the rows up even where the kernels run."""
    from radixmesh.engine.layers import rotary

    monkeypatch.setattr(rotary, "use_kernels", lambda t: True)
    with running_engine(checkpoint("ernie4_5"), skip_tokenizer_init=True, load_format="dummy") as llm:
        table = llm.runner.model.rotary
        rope = table.prepare(torch.arange(3), torch.float32)
    assert table.looked_up and rope.cos is not None and rope.cos.dtype == torch.float32


def test_phi_shards_over_tensor_parallel_ranks(checkpoint):
    """tp_size 2: each rank adds its share of the output layer's bias to its vocabulary rows, fc1's to its rows, and
    the dense and fc2 biases once, after the sum over the ranks; the shared q/k LayerNorms on every rank."""
    _check(checkpoint("phi-qk-layernorm"), tp_size=2, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,config_fields,rotated", [
    ("glm", dict(head_dim=16, rope_theta=1000.0), 8), ("ernie4_5", dict(head_dim=16), 16)])
def test_interleaved_rotary_is_transformers(tmp_path, dtype, family, config_fields, rotated):
    """The interleaved tables rotate q and k bit for bit as transformers does. GLM: half of each head (its default
    partial_rotary_factor 0.5), in the model dtype, where pairs rotated in float32 (Cohere's, upcast_pairs) round
    otherwise in bfloat16. ERNIE 4.5: whole heads in float32 with cos and sin left in float32 (float32_table), where
    Cohere's (cos and sin rounded to the model dtype first) round otherwise in bfloat16."""
    import importlib

    import transformers

    from radixmesh.engine.layers.rotary import RotaryEmbedding
    from radixmesh.engine.model_config import ModelConfig
    from radixmesh.engine.models.registry import model_class

    config_cls = {"glm": "GlmConfig", "ernie4_5": "Ernie4_5Config"}[family]
    hf = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cfg = ModelConfig.from_path(_edited(tmp_path, config_cls, {}, **config_fields))
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    model.init_rotary(40, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(40, n, 16, generator=gen).to(dtype) for n in (4, 2))
    positions = torch.arange(40)
    rope_cls = next(getattr(hf, n) for n in dir(hf) if n.endswith("RotaryEmbedding"))
    cos, sin = rope_cls(getattr(transformers, config_cls).from_pretrained(tmp_path))(q, positions[None])
    want = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    theta = cfg.raw.get("rope_theta") or cfg.raw["rope_parameters"]["rope_theta"]
    other = RotaryEmbedding(rotated, 40, theta, None, torch.device("cpu"), interleaved=True)  # Cohere's rounding
    for table, equal in ((model.rotary, True), (other, dtype == torch.float32)):
        got = table.prepare(positions, dtype).apply(q, k)
        assert all(torch.equal(g, w[0].transpose(0, 1)) == equal for g, w in zip(got, want))


@pytest.mark.parametrize("name", ["gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast"])
def test_gelus_are_transformers(name):
    from transformers.activations import ACT2FN

    from radixmesh.engine.layers.activation import GELUS

    x = torch.linspace(-6.0, 6.0, 4001)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(GELUS[name](x.to(dtype)), ACT2FN[name](x.to(dtype)))


# ---- refusals ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config_cls,fields,edits,words", [
    ("Cohere2Config", dict(hidden_act="gelu"), {}, ["hidden_act='gelu'"]),
    ("Cohere2Config", {}, dict(use_qk_norm=True), ["use_qk_norm=True"]),
    ("Cohere2Config", {}, dict(head_dim=32), ["head_dim=32"]),
    ("Cohere2Config", dict(sliding_window=None), {}, ["sliding_window=None", "no window size"]),
    ("Cohere2Config", {}, dict(partial_rotary_factor=0.5), ["partial_rotary_factor"]),
    ("PhiConfig", dict(hidden_act="relu"), {}, ["hidden_act='relu'"]),
    ("PhiConfig", dict(tie_word_embeddings=True), {}, ["tie_word_embeddings=true"]),
    ("PhiConfig", dict(qk_layernorm=True), dict(head_dim=32), ["head_dim=32", "qk_layernorm"]),
    ("PhiConfig", {}, dict(mlp_bias=True), ["mlp_bias=true"]),
    ("PhiConfig", dict(partial_rotary_factor=1.5), {}, ["partial_rotary_factor=1.5"]),
    ("GlmConfig", dict(hidden_act="gelu"), {}, ["hidden_act='gelu'"]),
    ("Glm4Config", {}, dict(mlp_bias=True), ["mlp_bias=true"]),
    ("OlmoConfig", dict(clip_qkv=-1.0), {}, ["clip_qkv=-1.0"]),
    ("OlmoConfig", dict(hidden_act="gelu"), {}, ["hidden_act='gelu'"]),
    ("Ernie4_5Config", dict(use_bias=True), {}, ["use_bias=true"]),
])
def test_configs_the_layers_would_compute_otherwise_are_refused(tmp_path, config_cls, fields, edits, words):
    _refused(_edited(tmp_path, config_cls, edits, **fields), *words)


def test_lora_is_refused_for_phi(tmp_path):
    """Phi's MLP has no gate/up/down projections for adapters."""
    _refused(_config_dir(tmp_path, "PhiConfig"), "LoRA on PhiForCausalLM", "fc1", enable_lora=True)
