"""GPT-OSS's harmony output (services.router.harmony): reasoning, content and tool calls split alike whole and
streamed in any chunking; calls kept only for the request's tools; text outside any header is content; the router
keeps special tokens in the text of the chats it reads so, and the engine leaves a stop token's text out."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from radixmesh.services.router import openai_api
from radixmesh.services.router.chat_output import OutputSpec, SampleParser
from radixmesh.services.router.harmony import HarmonySplitter, split_harmony
from radixmesh.services.router.openai_request import parse_chat_completion
from radixmesh.services.router.reasoning import reasoning_format, starts_in_reasoning
from radixmesh.services.router.tool_call_parsers import make_tool_parser
from radixmesh.services.router.tool_parsers import ToolCallDelta
from tests.unit.test_tool_parsers import TOOLS, UNICODE_ARGS, chunkings

TOOL_SCHEMAS = {"get_weather": {}, "search": {}, "ping": {}}
GPT_OSS = reasoning_format("gpt-oss")


def header(channel: str, to: str | None = None, first: bool = False, on_role: bool = False) -> str:
    """A message header as GPT-OSS writes it (the output's first has no role: the prompt ends with it)."""
    role = "" if first else "<|start|>assistant" + (f" to={to}" if to and on_role else "")
    recipient = f" to={to} <|constrain|>json" if to and not on_role else (" json" if to else "")
    return f"{role}<|channel|>{channel}{recipient}<|message|>"


def calls_of(deltas: list[ToolCallDelta]) -> list[tuple[str, dict]]:
    names, args = {}, {}
    for d in deltas:
        if d.name is not None:
            assert d.index not in names and d.index == len(names), "calls are announced once, in order"
            names[d.index] = d.name
        args[d.index] = args.get(d.index, "") + d.arguments
    return [(names[i], json.loads(args[i])) for i in sorted(names)]


# (text, in_analysis, reasoning, content, calls): well-formed outputs
CASES = [
    (header("analysis", first=True) + "The user greets. Reply.<|end|>" + header("final") + "Hello! 🙂<|return|>",
     False, "The user greets. Reply.", "Hello! 🙂", []),
    (header("analysis", first=True) + "Need the weather.<|end|>" + header("commentary", "functions.get_weather")
     + json.dumps(UNICODE_ARGS, ensure_ascii=False) + "<|call|>",
     False, "Need the weather.", "", [("get_weather", UNICODE_ARGS)]),
    # the recipient on the role, the stop token left out of the text, two calls after a preamble
    (header("analysis", first=True) + "Two lookups.<|end|>" + header("commentary") + "Checking both.<|end|>"
     + header("commentary", "functions.search", on_role=True) + '{"query": "a b", "filters": {}}<|call|>'
     + header("commentary", "functions.ping") + "{}",
     False, "Two lookups.", "Checking both.", [("search", {"query": "a b", "filters": {}}), ("ping", {})]),
    # the prompt opened the analysis; a body left open ends where the next header begins
    ("still thinking" + header("final") + "Done.", True, "still thinking", "Done.", []),
    # no header at all (a constrained answer): content
    ('{"answer": 4}', False, None, '{"answer": 4}', []),
    (header("final", first=True) + "Only an answer.", False, None, "Only an answer.", []),
    # a call to a function that is no tool of the request, and to a built-in tool: content
    (header("commentary", "functions.launch", first=True) + '{"now": true}<|call|>', False, None, '{"now": true}', []),
    (header("analysis", "browser.search", first=True) + '{"q": "x"}<|call|>', False, '{"q": "x"}', "", []),
]


@pytest.mark.parametrize("case", CASES)
def test_whole(case):
    text, in_analysis, reasoning, content, calls = case
    got_reasoning, got_content, got_calls = split_harmony(text, True, TOOL_SCHEMAS, in_analysis)
    assert (got_reasoning, got_content) == (reasoning, content)
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


@pytest.mark.parametrize("case", CASES)
def test_streamed_in_any_chunking_matches_whole(case):
    text, in_analysis, reasoning, content, calls = case
    for chunks in chunkings(text, seed=len(text)):
        splitter = HarmonySplitter(True, TOOL_SCHEMAS, in_analysis)
        pieces = [splitter.feed(c) for c in chunks] + [splitter.finish()]
        assert "".join(p[0] for p in pieces) == (reasoning or "")
        assert "".join(p[1] for p in pieces) == content, chunks
        assert calls_of([d for p in pieces for d in p[2]]) == calls


def test_a_marker_inside_arguments_ends_the_body():
    """GPT-OSS never writes a marker inside a body (they are special tokens): one that appears ends it. Whole, the
    cut call's JSON does not parse and its body stays content; the next call is read."""
    text = CASES[2][0].replace('"a b"', '"a <|end|> b"')
    reasoning, content, calls = split_harmony(text, True, TOOL_SCHEMAS)
    assert reasoning == "Two lookups." and content == 'Checking both.{"query": "a  b", "filters": {}}'
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("ping", {})]


def test_without_the_reasoning_split_or_the_tools_everything_is_content():
    text = CASES[1][0]
    reasoning, content, calls = split_harmony(text, False, None)
    assert reasoning is None and calls == []
    assert content == "Need the weather." + json.dumps(UNICODE_ARGS, ensure_ascii=False)


