"""Checkpoints we would serve wrong are refused at load, before any weight is read, with an error naming the feature
(engine.models.support): quantization, sliding windows shorter than the context, RoPE we do not compute, config
fields that change the math, and tensors the model has no parameter for."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixmesh.engine import Engine
from radixmesh.engine.config import EngineArgs, resolve_args
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models import loader
from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine
from tests.reference import hf_greedy

GREEDY = {"max_new_tokens": 8, "temperature": 0}


def _copy(tmp_path, name="tiny-llama", weights=False, **config):
    """A copy of a bundled tiny model (weights too if asked) with `config` merged into its config.json."""
    dst = tmp_path / name
    shutil.copytree(model_path(name), dst, ignore=None if weights else shutil.ignore_patterns("*.safetensors"))
    raw = json.loads((dst / "config.json").read_text())
    raw.update(config)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _resolve(path, **kw):
    return resolve_args(EngineArgs(model_path=str(path), device="cpu", **kw), ModelConfig.from_path(str(path)))


def _refused(path, *words, **kw):
    with pytest.raises(ValueError) as err:
        _resolve(path, **kw)
    for word in words:
        assert word in str(err.value), str(err.value)
    return str(err.value)


@pytest.fixture
def no_weight_read(monkeypatch):
    """Fails the test if the loader reads any weight (refusals come from config.json and the files' headers)."""
    def read(*_):
        raise AssertionError("a weight was read before the refusal")

    monkeypatch.setattr(loader, "_read", read)


def _load(path):
    return loader.load_model(ModelConfig.from_path(str(path)), "auto", torch.float32, torch.device("cpu"), 128)


def _rewrite_weights(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


# ---- quantization ----------------------------------------------------------------------------------------------------

def _block_fp8(tensors):
    """Every projection as float8_e4m3fn with its 128x128-block scales, as DeepSeek/Qwen fp8 checkpoints store them."""
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        w = tensors[name]
        tensors[name] = w.to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = torch.ones(-(-w.shape[0] // 128), -(-w.shape[1] // 128))


def test_a_block_fp8_checkpoint_is_read_as_its_dequantized_weights(tmp_path):
    """Once refused (issue 52: it used to load as garbage); now read (engine.quantization.fp8, parity in
    tests/parity/test_fp8_parity.py): here DeepSeek's 128x128 blocks, whose scales of 1 leave each weight its fp8
    value. The same file under a config.json that declares nothing is still refused, from the headers alone."""
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    dst = _copy(tmp_path, weights=True, quantization_config=fp8)
    _rewrite_weights(dst, _block_fp8)
    stored = load_file(dst / "model.safetensors")
    model = _load(dst)
    q = model.model.layers[2].mlp.down_proj.weight
    assert torch.equal(q, stored["model.layers.2.mlp.down_proj.weight"].float())
    plain = _copy(tmp_path / "unlabelled")  # the same weights under a config.json that says nothing
    shutil.copy(dst / "model.safetensors", plain)
    with pytest.raises(ValueError, match=r"F8_E4M3.*config.json declares no fp8 quantization"):
        loader.load_model(ModelConfig.from_path(str(plain)), "auto", torch.float32, torch.device("cpu"), 128)


@pytest.mark.parametrize("key,quant", [
    ("quantization_config", {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}),
    ("quantization_config", {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}),
    ("quantization_config", {"quant_method": "compressed-tensors", "format": "float-quantized"}),
    ("quantization_config", {"quant_method": "bitsandbytes", "load_in_4bit": True}),
    ("compression_config", {"quant_method": "compressed-tensors", "format": "pack-quantized"}),
])
def test_quantization_config_is_refused_naming_the_method(tmp_path, key, quant):
    dst = _copy(tmp_path, **{key: quant})
    _refused(dst, f"{quant['quant_method']} quantization", f"{key}.quant_method", "not implemented by radixmesh",
             "unquantized")


def test_autogptq_quantize_config_file_is_refused(tmp_path):
    dst = _copy(tmp_path)
    (dst / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128}))
    _refused(dst, "gptq quantization", "quantize_config.json")


def test_fp8_weights_without_a_quantization_config_are_refused(tmp_path, no_weight_read):
    dst = _copy(tmp_path, weights=True)
    _rewrite_weights(dst, lambda t: t.update({"model.layers.2.mlp.down_proj.weight":
                                              t["model.layers.2.mlp.down_proj.weight"].to(torch.float8_e4m3fn)}))
    with pytest.raises(ValueError, match=r"'model.layers.2.mlp.down_proj.weight'.*F8_E4M3.*declares no fp8 quantization"):
        _load(dst)


def test_integer_weights_are_refused(tmp_path, no_weight_read):
    dst = _copy(tmp_path, weights=True)
    _rewrite_weights(dst, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.int32)}))
    with pytest.raises(ValueError, match=r"'model.norm.weight'.*I32.*integer \(packed\) quantized weights"):
        _load(dst)


