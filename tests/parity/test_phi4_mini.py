"""Phi-4-mini's shape of Phi-3 (Phi3ForCausalLM with partial_rotary_factor 0.75 and tied embeddings): RoPE turns only
the first int(head_dim * 0.75) dimensions of each head, the rest pass through. Token-exact with transformers in
float32 on tiny random checkpoints written here, with plain RoPE and with LongRoPE (its factors per rotated pair), and
a check that the factor matters (transformers' own logprobs move far beyond the tolerance without it). Architectures
whose transformers code rotates whole heads refuse a partial factor, and a factor that leaves an odd or empty rotated
part is refused with a clear error."""

from __future__ import annotations

import json
import shutil

import pytest

from radixmesh.engine import Engine
from tests.engine_utils import running_engine
from tests.parity.test_model_families import COMMON, MAX_NEW, ORIGINAL, PROMPTS, write_checkpoint
from tests.reference import hf_greedy, hf_token_logprobs

FACTOR = 0.75
HEAD_DIM = COMMON["hidden_size"] // COMMON["num_attention_heads"]  # 16: 12 rotated, 4 passed through
PAIRS = int(HEAD_DIM * FACTOR) // 2
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.2 * i for i in range(PAIRS)],
            "long_factor": [4.0 + 2.0 * i for i in range(PAIRS)]}
VARIANTS = {
    "default": dict(partial_rotary_factor=FACTOR, tie_word_embeddings=True),
    "longrope": dict(partial_rotary_factor=FACTOR, tie_word_embeddings=True, original_max_position_embeddings=ORIGINAL,
                     rope_scaling=LONGROPE),
}
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {name: write_checkpoint(tmp_path_factory.mktemp(f"phi4-{name}"), "Phi3Config", "Phi3ForCausalLM", fields,
                                   seed=300 + i) for i, (name, fields) in enumerate(VARIANTS.items())}


def _reference(path: str) -> tuple[list[list[int]], list[list[float]]]:
    refs = hf_greedy(path, PROMPTS, MAX_NEW)
    return refs, [hf_token_logprobs(path, p, r) for p, r in zip(PROMPTS, refs)]


def _config(path: str) -> dict:
    with open(f"{path}/config.json") as f:
        return json.load(f)


def _variant(path: str, dst, edit) -> str:
    shutil.copytree(path, dst)
    raw = _config(path)
    edit(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    return str(dst)


@pytest.mark.parametrize("name", VARIANTS)
def test_partial_rotary_matches_transformers(checkpoints, name):
    path = checkpoints[name]
    raw = _config(path)
    assert raw["tie_word_embeddings"] and FACTOR in (raw.get("partial_rotary_factor"),
                                                      (raw.get("rope_parameters") or {}).get("partial_rotary_factor"))
    refs, logprobs = _reference(path)
    with running_engine(path, skip_tokenizer_init=True, chunked_prefill_size=16, page_size=4,
                        context_length=ORIGINAL) as llm:
        assert llm.runner.model.rotary.rotary_dim == 2 * PAIRS
        for _ in range(2):  # the second pass over cached prefixes
            outs = llm.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
            assert [o["output_ids"] for o in outs] == refs
            for out, want in zip(outs, logprobs):
                got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
                assert got == pytest.approx(want, abs=1e-4)


def test_the_factor_matters(checkpoints, tmp_path):
    """Rotating every dimension instead moves transformers' own logprobs by more than 0.1."""
    path = checkpoints["default"]

    def full(raw: dict) -> None:
        raw["partial_rotary_factor"] = 1.0
        if raw.get("rope_parameters"):
            raw["rope_parameters"]["partial_rotary_factor"] = 1.0

    whole = _variant(path, tmp_path / "whole", full)
    refs, logprobs = _reference(path)
    moved = max(abs(a - b) for p, r, lp in zip(PROMPTS, refs, logprobs)
                for a, b in zip(lp, hf_token_logprobs(whole, p, r)))
    assert moved > 0.1


def test_a_factor_transformers_does_not_compute_is_refused(tmp_path):
    """Llama's transformers code rotates whole heads: a partial factor there is refused, never served."""
    path = write_checkpoint(tmp_path / "llama", "LlamaConfig", "LlamaForCausalLM", {}, seed=1)

    def partial(raw: dict) -> None:
        raw["partial_rotary_factor"] = 0.5

    bad = _variant(path, tmp_path / "partial", partial)
    with pytest.raises(ValueError, match="partial rotary embedding .*LlamaForCausalLM"):
        Engine(model_path=bad, device="cpu", dtype="float32", skip_tokenizer_init=True)


@pytest.mark.parametrize("factor", [0.7, 0.0, 1.5])
def test_a_factor_without_an_even_rotated_part_is_refused(checkpoints, tmp_path, factor):
    def set_factor(raw: dict) -> None:
        raw["partial_rotary_factor"] = factor
        if raw.get("rope_parameters"):
            raw["rope_parameters"]["partial_rotary_factor"] = factor

    bad = _variant(checkpoints["default"], tmp_path / "bad", set_factor)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        Engine(model_path=bad, device="cpu", dtype="float32", skip_tokenizer_init=True)
