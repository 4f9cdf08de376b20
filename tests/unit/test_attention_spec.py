"""Which layers slide and what Gemma's attention computes, read from config.json as transformers reads it
(engine.models.attention_spec, engine.models.gemma_config), and what is refused: Gemma configs our layers would
compute otherwise, and attention backends asked for a window or a soft-cap they lack. Configs only, no weights."""

from __future__ import annotations

import json

import pytest

from radixmesh.engine.attention.base import AttentionBackend, AttentionShape
from radixmesh.engine.config import EngineArgs, resolve_args
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.attention_spec import attention_shape, layer_windows, sliding_layers

# A Gemma 2 config.json as the Hub writes it (transformers 4's fields), at a tiny size
GEMMA2 = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=64, intermediate_size=128,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
              max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="gelu_pytorch_tanh",
              hidden_activation="gelu_pytorch_tanh", sliding_window=128, query_pre_attn_scalar=24,
              attn_logit_softcapping=50.0, final_logit_softcapping=30.0, attention_bias=False, pad_token_id=0)
GEMMA3 = {**GEMMA2, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 6,
          "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 3,
          "attn_logit_softcapping": None, "final_logit_softcapping": None}


def _config(tmp_path, base: dict, **changes) -> ModelConfig:
    raw = {**base, **changes}
    for key in [k for k, v in changes.items() if v is _DROP]:
        raw.pop(key)
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_path(str(tmp_path))


_DROP = object()


def _resolve(cfg: ModelConfig, **kw):
    return resolve_args(EngineArgs(model_path=cfg.path, device="cpu", **kw), cfg)


def test_gemma2_alternates_sliding_and_global_layers_with_its_soft_caps(tmp_path):
    cfg = _config(tmp_path, GEMMA2)
    _resolve(cfg)
    shape = attention_shape(cfg, 4, 2, 1024)
    assert shape.windows == (128, None, 128, None)
    assert shape.scale == 24 ** -0.5 and shape.softcap == 50.0
    assert cfg.tie_word_embeddings  # Gemma2Config's default where config.json does not say


def test_gemma_defaults_are_transformers(tmp_path):
    """No query_pre_attn_scalar, soft-caps or window in config.json: Gemma2Config's 256, 50, 30 and 4096."""
    cfg = _config(tmp_path, GEMMA2, query_pre_attn_scalar=_DROP, attn_logit_softcapping=_DROP,
                  final_logit_softcapping=_DROP, sliding_window=_DROP, max_position_embeddings=8192)
    shape = attention_shape(cfg, 4, 2, 8192)
    assert shape.scale == 256 ** -0.5 and shape.softcap == 50.0 and shape.windows == (4096, None) * 2
    from radixmesh.engine.models.gemma_config import gemma_config

    assert gemma_config(cfg).final_softcap == 30.0
    assert not _config(tmp_path / "untied", GEMMA2, tie_word_embeddings=False).tie_word_embeddings


def test_gemma3_pattern_and_layer_types(tmp_path):
    """Every sliding_window_pattern-th layer is global (default 6); layer_types, where given, decide."""
    assert attention_shape(_config(tmp_path / "a", GEMMA3), 4, 2, 1024).windows == (128, 128, None) * 2
    assert sliding_layers(_config(tmp_path / "b", GEMMA3, sliding_window_pattern=_DROP, num_hidden_layers=7)
                          ).sliding == (True,) * 5 + (False, True)
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention", "full_attention",
             "sliding_attention"]
    assert attention_shape(_config(tmp_path / "c", GEMMA3, layer_types=types), 4, 2, 1024).windows == \
        (None, 128, 128, None, None, 128)
    shape = attention_shape(_config(tmp_path / "d", GEMMA3), 4, 2, 1024)
    assert shape.softcap is None and shape.scale == 24 ** -0.5


def test_windows_covering_the_context_mask_nothing(tmp_path):
    cfg = _config(tmp_path, GEMMA2)
    assert layer_windows(cfg, 128) == (None,) * 4
    assert layer_windows(cfg, 129) == (128, None, 128, None)
    assert attention_shape(cfg, 4, 2, 128).windows == ()