@pytest.mark.parametrize("suffix,scheme", [("weight_scale_inv", "block-wise fp8"), ("weight_scale", "fp8"),
                                           ("input_scale", "fp8"), ("qweight", "GPTQ/AWQ"), ("scales", "GPTQ/AWQ"),
                                           ("qzeros", "GPTQ/AWQ"), ("g_idx", "GPTQ"),
                                           ("weight.absmax", "bitsandbytes 4-bit")])
def test_quantization_tensors_are_refused_naming_the_scheme(tmp_path, no_weight_read, suffix, scheme):
    dst = _copy(tmp_path, weights=True)
    name = f"model.layers.0.self_attn.q_proj.{suffix}"
    _rewrite_weights(dst, lambda t: t.update({name: torch.ones(1)}))
    with pytest.raises(ValueError, match=rf"'{name}'.*{scheme}.*quantization.*not implemented by radixmesh"):
        _load(dst)


def test_a_tensor_the_model_has_no_place_for_is_refused(tmp_path, no_weight_read):
    dst = _copy(tmp_path, weights=True)  # a fifth layer where config.json says four
    _rewrite_weights(dst, lambda t: t.update({"model.layers.4.mlp.gate_proj.weight": torch.zeros(256, 128)}))
    with pytest.raises(ValueError, match=r"no parameter for \(model\.layers\.4\.mlp\.gate_proj\.weight\).*"
                                         r"num_hidden_layers"):
        _load(dst)


def test_inv_freq_and_a_tied_lm_head_are_ignored(tmp_path):
    dst = _copy(tmp_path, "tiny-qwen2", weights=True)
    assert json.loads((dst / "config.json").read_text())["tie_word_embeddings"]
    _rewrite_weights(dst, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone(),
                                              "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16)}))
    _load(dst)


def test_missing_lm_head_hints_at_tied_embeddings(tmp_path):
    dst = _copy(tmp_path, weights=True)
    _rewrite_weights(dst, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"lm_head\.weight.*tie_word_embeddings=false"):
        _load(dst)


# ---- sliding windows -------------------------------------------------------------------------------------------------

def _mistral(tmp_path, weights=False, **config):
    return _copy(tmp_path, weights=weights, architectures=["MistralForCausalLM"], model_type="mistral", **config)


def _windows(path, **kw) -> tuple:
    """The per-layer windows the attention backends get for `path` (engine.models.attention_spec) once it resolves."""
    from radixmesh.engine.models.attention_spec import layer_windows

    return layer_windows(ModelConfig.from_path(str(path)), _resolve(path, **kw).context_length)


def test_mistral_window_shorter_than_the_context_slides_every_layer(tmp_path):
    """Once refused (issue 55: it used to run full attention); now every layer slides over its window (parity with
    transformers: tests/parity/test_sliding_window.py)."""
    dst = _mistral(tmp_path, sliding_window=256)
    assert _windows(dst) == (256,) * 4
    assert _windows(dst, context_length=256) == (None,) * 4  # a window covering the whole context masks nothing


def test_mistral_without_a_window_field_gets_transformers_default(tmp_path):
    dst = _mistral(tmp_path, max_position_embeddings=8192)
    assert "sliding_window" not in json.loads((dst / "config.json").read_text())
    assert _windows(dst) == (4096,) * 4


def test_mistral_with_a_null_window_is_accepted(tmp_path):
    dst = _mistral(tmp_path, sliding_window=None, max_position_embeddings=8192)
    assert _resolve(dst).context_length == 8192
    assert _windows(dst) == (None,) * 4


def test_mistral_window_at_least_the_context_loads_and_matches_transformers(tmp_path):
    dst = _mistral(tmp_path, weights=True, sliding_window=512)
    prompts = [p for p in parity_prompts(str(dst)) if len(p) < 300][:4]
    with running_engine(str(dst), context_length=512) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == hf_greedy(str(dst), prompts, GREEDY["max_new_tokens"])


def test_qwen2_use_sliding_window_slides_the_layers_from_max_window_layers(tmp_path):
    dst = _copy(tmp_path, "tiny-qwen2", use_sliding_window=True, sliding_window=256, max_window_layers=2)
    assert _windows(dst) == (None, None, 256, 256)


def test_qwen2_windows_that_cover_no_layer_are_accepted(tmp_path):
    for name, flag, first in (("a", True, 4), ("b", False, 0)):
        dst = _copy(tmp_path / name, "tiny-qwen2", use_sliding_window=flag, sliding_window=256, max_window_layers=first)
        assert _windows(dst) == (None,) * 4


MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)


