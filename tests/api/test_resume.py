"""A migrated request continues exactly (Engine `resume_ids`, what a router sends a second worker when the first
failed mid-stream): given the first k tokens of an unfailed run, the engine streams exactly the rest: the same
tokens and the same text deltas, under greedy, seeded sampling with penalties, stop strings, min_new_tokens and a
JSON-schema grammar; the totals count the resumed tokens. What cannot continue fails clearly."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.conftest import model_path
from tests.engine_utils import running_engine

PATH = model_path("tiny-qwen2")
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
          "required": ["a", "b"], "additionalProperties": False}
CASES = {
    "greedy": {"max_new_tokens": 24, "temperature": 0},
    "seeded-penalties": {"max_new_tokens": 24, "temperature": 0.9, "sampling_seed": 11, "frequency_penalty": 0.7,
                         "presence_penalty": 0.3, "repetition_penalty": 1.2, "min_new_tokens": 20},
    "stop-string": {"max_new_tokens": 40, "temperature": 0.8, "sampling_seed": 3, "stop": [" the", "\n\n"]},
    "json-schema": {"max_new_tokens": 60, "temperature": 0.7, "sampling_seed": 5, "json_schema": json.dumps(SCHEMA)},
}


async def _stream(llm, params: dict, resume: list[int] | None = None) -> tuple[list[int], str, dict]:
    ids, text, last = [], "", None
    async for delta in await llm.async_generate(prompt="The lighthouse keeper said", sampling_params=params,
                                                stream=True, resume_ids=resume):
        ids += delta["output_ids"]
        text += delta["text"]
        last = delta["meta_info"]
    return ids, text, last


@pytest.fixture(scope="module")
def llm():
    with running_engine(PATH, stream_output=True, page_size=4, max_total_tokens=2048) as e:
        yield e


@pytest.mark.parametrize("case", CASES)
def test_a_resumed_request_streams_exactly_the_rest(llm, case):
    params = CASES[case]
    full_ids, full_text, meta = asyncio.run(_stream(llm, params))
    assert len(full_ids) >= 6, full_ids
    for k in (1, len(full_ids) // 2, len(full_ids) - 1):
        head_ids, head_text = [], ""

        async def head():  # what the first worker streamed before it died: k tokens, and their text
            nonlocal head_text
            async for delta in await llm.async_generate(prompt="The lighthouse keeper said", sampling_params=params,
                                                        stream=True):
                head_ids.extend(delta["output_ids"])
                head_text += delta["text"]
                if len(head_ids) >= k:
                    return
        asyncio.run(head())
        on_boundary = len(head_ids) == k  # the stream broke where a delta ended: its text is known too
        head_ids = head_ids[:k]
        rest_ids, rest_text, rest_meta = asyncio.run(_stream(llm, params, head_ids))
        assert head_ids + rest_ids == full_ids, (case, k)
        assert rest_meta["completion_tokens"] == meta["completion_tokens"]
        assert rest_meta["finish_reason"] == meta["finish_reason"]
        if on_boundary:
            assert head_text + rest_text == full_text, (case, k)


def test_what_cannot_continue_fails_clearly(llm):
    greedy = CASES["greedy"]
    with pytest.raises(ValueError, match="nothing is left of max_new_tokens"):
        asyncio.run(_stream(llm, {**greedy, "max_new_tokens": 3}, [5, 6, 7]))
    with pytest.raises(ValueError, match="n = 1"):
        asyncio.run(_stream(llm, {**greedy, "n": 2}, [5]))
    with pytest.raises(ValueError, match="grammar"):
        asyncio.run(_stream(llm, CASES["json-schema"], [llm.tokenizer.encode("]")[0]]))