@pytest.mark.parametrize("base,changes,words", [
    (GEMMA2, dict(use_bidirectional_attention=True), ("bidirectional attention", "attends causally")),
    (GEMMA2, dict(hidden_activation="gelu"), ("MLP activation 'gelu'", "gelu_pytorch_tanh(gate) * up")),
    (GEMMA3, dict(attn_logit_softcapping=50.0), ("attn_logit_softcapping=50.0", "ignored by transformers' Gemma 3")),
    (GEMMA3, dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), ("RoPE scaling 'yarn'", "full_attention RoPE")),
    (GEMMA3, dict(rope_scaling={"rope_type": "linear"}), ("linear RoPE scaling without a numeric factor",)),
    (GEMMA3, dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}), ("Gemma 3 reads RoPE per layer",)),
    (GEMMA3, dict(rope_parameters={"sliding_attention": {"rope_type": "dynamic", "factor": 2.0}}),
     ("RoPE scaling 'dynamic'", "sliding_attention RoPE")),
    (GEMMA2, dict(final_logit_softcapping=-1.0), ("final_logit_softcapping=-1.0", "positive number")),
    (GEMMA2, dict(sliding_window=None), ("sliding-window attention", "no window size")),
    (GEMMA2, dict(rope_scaling={"rope_type": "su", "factor": 4.0}), ("RoPE scaling 'su'",)),  # support's own check
    (GEMMA3, dict(sliding_window_pattern=0), ("sliding_window_pattern=0",)),
    (GEMMA2, dict(layer_types=["sliding_attention", "full_attention"]), ("lists 2 layers for num_hidden_layers=4",)),
    (GEMMA2, dict(layer_types=["chunked_attention", "full_attention"] * 2), ("chunked_attention",)),
])
def test_gemma_configs_we_would_compute_otherwise_are_refused(tmp_path, base, changes, words):
    with pytest.raises(ValueError) as err:
        _resolve(_config(tmp_path, base, **changes))
    for word in words:
        assert word in str(err.value), str(err.value)


def test_gemma3_hub_and_transformers5_configs_are_served(tmp_path):
    """The Hub's fields (rope_local_base_freq, linear rope_scaling on the global layers) and transformers 5's
    per-layer-type rope_parameters both resolve; Gemma 2's unread hidden_act and its soft-caps are no refusal."""
    _resolve(_config(tmp_path / "hub", GEMMA3, rope_scaling={"rope_type": "linear", "factor": 8.0}))
    nested = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    _resolve(_config(tmp_path / "t5", GEMMA3, rope_parameters=nested, rope_theta=_DROP, rope_local_base_freq=_DROP))
    _resolve(_config(tmp_path / "g2", GEMMA2))


class _Plain(AttentionBackend):
    """A backend that computes neither windows nor soft-caps."""

    name = "plain"

    def plan(self, batch):
        return None

    def forward(self, layer_id, q, k, v, batch, metadata):
        raise NotImplementedError


def test_a_backend_without_windows_or_soft_caps_refuses_a_model_that_needs_them():
    with pytest.raises(ValueError, match="'plain' has no sliding-window attention"):
        _Plain(AttentionShape(4, 2, 32, 0.1, windows=(8, None)), None, None)
    with pytest.raises(ValueError, match="'plain' has no attention logit soft-capping"):
        _Plain(AttentionShape(4, 2, 32, 0.1, softcap=50.0), None, None)
    _Plain(AttentionShape(4, 2, 32, 0.1, windows=(None, None)), None, None)


def test_distinct_windows():
    assert AttentionShape(4, 2, 32, 0.1).distinct_windows() == (None,)
    assert AttentionShape(4, 2, 32, 0.1, windows=(8, None, 8, 4)).distinct_windows() == (None, 4, 8)
    assert AttentionShape(4, 2, 32, 0.1, windows=(8, 8)).distinct_windows() == (8,)


def test_dots1_slides_from_max_window_layers_without_a_switch(tmp_path):
    """dots.llm1's config (Dots1Config): no use_sliding_window switch; without layer_types the layers from
    max_window_layers on slide over sliding_window tokens (window 4096 and 62 layers by default: none of its published
    62 layers slides); layer_types wins when given."""
    dots = dict(architectures=["Dots1ForCausalLM"], model_type="dots1", hidden_size=64, intermediate_size=128,
                moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=512, n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=1024)
    assert sliding_layers(_config(tmp_path / "a", dots, sliding_window=64, max_window_layers=2)).sliding == (
        False, False, True, True)
    assert sliding_layers(_config(tmp_path / "b", dots)).sliding == (False,) * 4  # 62 by default
    assert sliding_layers(_config(tmp_path / "b2", dots, num_hidden_layers=64)).count == 2  # 4096 from layer 62
    listed = _config(tmp_path / "c", dots, sliding_window=64, max_window_layers=2,
                     layer_types=["sliding_attention", "full_attention", "full_attention", "full_attention"])
    assert layer_windows(listed, 1024) == (64, None, None, None)
