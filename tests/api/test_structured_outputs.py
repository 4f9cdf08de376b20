"""Structured outputs through xgrammar: every constrained output parses and validates (JSON schema), fully
matches (regex) or is accepted by the grammar (EBNF); an invalid constraint is a clear error."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.conftest import model_path
from tests.engine_utils import running_engine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ada", "grace", "linus"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["name", "age", "admin", "tags"],
    "additionalProperties": False,
}
REGEX = r"(yes|no|maybe), [0-9]{2,4} (cats|dogs)\."
EBNF = 'root ::= "(" expr ")"\nexpr ::= num | num "+" expr\nnum ::= [1-9] [0-9]?'
PROMPTS = [f"Request {i}: give the record for user number {i * 7}." for i in range(20)]


@pytest.fixture(scope="module")
def llm():
    with running_engine(model_path("tiny-qwen2"), random_seed=3) as engine:
        yield engine


def run(llm, **constraint):
    params = [{"max_new_tokens": 120, "temperature": 0.8, **constraint} for _ in PROMPTS]
    outs = llm.generate(PROMPTS, params)
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs), [o["text"] for o in outs]
    return [o["text"] for o in outs]


def test_json_schema_outputs_validate(llm):
    for text in run(llm, json_schema=json.dumps(SCHEMA)):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_outputs_fully_match(llm):
    texts = run(llm, regex=REGEX)
    assert all(re.fullmatch(REGEX, t) for t in texts), texts
    assert len(set(texts)) > 1  # the constraint leaves room for sampling


def test_ebnf_outputs_are_accepted(llm):
    import xgrammar as xgr

    compiled = llm._grammars._compiler.compile_grammar(EBNF)
    for text in run(llm, ebnf=EBNF):
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(text) and matcher.is_completed(), text
        assert re.fullmatch(r"\((?:[1-9][0-9]?\+)*[1-9][0-9]?\)", text)


@pytest.mark.parametrize("constraint", [
    {"json_schema": "{not json"}, {"regex": "(unclosed"}, {"ebnf": "root ::= missing_rule"},
])
def test_invalid_constraint_is_rejected_and_engine_keeps_serving(llm, constraint):
    field = next(iter(constraint))
    with pytest.raises(ValueError, match=f"invalid {field}"):
        llm.generate("hi", {"max_new_tokens": 4, **constraint})
    assert llm.generate("hi", {"max_new_tokens": 4})["meta_info"]["completion_tokens"] == 4


def test_greedy_constrained_output_is_stable(llm):
    a = llm.generate(PROMPTS[0], {"max_new_tokens": 40, "temperature": 0, "regex": REGEX})
    b = llm.generate(PROMPTS[0], {"max_new_tokens": 40, "temperature": 0, "regex": REGEX})
    assert a["text"] == b["text"] and re.fullmatch(REGEX, a["text"])


def test_concurrent_async_requests_with_grammars(llm):
    import asyncio

    async def main():
        calls = [llm.async_generate(p, {"max_new_tokens": 120, "temperature": 0.8,
                                        **({"json_schema": json.dumps(SCHEMA)} if i % 2 else {"regex": REGEX})})
                 for i, p in enumerate(PROMPTS[:8])]
        return await asyncio.gather(*calls)

    outs = asyncio.run(main())
    for i, out in enumerate(outs):
        if i % 2:
            jsonschema.validate(json.loads(out["text"]), SCHEMA)
        else:
            assert re.fullmatch(REGEX, out["text"])
    assert ("regex", REGEX) in llm._grammars._cache  # compiled once, then shared


# Strings bounded by minLength/maxLength: xgrammar 0.2.8 lets raw control characters (\x00-\x1f except the
# newline) into them, which JSON forbids (json.loads fails); the grammar cache lowers them to patterns.
# Without that lowering, 164 of 500 sampled outputs failed (one in three; the first at the 4th prompt): 100 prompts
# leave the regression unnoticed with a probability of about 1e-17.
BOUNDED = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 12},
        "code": {"type": "string", "minLength": 2, "maxLength": 6},
        "note": {"type": ["string", "null"], "maxLength": 24},
        "words": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 8}, "maxItems": 3},
        "nested": {"type": "object", "properties": {"tag": {"$ref": "#/$defs/short"}}, "required": ["tag"],
                   "additionalProperties": False},
    },
    "required": ["title", "code", "note", "words", "nested"],
    "additionalProperties": False,
    "$defs": {"short": {"type": "string", "maxLength": 4}},
}


def test_bounded_string_outputs_always_parse_and_validate(llm):
    prompts = [f"Record {i}: write a short title, a code and a note." for i in range(100)]
    params = {"max_new_tokens": 160, "temperature": 1.0, "json_schema": json.dumps(BOUNDED)}
    outs = llm.generate(prompts, [params] * len(prompts))
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["text"]
        jsonschema.validate(json.loads(out["text"]), BOUNDED)