def test_a_call_is_announced_at_its_header_and_its_arguments_stream():
    splitter = HarmonySplitter(True, TOOL_SCHEMAS)
    assert splitter.feed(header("analysis", first=True) + "Look it up.<|en") == ("Look it up.", "", [])
    assert splitter.feed("d|>" + header("commentary", "functions.get_weather")[:-3]) == ("", "", [])
    assert splitter.feed("e|>") == ("", "", [ToolCallDelta(0, "get_weather", "")])
    assert splitter.feed('{"city": "Os') == ("", "", [ToolCallDelta(0, None, '{"city": "Os')])
    assert splitter.feed('lo"}<|ca') == ("", "", [ToolCallDelta(0, None, 'lo"}')])
    # (a marker that never completed is text of the body it was in)
    assert splitter.finish() == ("", "", [ToolCallDelta(0, None, "<|ca")])
    empty = HarmonySplitter(True, TOOL_SCHEMAS)
    deltas = empty.feed(header("commentary", "functions.ping", first=True))[2] + empty.finish()[2]
    assert calls_of(deltas) == [("ping", {})]


def test_a_header_that_never_completes_is_content():
    text = header("analysis", first=True) + "a<|end|><|start|>assist"
    assert split_harmony(text, True, TOOL_SCHEMAS) == ("a", "<|start|>assist", [])
    long = "<|channel|>" + "x" * 600 + "<|message|>body"
    assert split_harmony(long, True, TOOL_SCHEMAS) == (None, long, [])


def test_the_tool_call_parser_alone_reads_calls_and_leaves_the_analysis_in_the_content():
    parser = make_tool_parser("gpt-oss", TOOLS)
    assert type(parser).special_markers
    content, calls = parser.parse(CASES[1][0])
    assert content == "Need the weather." and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("get_weather", UNICODE_ARGS)]
    streamed = [parser.feed(c) for c in chunkings(CASES[1][0], 3)[2]] + [parser.finish()]
    assert "".join(c for c, _ in streamed) == content
    assert calls_of([d for _, ds in streamed for d in ds]) == [("get_weather", UNICODE_ARGS)]


@pytest.mark.parametrize("tool_parser", [None, "gpt-oss"])
def test_a_chat_sample_splits_reasoning_content_and_calls(tool_parser):
    """chat_output.SampleParser with --reasoning-parser gpt-oss: one splitter for the channels and, with
    --tool-call-parser gpt-oss, the calls; without it a call's body is content. parallel_tool_calls=false keeps the
    first call."""
    text = CASES[2][0]
    tools = (lambda: make_tool_parser("gpt-oss", TOOLS)) if tool_parser else None
    for parallel in (True, False):
        spec = OutputSpec(reasoning=GPT_OSS, tools=tools, parallel_calls=parallel)
        reasoning, content, calls = SampleParser(spec).whole(text)
        assert reasoning == "Two lookups."
        want = [("search", {"query": "a b", "filters": {}}), ("ping", {})] if tool_parser else []
        assert [(c.name, json.loads(c.arguments)) for c in calls] == (want if parallel else want[:1])
        assert content == "Checking both." + ("" if tool_parser else '{"query": "a b", "filters": {}}{}')
        sample = SampleParser(spec)
        parts = [sample.feed(c) for c in chunkings(text, 7)[3]] + [sample.finish()]
        assert "".join(p.reasoning for p in parts) == reasoning and "".join(p.content for p in parts) == content
        assert calls_of([d for p in parts for d in p.calls]) == [(n, a) for n, a in want][:len(calls)]


def test_where_a_rendered_prompt_leaves_the_analysis():
    """The prompt ends with the assistant's role (the output opens its channel: not inside the analysis), or an
    opened analysis body (inside); earlier messages' <|end|> does not close anything."""
    prompt = "<|start|>user<|message|>Hi<|end|><|start|>assistant"
    assert not starts_in_reasoning(GPT_OSS, prompt)
    assert starts_in_reasoning(GPT_OSS, prompt + "<|channel|>analysis<|message|>")


def _router(reasoning: str | None, tools: str | None):
    return SimpleNamespace(settings=SimpleNamespace(reasoning_parser=reasoning, tool_call_parser=tools))


@pytest.mark.parametrize("reasoning, tool_parser, body, keeps", [
    ("gpt-oss", None, {}, True),
    ("gpt-oss", None, {"separate_reasoning": False}, False),
    ("gpt-oss", None, {"skip_special_tokens": True}, False),  # the request's own choice stands
    (None, "gpt-oss", {"tools": TOOLS}, True),
    (None, "gpt-oss", {}, False),  # no tools: nothing to read
    (None, "gpt-oss", {"tools": TOOLS, "tool_choice": "required"}, False),  # a constrained array, no markers
    (None, "qwen25", {"tools": TOOLS}, False),  # <tool_call> is no special token
    ("qwen3", None, {}, False),
])
def test_the_router_keeps_special_tokens_for_formats_made_of_them(reasoning, tool_parser, body, keeps):
    job = parse_chat_completion({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}, ["m"])
    sampling = openai_api._keep_special_tokens(_router(reasoning, tool_parser), job, job.sampling)
    assert sampling.HasField("skip_special_tokens") == (keeps or "skip_special_tokens" in body)
    assert sampling.skip_special_tokens is (not keeps and body.get("skip_special_tokens", False))
    assert not job.sampling.HasField("skip_special_tokens") or "skip_special_tokens" in body  # (a copy changed)
