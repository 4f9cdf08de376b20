"""A reasoning model's structured output: the constraint binds the answer, not the thinking (SGLang's behaviour
with --reasoning-parser). Requests carry the token that ends the thinking (reasoning_end_token_id) and, when the
prompt leaves the thinking closed, the token that may open it first (reasoning_start_token_id). tiny-qwen3's
tokenizer has Qwen3's <think> (1000) and </think> (1001); a logit bias makes the tiny model close its thinking."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.conftest import model_path
from tests.engine_utils import running_engine

THINK, END_THINK = 1000, 1001
CLOCK = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}, "utc": {"type": "boolean"}},
         "required": ["tz", "utc"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    with running_engine(model_path("tiny-qwen3")) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts(llm):
    """(ids of a prompt whose thinking is open, ids of one whose answer starts fresh)."""
    ask = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is two plus two?"}], tokenize=False,
                                            add_generation_prompt=True)
    return (llm.tokenizer(ask + "<think>\nLet me see").input_ids, llm.tokenizer(ask).input_ids)


def _ids(llm, input_ids, **params) -> list[int]:
    return llm.generate(input_ids=input_ids, sampling_params={"temperature": 0, **params})["output_ids"]


def test_the_thinking_is_free_and_the_answer_constrained(llm, prompts):
    thinking = prompts[0]
    bias = {str(END_THINK): 8}
    free = _ids(llm, thinking, max_new_tokens=40, logit_bias=bias)
    out = llm.generate(input_ids=thinking, sampling_params={
        "temperature": 0, "max_new_tokens": 80, "logit_bias": bias, "json_schema": json.dumps(CLOCK),
        "reasoning_end_token_id": END_THINK})
    ids = out["output_ids"]
    assert END_THINK in ids[1:], ids  # the bias closes the thinking after a few free tokens
    cut = ids.index(END_THINK) + 1
    assert ids[:cut] == free[:cut]  # token-exact with the unconstrained output up to </think>
    answer = out["text"].partition("</think>")[2]
    jsonschema.validate(json.loads(answer), CLOCK)
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    # the answer is what the grammar makes of the prompt plus the thinking
    assert ids[cut:] == _ids(llm, thinking + ids[:cut], max_new_tokens=80, logit_bias=bias,
                             json_schema=json.dumps(CLOCK))


def test_thinking_that_never_ends_is_never_constrained(llm, prompts):
    free = _ids(llm, prompts[0], max_new_tokens=12)
    assert END_THINK not in free
    assert _ids(llm, prompts[0], max_new_tokens=12, json_schema=json.dumps(CLOCK),
                reasoning_end_token_id=END_THINK) == free


def test_the_opening_token_is_allowed_first_and_frees_what_follows(llm, prompts):
    answer_first = prompts[1]
    push = {"max_new_tokens": 4, "logit_bias": {str(THINK): 50}, "json_schema": json.dumps(CLOCK)}
    assert _ids(llm, answer_first, **push, reasoning_end_token_id=END_THINK,
                reasoning_start_token_id=THINK) == [THINK] * 4  # <think> first, then nothing binds
    constrained = _ids(llm, answer_first, **push)  # without the gate <think> is never valid JSON
    assert THINK not in constrained and llm.tokenizer.decode(constrained).startswith("{")


def test_an_answer_that_starts_without_thinking_is_constrained_from_its_first_token(llm, prompts):
    gated = llm.generate(input_ids=prompts[1], sampling_params={
        "temperature": 0, "max_new_tokens": 80, "json_schema": json.dumps(CLOCK),
        "reasoning_end_token_id": END_THINK, "reasoning_start_token_id": THINK})
    plain = llm.generate(input_ids=prompts[1], sampling_params={
        "temperature": 0, "max_new_tokens": 80, "json_schema": json.dumps(CLOCK)})
    assert THINK not in gated["output_ids"] and gated["output_ids"] == plain["output_ids"]
    jsonschema.validate(json.loads(gated["text"]), CLOCK)


@pytest.mark.parametrize("params, words", [
    ({"reasoning_start_token_id": THINK}, "needs reasoning_end_token_id"),
    ({"reasoning_end_token_id": -1}, "reasoning_end_token_id must be >= 0"),
    ({"reasoning_end_token_id": 10**7}, "outside the vocabulary"),
    ({"reasoning_end_token_id": "x"}, "must be an integer"),
])
def test_bad_reasoning_tokens_are_clear_errors(llm, params, words):
    with pytest.raises(ValueError, match=words):
        llm.generate("hi", {"max_new_tokens": 2, "json_schema": json.dumps(CLOCK), **params})


def test_prefill_decode_pairs_gate_the_constraint_as_one_engine_does(llm, prompts):
    """The prefill side samples the first token (it may open the thinking), the decode side's matcher starts from
    it: token-exact with the colocated engine."""
    import asyncio

    from tests.unit.test_pd_handoff import OPTS, Pair

    path = model_path("tiny-qwen3")
    cases = [(prompts[0], {"logit_bias": {str(END_THINK): 8}, "reasoning_end_token_id": END_THINK}),
             (prompts[1], {"logit_bias": {str(THINK): 50}, "reasoning_end_token_id": END_THINK,
                           "reasoning_start_token_id": THINK}),
             (prompts[1], {"reasoning_end_token_id": END_THINK, "reasoning_start_token_id": THINK})]
    with running_engine(path, **OPTS) as p, running_engine(path, **OPTS) as d:
        pair = Pair(p, d)
        for ids, gate in cases:
            params = {"temperature": 0, "max_new_tokens": 60, "json_schema": json.dumps(CLOCK), **gate}
            expected = llm.generate(input_ids=ids, sampling_params=params)["output_ids"]
            got = asyncio.run(pair.generate(ids, params))["output_ids"]
            assert got == expected
