"""Decode rotating q and storing the step's keys and values inside decode attention's stage 1
(engine.attention.triton_backend.ROPE_IN_ATTENTION, kernels.decode_attention's RopeStore) on CUDA, in CUDA graphs:
token-exact with transformers in float32, logprobs within 1e-3, with Qwen3's per-head q/k norms and without (Llama),
and under a sliding window (Mistral), each at a power-of-two head_dim (the tiny bundled Qwen3s' 48 is not one: they
keep the rotary kernel)."""

from __future__ import annotations

import pytest

from tests.conftest import model_path
from tests.engine_utils import greedy_like_transformers, parity_prompts, running_engine
from tests.sliding_models import build, prompts as seeded_prompts

pytestmark = pytest.mark.gpu
MAX_NEW = 16  # (tests.sliding_models' seeds keep these greedy references clear of ties)


@pytest.mark.parametrize("model", ["qwen3", "tiny-llama", "mistral"])
def test_rotating_inside_decode_attention_matches_transformers(model, monkeypatch, tmp_path):
    from radixmesh.engine.attention import triton_backend

    monkeypatch.setattr(triton_backend, "ROPE_IN_ATTENTION", True)
    if model.startswith("tiny"):
        path, prompts = model_path(model), parity_prompts(model_path(model))[:3]
    else:
        path, prompts = build(model, tmp_path / model, head_dim=64), seeded_prompts()[:3]
    # a batch of 3 replays the graph of 4: one padding row
    with running_engine(path, device="cuda", dtype="float32", skip_tokenizer_init=True, disable_radix_cache=True,
                        attention_backend="triton") as llm:
        assert llm.runner.graphs is not None
        greedy_like_transformers(llm, path, prompts, MAX_NEW)
