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


async def _stream(llm, params: dict, resume: list[int] | None = None, chars: int | None = None
                  ) -> tuple[list[tuple[list[int], str]], dict]:
    """The stream's deltas as (token ids, text), and its last meta_info."""
    deltas, last = [], None
    async for delta in await llm.async_generate(prompt="The lighthouse keeper said", sampling_params=params,
                                                stream=True, resume_ids=resume, resume_text_chars=chars):
        deltas.append((delta["output_ids"], delta["text"]))
        last = delta["meta_info"]
    return deltas, last


@pytest.fixture(scope="module")
def llm():
    with running_engine(PATH, stream_output=True, page_size=4, max_total_tokens=2048) as e:
        yield e


@pytest.mark.parametrize("case", CASES)
def test_a_resumed_request_streams_exactly_the_rest(llm, case):
    """Cut after every delta of the unfailed stream (where a failed worker's last message can end), the text the
    client had included: the continuation's tokens and text are exactly the rest, also where the cut falls inside a
    multi-byte character or a possible stop string (text the first worker still held back)."""
    params = CASES[case]
    deltas, meta = asyncio.run(_stream(llm, params))
    full_ids = [t for ids, _ in deltas for t in ids]
    full_text = "".join(text for _, text in deltas)
    assert len(full_ids) >= 6, full_ids
    held_back = 0
    for cut in range(1, len(deltas)):
        head_ids = [t for ids, _ in deltas[:cut] for t in ids]
        head_text = "".join(text for _, text in deltas[:cut])
        if len(head_ids) >= params["max_new_tokens"] or not head_ids:
            continue
        held_back += llm.tokenizer.decode(head_ids) != head_text
        rest, rest_meta = asyncio.run(_stream(llm, params, head_ids, len(head_text)))
        assert head_ids + [t for ids, _ in rest for t in ids] == full_ids, (case, cut)
        assert head_text + "".join(text for _, text in rest) == full_text, (case, cut)
        assert rest_meta["completion_tokens"] == meta["completion_tokens"]
        assert rest_meta["finish_reason"] == meta["finish_reason"]
    if case == "greedy":  # this case's stream cuts inside a character somewhere: the hard case is covered
        assert held_back, "no cut fell where the first worker held text back"


def test_what_cannot_continue_fails_clearly(llm):
    greedy = CASES["greedy"]
    with pytest.raises(ValueError, match="nothing is left of max_new_tokens"):
        asyncio.run(_stream(llm, {**greedy, "max_new_tokens": 3}, [5, 6, 7]))
    with pytest.raises(ValueError, match="n = 1"):
        asyncio.run(_stream(llm, {**greedy, "n": 2}, [5]))
    with pytest.raises(ValueError, match="grammar"):
        asyncio.run(_stream(llm, CASES["json-schema"], [llm.tokenizer.encode("]")[0]]))


def test_without_the_text_count_the_text_resumes_as_after_a_token_by_token_stream(llm):
    """resume_text_chars unset (a direct engine caller): the client is taken to have what a stream that sent every
    token on its own would have shown (everything but a character still incomplete at the cut)."""
    from radixmesh.engine.detokenizer import IncrementalDetokenizer

    params = CASES["greedy"]
    deltas, _ = asyncio.run(_stream(llm, params))
    full_ids = [t for ids, _ in deltas for t in ids]
    full_text = "".join(text for _, text in deltas)
    for k in range(1, len(full_ids) - 1):
        shown = IncrementalDetokenizer(llm.tokenizer)
        for token in full_ids[:k]:
            shown.push([token])
        rest, _ = asyncio.run(_stream(llm, params, full_ids[:k]))
        assert shown.text + "".join(text for _, text in rest) == full_text, k
