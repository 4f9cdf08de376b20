"""Decode rotating q and storing the step's keys and values inside decode attention's stage 1
(engine.attention.triton_backend.ROPE_IN_ATTENTION, kernels.decode_attention's RopeStore) on CUDA, in CUDA graphs:
token-exact with transformers in float32, logprobs within 1e-3, with Qwen3's per-head q/k norms and without (Llama),
and under a sliding window (Mistral), each at a power-of-two head_dim (the tiny bundled Qwen3s' 48 is not one: they
keep the rotary kernel)."""

from __future__ import annotations

import pytest

from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine
from tests.reference import hf_greedy, hf_token_logprobs
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
    refs = hf_greedy(path, prompts, MAX_NEW)
    with running_engine(path, device="cuda", dtype="float32", skip_tokenizer_init=True, disable_radix_cache=True,
                        attention_backend="triton") as llm:
        assert llm.runner.graphs is not None
        outs = llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0},
                            return_logprob=True)
        assert [o["output_ids"] for o in outs] == refs
        for p, out, ref in zip(prompts, outs, refs):
            got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
            assert got == pytest.approx(hf_token_logprobs(path, p, ref), abs=1e-3)