def test_mixture_of_experts_sliding_windows_as_their_configs_say(tmp_path):
    """Mixtral slides every layer once sliding_window is set (MixtralConfig has none by default); Qwen3-MoE every
    layer under use_sliding_window; Qwen2-MoE the even layers below max_window_layers under it."""
    mixtral = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4, **MOE)
    assert _windows(_copy(tmp_path / "m", **mixtral, sliding_window=256)) == (256,) * 4
    assert _windows(_copy(tmp_path / "m0", **mixtral)) == (None,) * 4
    qwen3 = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4, **MOE)
    assert _windows(_copy(tmp_path / "q", "tiny-qwen3", **qwen3, use_sliding_window=True,
                          sliding_window=128)) == (128,) * 4
    assert _windows(_copy(tmp_path / "q0", "tiny-qwen3", **qwen3, use_sliding_window=False,
                          sliding_window=128)) == (None,) * 4
    qwen2 = dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_experts=4, **MOE)
    assert _windows(_copy(tmp_path / "q2", "tiny-qwen2", **qwen2, use_sliding_window=True, sliding_window=128,
                          max_window_layers=3)) == (128, None, 128, None)


def test_a_mixture_of_experts_config_without_its_experts_is_refused(tmp_path):
    dst = _copy(tmp_path, "tiny-qwen3", architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
    with pytest.raises(ValueError, match="gives no num_experts"):
        _load(dst)


def test_layer_types_say_which_layers_slide(tmp_path):
    """Where transformers reads layer_types (Qwen2/3, Gemma) they pick the sliding layers. Llama's attention ignores
    them: a window there contradicts the architecture and is refused where it would matter; sliding layers without
    a window cannot be computed at all."""
    types = ["full_attention", "sliding_attention"] * 2
    dst = _copy(tmp_path / "q3", "tiny-qwen3", use_sliding_window=True, sliding_window=128, layer_types=types)
    assert _windows(dst) == (None, 128, None, 128)
    dst = _copy(tmp_path / "llama", layer_types=types, sliding_window=512)
    _refused(dst, "sliding-window attention (sliding_window=512, layer_types in config.json: 2 of 4 layers)",
             "not read by transformers' LlamaForCausalLM", "--context-length 512 or less")
    assert _windows(dst, context_length=512) == (None,) * 4
    _refused(_copy(tmp_path / "nowin", layer_types=types), "sliding-window attention", "no window size")


# ---- RoPE (what it computes, and its tables against transformers': tests/unit/test_rope_scaling.py) -----------------

@pytest.mark.parametrize("rope", [{"rope_type": "proportional", "factor": 2.0}, {"type": "su", "factor": 2.0}])
def test_rope_scaling_we_do_not_compute_is_refused(tmp_path, rope):
    key = "rope_type" if "rope_type" in rope else "type"
    _refused(_copy(tmp_path, rope_scaling=rope), f"RoPE scaling {rope[key]!r} (rope_scaling.{key}={rope[key]!r}",
             "not implemented by radixmesh", "default, linear, dynamic, llama3, yarn, longrope")


def test_transformers5_rope_parameters_are_read(tmp_path):
    unknown = {"rope_type": "proportional", "rope_theta": 10000.0}
    _refused(_copy(tmp_path / "unknown", rope_scaling=None, rope_parameters=unknown),
             "rope_parameters.rope_type='proportional'")
    nested = {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}
    _refused(_copy(tmp_path / "nested", rope_scaling=None, rope_parameters=nested), "per-layer-type RoPE")
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    _resolve(_copy(tmp_path / "yarn", rope_scaling=None, rope_parameters=yarn))


def test_partial_rotary_factor_is_refused(tmp_path):
    _refused(_copy(tmp_path / "top", partial_rotary_factor=0.5), "partial rotary embedding (partial_rotary_factor=0.5")
    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    _refused(_copy(tmp_path / "nested", rope_scaling=None, rope_parameters=params),
             "rope_parameters.partial_rotary_factor=0.25")
    _resolve(_copy(tmp_path / "one", partial_rotary_factor=1.0))


def test_unsupported_rope_is_refused_before_weights_load(tmp_path, no_weight_read):
    with pytest.raises(ValueError, match="RoPE scaling 'proportional'"):
        _load(_copy(tmp_path, weights=True, rope_scaling={"rope_type": "proportional", "factor": 4.0}))


# ---- fields that change the math -------------------------------------------------------------------------------------

def test_activation_other_than_silu_is_refused(tmp_path):
    _refused(_copy(tmp_path / "gelu", hidden_act="gelu"), "MLP activation 'gelu' (hidden_act='gelu'")
    _resolve(_copy(tmp_path / "swish", hidden_act="swish"))


def test_mlp_bias_is_refused(tmp_path):
    _refused(_copy(tmp_path, mlp_bias=True), "MLP biases (mlp_bias=true")


@pytest.mark.parametrize("field,value,feature", [
    ("attn_logit_softcapping", 50.0, "attention logit soft-capping"),
    ("final_logit_softcapping", 30.0, "final logit soft-capping"),
    ("query_pre_attn_scalar", 256, "query pre-attention scaling"),
    ("attention_multiplier", 0.015625, "attention score scaling"),
    ("embedding_multiplier", 12.0, "embedding scaling"),
    ("scale_emb", 12, "embedding scaling"),
    ("residual_multiplier", 0.22, "residual scaling"),
    ("logits_scaling", 8.0, "logit scaling"),
    ("logit_scale", 0.0625, "logit scaling"),
    ("clip_qkv", 8.0, "q/k/v clipping"),
    ("use_qk_norm", True, "q/k normalisation"),
])
def test_math_changing_fields_are_refused(tmp_path, field, value, feature):
    _refused(_copy(tmp_path, **{field: value}), f"{feature} ({field}={value!r} in config.json)",
             "not implemented by radixmesh")


def test_math_fields_at_their_neutral_values_are_accepted(tmp_path):
    head_dim = 32  # tiny-llama's
    _resolve(_copy(tmp_path, query_pre_attn_scalar=head_dim, attention_multiplier=head_dim ** -0.5,
                   embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0, logit_scale=1.0,
                   attn_logit_softcapping=None, final_logit_softcapping=None, use_qk_norm=False, pretraining_tp=2))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-embed", "tiny-qwen3-moe"])
def test_the_bundled_models_are_accepted(name):
    _load(model_path(name))
