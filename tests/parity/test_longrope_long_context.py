"""LongRoPE served past original_max_position_embeddings (engine.layers.rope_scaling's decision): a tiny Phi-3 whose
original context is 32 tokens and whose max_position_embeddings is 128, served with its full context. Every prompt
longer than 32 tokens is token-exact with transformers in float32 (which rotates such a prompt whole with
long_factor), through chunked prefill over paged KV, a second pass over the cached prefixes and prompts sharing a
prefix longer than the original context. A prompt that fits in the original context is rotated with long_factor
too: equal to transformers with long_factor in place of short_factor, and not to transformers as shipped (there the
factors differ). Served with --context-length 32, every position uses short_factor, as transformers does."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.engine_utils import running_engine
from tests.parity.test_model_families import write_checkpoint
from tests.reference import hf_greedy, hf_token_logprobs

ORIGINAL, MAX_POSITIONS, MAX_NEW = 32, 128, 12
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.15 * i for i in range(8)],
            "long_factor": [3.0 + 1.5 * i for i in range(8)]}
FIELDS = dict(original_max_position_embeddings=ORIGINAL, max_position_embeddings=MAX_POSITIONS, rope_scaling=LONGROPE)
SHARED = [1] + [(7 * i) % 200 + 20 for i in range(39)]  # 40 tokens: longer than the original context
LONG_PROMPTS = [[1] + list(range(20, 52)),  # 33 tokens: the first length transformers rotates with long_factor
                SHARED + [5, 6, 7], SHARED + [90, 91, 92, 93, 94, 95], [1] + [(3 * i) % 230 + 10 for i in range(70)]]
SHORT_PROMPTS = [[1, 17, 42, 99, 3], [1] + list(range(60, 91))]  # 5 and 32 tokens
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}
SERVE = dict(skip_tokenizer_init=True, chunked_prefill_size=16, page_size=4)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory) -> str:
    return write_checkpoint(tmp_path_factory.mktemp("phi3-longrope"), "Phi3Config", "Phi3ForCausalLM", FIELDS,
                            seed=500)


@pytest.fixture(scope="module")
def phi3_long_only(phi3, tmp_path_factory) -> str:
    """The same weights with short_factor replaced by long_factor: transformers rotating every position with it."""
    dst = tmp_path_factory.mktemp("phi3-long-only") / "ckpt"
    shutil.copytree(phi3, dst)
    raw = json.loads((dst / "config.json").read_text())
    rope = raw.get("rope_scaling") or raw["rope_parameters"]
    rope["short_factor"] = list(rope["long_factor"])
    (dst / "config.json").write_text(json.dumps(raw))
    return str(dst)


def _reference(path: str, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    refs = hf_greedy(path, prompts, MAX_NEW)
    return refs, [hf_token_logprobs(path, p, r) for p, r in zip(prompts, refs)]


def _run(path: str, prompts: list[list[int]], passes: int = 1, **kwargs) -> list[list[dict]]:
    with running_engine(path, **SERVE, **kwargs) as llm:
        return [llm.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True) for _ in range(passes)]


def _logprobs(outs: list[dict]) -> list[list[float]]:
    return [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]


def _assert_matches(outs: list[dict], refs: list[list[int]], logprobs: list[list[float]]) -> None:
    assert [o["output_ids"] for o in outs] == refs
    for got, want in zip(_logprobs(outs), logprobs):
        assert got == pytest.approx(want, abs=1e-4)


def test_prompts_past_the_original_context_match_transformers(phi3):
    refs, logprobs = _reference(phi3, LONG_PROMPTS)
    assert len({tuple(r) for r in refs}) == len(refs), "the reference does not depend on the prompt"
    first, second = _run(phi3, LONG_PROMPTS, passes=2)  # the context defaults to max_position_embeddings (128)
    _assert_matches(first, refs, logprobs)
    _assert_matches(second, refs, logprobs)  # over the cached prefixes (40 shared tokens, longer than the original)
    assert all(o["meta_info"]["cached_tokens"] >= 32 for o in second)


def test_short_prompts_are_rotated_with_long_factor_past_the_original_context(phi3, phi3_long_only):
    """The decision: one rotation per position for every request once the context passes the original one."""
    long_refs, long_logprobs = _reference(phi3_long_only, SHORT_PROMPTS)
    [outs] = _run(phi3, SHORT_PROMPTS)
    _assert_matches(outs, long_refs, long_logprobs)
    # transformers as shipped rotates the 5-token prompt and its answer (17 tokens) with short_factor
    shipped = hf_token_logprobs(phi3, SHORT_PROMPTS[0], outs[0]["output_ids"])
    assert max(abs(a - b) for a, b in zip(_logprobs(outs)[0], shipped)) > 1e-2


def test_the_original_context_rotates_with_short_factor(phi3):
    prompts = [SHORT_PROMPTS[0], [1] + list(range(100, 119))]  # with their answers inside 32 tokens
    refs, logprobs = _reference(phi3, prompts)
    [outs] = _run(phi3, prompts, context_length=ORIGINAL)
    _assert_matches(outs, refs, logprobs)


def test_the_long_factors_matter(phi3, phi3_long_only, tmp_path):
    """Transformers' own answers to the long prompts move when long_factor is changed: the parity above rests on it."""
    dst = tmp_path / "other-long"
    shutil.copytree(phi3_long_only, dst)
    raw = json.loads((dst / "config.json").read_text())
    rope = raw.get("rope_scaling") or raw["rope_parameters"]
    rope["long_factor"] = LONGROPE["short_factor"]
    (dst / "config.json").write_text(json.dumps(raw))
    prompt = LONG_PROMPTS[1]
    [ref] = hf_greedy(phi3, [prompt], MAX_NEW)
    moved = hf_token_logprobs(str(dst), prompt, ref)
    assert max(abs(a - b) for a, b in zip(moved, hf_token_logprobs(phi3, prompt, ref))) > 1e-2
