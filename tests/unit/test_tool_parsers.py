"""Tool-call parsers: every format whole and streamed in any chunking, failures kept as content, the schemas
behind tool_choice, and the registry."""

from __future__ import annotations

import json
import pathlib
import random
import subprocess
import sys

import jsonschema
import pytest

from radixmesh.services.router.tool_call_parsers import TOOL_CALL_PARSERS, make_tool_parser
from radixmesh.services.router.tool_formats import NamedCallParser, RequiredCallsParser
from radixmesh.services.router.tool_parsers import (ToolCall, ToolCallDelta, ToolCallParser, named_call_schema,
                                                    required_calls_schema)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}},
    },
}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters schema
TOOLS = [WEATHER, SEARCH, PING]

TRICKY_ARGS = {"query": 'a "quoted" {brace} [bracket] \\ and </tool_call> ; ]', "filters": {"tags": ["x", {"y": []}]}}
UNICODE_ARGS = {"city": "東京 — Zürich ☃ 🙂", "unit": "c"}


def call(name: str, **arguments) -> tuple[str, dict]:
    return name, arguments


def stream(parser: ToolCallParser, chunks: list[str]) -> tuple[str, list[tuple[str, dict]], list[ToolCallDelta]]:
    """Feeds the chunks, then finish(); returns the content, the calls assembled from the deltas, the deltas."""
    content, deltas = "", []
    for chunk in chunks:
        text, new = parser.feed(chunk)
        content, deltas = content + text, deltas + new
    text, new = parser.finish()
    content, deltas = content + text, deltas + new
    names: dict[int, str] = {}
    pieces: dict[int, str] = {}
    for d in deltas:
        if d.index not in names:
            assert d.name is not None, "a call's first delta names it"
            names[d.index] = d.name
        else:
            assert d.name is None, "only a call's first delta names it"
        pieces[d.index] = pieces.get(d.index, "") + d.arguments
    assert sorted(names) == list(range(len(names))), "calls are numbered 0, 1, 2 ... in order"
    return content, [(names[i], json.loads(pieces[i])) for i in sorted(names)], deltas


def whole(parser: ToolCallParser, text: str) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = parser.parse(text)
    for c in calls:
        assert isinstance(c, ToolCall) and json.dumps(json.loads(c.arguments), ensure_ascii=False) == c.arguments
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def chunkings(text: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    out = [[text], list(text)]
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


def qwen_block(name: str, arguments: dict, first: str = "name") -> str:
    body = {"name": name, "arguments": arguments}
    if first != "name":
        body = {"arguments": arguments, "name": name}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


# (parser name, generated text, expected content, expected calls): well-formed outputs
CASES = [
    (
        "qwen25",
        "Let me look.\n" + qwen_block("get_weather", {"city": "Paris"}) + "\n" + qwen_block("search", TRICKY_ARGS)
        + "\nThat is all.",
        "Let me look.That is all.",
        [call("get_weather", city="Paris"), ("search", TRICKY_ARGS)],
    ),
    (
        "hermes",
        qwen_block("get_weather", UNICODE_ARGS, first="arguments") + "\n\n  after  ",
        "\n  after  ",
        [("get_weather", UNICODE_ARGS)],
    ),
    ("qwen", "no calls here, just <b>html</b> and < tool >", "no calls here, just <b>html</b> and < tool >", []),
    (
        "qwen25",
        '<tool_call>\n{"name": "ping"}\n</tool_call>',
        "",
        [call("ping")],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
        + json.dumps({"name": "search", "arguments": TRICKY_ARGS}),
        "",
        [call("get_weather", city="Paris", unit="c"), ("search", TRICKY_ARGS)],
    ),
    (
        "llama3",
        'Checking. <|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(UNICODE_ARGS, ensure_ascii=False)
        + "}",
        "Checking. ",
        [("get_weather", UNICODE_ARGS)],
    ),
    ("llama3", '  {"name": "ping", "parameters": {}}\n', "", [call("ping")]),
    ("llama3", "The answer is {x} <|python_ta", "The answer is {x} <|python_ta", []),
    (
        "mistral",
        "Sure. [TOOL_CALLS] [" + json.dumps({"name": "search", "arguments": TRICKY_ARGS}) + ', {"name": "get_weather", '
        '"arguments": {"city": "Oslo"}}] Bye',
        "Sure.  Bye",
        [("search", TRICKY_ARGS), call("get_weather", city="Oslo")],
    ),
    (
        "mistral",
        "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(UNICODE_ARGS, ensure_ascii=False) + '[TOOL_CALLS]ping[ARGS]{}',
        "",
        [("get_weather", UNICODE_ARGS), call("ping")],
    ),
    (
        "pythonic",
        'Calling: <|python_start|>[get_weather(city="東京", unit=\'c\'), search(query="a ] ) \\" x", '
        "filters={'on': True, 'off': False, 'none': None, 'n': [-1, 2.5, (3, 4)]}), ping()]<|python_end|> done",
        "Calling:  done",
        [
            call("get_weather", city="東京", unit="c"),
            call("search", query='a ] ) " x', filters={"on": True, "off": False, "none": None, "n": [-1, 2.5, [3, 4]]}),
            call("ping"),
        ],
    ),
    ("pythonic", "A list [1, 2] and [see (note)] stay text.", "A list [1, 2] and [see (note)] stay text.", []),
    (
        "pythonic",
        '[search(query="""triple "quoted" text""")]',
        "",
        [call("search", query='triple "quoted" text')],
    ),
]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_whole(name, text, content, calls):
    assert whole(make_tool_parser(name, TOOLS), text) == (content, calls)


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_streamed_in_any_chunking_matches_whole(name, text, content, calls):
    for seed, chunks in enumerate(chunkings(text, seed=len(text))):
        got_content, got_calls, _ = stream(make_tool_parser(name, TOOLS), chunks)
        assert (got_content, got_calls) == (content, calls), f"chunking #{seed}: {chunks}"


@pytest.mark.parametrize("name", ["qwen25", "llama3", "mistral"])
def test_json_formats_stream_arguments_incrementally(name):
    text = {
        "qwen25": "<tool_call>\n" + json.dumps({"name": "search", "arguments": TRICKY_ARGS}) + "\n</tool_call>",
        "llama3": json.dumps({"name": "search", "parameters": TRICKY_ARGS}),
        "mistral": "[TOOL_CALLS] [" + json.dumps({"name": "search", "arguments": TRICKY_ARGS}) + "]",
    }[name]
    parser = make_tool_parser(name, TOOLS)
    cut = text.index('"filters"')  # mid-arguments
    _, first = parser.feed(text[:cut])
    assert first[0] == ToolCallDelta(0, "search", first[0].arguments)
    assert "".join(d.arguments for d in first).startswith('{"query": "a \\"quoted\\" {brace}')
    _, rest = parser.feed(text[cut:])
    assert rest and all(d.name is None and d.index == 0 for d in rest)
    _, tail = parser.finish()
    assert json.loads("".join(d.arguments for d in first + rest + tail)) == TRICKY_ARGS


def test_first_delta_waits_for_the_name_when_arguments_come_first():
    parser = make_tool_parser("qwen25", TOOLS)
    text = qwen_block("get_weather", {"city": "Rome"}, first="arguments")
    content, deltas = parser.feed(text[: text.index('"name"')])
    assert (content, deltas) == ("", [])
    _, deltas = parser.feed(text[text.index('"name"') :])
    assert deltas[0].name == "get_weather" and json.loads(deltas[0].arguments) == {"city": "Rome"}


def test_marker_split_across_chunks_is_held_back_until_resolved():
    parser = make_tool_parser("qwen25", TOOLS)
    assert parser.feed("Hi <tool_") == ("Hi ", [])
    content, deltas = parser.feed('call>\n{"name": "ping", "arguments": {}}\n</tool_')
    assert content == "" and deltas[0].name == "ping"
    assert parser.feed("call>\nbye") == ("bye", [])
    assert parser.finish() == ("", [])


@pytest.mark.parametrize(
    "name,partial",
    [("qwen25", "Hi <tool_"), ("llama3", "<|python"), ("mistral", "x [TOOL_"), ("pythonic", "see [get_wea")],
)
def test_a_marker_prefix_that_never_completes_is_flushed_at_finish(name, partial):
    parser = make_tool_parser(name, TOOLS)
    first, deltas = parser.feed(partial)
    assert deltas == [] and partial.startswith(first) and first != partial
    assert parser.finish() == (partial[len(first) :], [])


UNKNOWN_OR_BROKEN = [
    ("qwen25", "A\n<tool_call>\n{\"name\": \"launch_missiles\", \"arguments\": {}}\n</tool_call>\nB"),
    ("qwen25", "A\n<tool_call>\n{\"name\": \"ping\", \"arguments\": {\"x\": }}\n</tool_call>\nB"),
    ("qwen25", "A\n<tool_call>\n{\"name\": \"ping\", \"arguments\": {\"x\": 1}\n</tool_call>\nB"),
    ("qwen25", "A\n<tool_call>\nnot json at all\n</tool_call>\nB"),
    ("llama3", "{\"name\": \"launch_missiles\", \"parameters\": {}}"),
    ("llama3", "{\"answer\": 42, \"explanation\": \"no name\"}"),
    ("llama3", "<|python_tag|>brave_search.call(query=\"x\")"),
    ("mistral", "ok [TOOL_CALLS] [{\"name\": \"launch_missiles\", \"arguments\": {}}]"),
    ("mistral", "ok [TOOL_CALLS] [{\"name\": \"ping\", \"arguments\": {\"a\": 01}}]"),
    ("mistral", "ok [TOOL_CALLS]launch_missiles[ARGS]{}"),
    ("pythonic", "[launch_missiles(now=True)]"),
    ("pythonic", "[ping(__import__('os').system('echo pwned'))]"),
    ("pythonic", "[search(query=open('/etc/passwd').read())]"),
    ("pythonic", "[search(query='x'"),
]


@pytest.mark.parametrize("name,text", UNKNOWN_OR_BROKEN)
def test_unknown_or_malformed_calls_stay_in_the_content(name, text):
    content, calls = make_tool_parser(name, TOOLS).parse(text)
    assert (content, calls) == (text, [])  # nothing lost, the markers' newlines included


@pytest.mark.parametrize("name,text", [case for case in UNKNOWN_OR_BROKEN if "missiles" in case[1]])
def test_unknown_functions_stay_in_the_content_when_streamed(name, text):
    for chunks in chunkings(text, seed=7):
        content, calls, _ = stream(make_tool_parser(name, TOOLS), chunks)
        assert (content, calls) == (text, [])


def test_a_failed_qwen_block_does_not_hide_the_next_one():
    text = "<tool_call>\n{\"name\": \"nope\", \"arguments\": {}}\n</tool_call>\n" + qwen_block("ping", {})
    content, calls = whole(make_tool_parser("qwen25", TOOLS), text)
    assert content == "<tool_call>\n{\"name\": \"nope\", \"arguments\": {}}\n</tool_call>"
    assert calls == [call("ping")]


def test_parse_leaves_the_streaming_state_alone():
    parser = make_tool_parser("qwen25", TOOLS)
    assert parser.feed("Hello <tool") == ("Hello ", [])
    assert parser.parse(qwen_block("ping", {}))[1] == [ToolCall("ping", "{}")]
    assert parser.finish() == ("<tool", [])


def test_whole_mode_arguments_are_canonical_json_text():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"\\u6771\\u4eac"}}\n</tool_call>'
    assert make_tool_parser("qwen25", TOOLS).parse(text)[1] == [ToolCall("get_weather", '{"city": "東京"}')]


# --- tool_choice: required and named ------------------------------------------------------------------------------

REQUIRED_TEXT = json.dumps(
    [{"name": "get_weather", "parameters": UNICODE_ARGS}, {"name": "search", "parameters": TRICKY_ARGS}],
    ensure_ascii=False,
)


def test_required_calls_parser_whole_and_streamed():
    expected = ("", [("get_weather", UNICODE_ARGS), ("search", TRICKY_ARGS)])
    assert whole(RequiredCallsParser(TOOLS), REQUIRED_TEXT) == expected
    for chunks in chunkings(REQUIRED_TEXT, seed=3):
        assert stream(RequiredCallsParser(TOOLS), chunks)[:2] == expected


def test_required_calls_parser_keeps_bad_output_as_content():
    for text in ['{"name": "ping"}', '[{"name": "nope", "parameters": {}}]', "[{"]:
        assert RequiredCallsParser(TOOLS).parse(text) == (text, [])


def test_named_call_parser_whole_and_streamed():
    text = ' {"query": "}{", "filters": {"a": [1, {"b": "東"}]}}\n'
    expected = ("", [call("search", query="}{", filters={"a": [1, {"b": "東"}]})])
    assert whole(NamedCallParser(TOOLS, name="search"), text) == expected
    for chunks in chunkings(text, seed=5):
        content, calls, deltas = stream(NamedCallParser(TOOLS, name="search"), chunks)
        assert (content, calls) == expected and deltas[0].name == "search"
    assert NamedCallParser(TOOLS, name="search").parse("not json") == ("not json", [])
    with pytest.raises(ValueError, match="nope"):
        NamedCallParser(TOOLS, name="nope")


def test_required_calls_schema_accepts_calls_and_rejects_the_rest():
    schema = required_calls_schema(TOOLS, parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "ping", "parameters": {"any": 1}}]
    jsonschema.validate(ok, schema)
    jsonschema.validate(json.loads(REQUIRED_TEXT), schema)
    bad = [
        [],
        [{"name": "get_weather", "parameters": {}}],  # city is required
        [{"name": "nope", "parameters": {}}],
        [{"name": "ping", "parameters": {}, "extra": 1}],
        [{"name": "ping"}],
        {"name": "ping", "parameters": {}},
    ]
    for instance in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(instance, schema)
    single = required_calls_schema(TOOLS, parallel=False)
    assert single["maxItems"] == 1 and "maxItems" not in schema
    jsonschema.validate(ok[:1], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, single)
    assert schema["items"]["anyOf"][2]["properties"]["parameters"] == {"type": "object"}


def test_named_call_schema_is_the_tools_parameters():
    schema = named_call_schema(WEATHER)
    jsonschema.validate({"city": "Paris", "unit": "f"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"unit": "f"}, schema)
    assert named_call_schema(PING) == {"type": "object"}


# --- registry ------------------------------------------------------------------------------------------------------


def test_registry_has_sglang_names():
    assert {"qwen25", "qwen", "hermes", "llama3", "mistral", "pythonic"} <= set(TOOL_CALL_PARSERS)
    assert TOOL_CALL_PARSERS["qwen"] is TOOL_CALL_PARSERS["hermes"] is TOOL_CALL_PARSERS["qwen25"]
    assert all(issubclass(cls, ToolCallParser) for cls in TOOL_CALL_PARSERS.values())


def test_unknown_parser_name_is_a_value_error_naming_the_known_ones():
    with pytest.raises(ValueError) as err:
        make_tool_parser("nonesuch", TOOLS)
    assert "nonesuch" in str(err.value) and "qwen25" in str(err.value) and "pythonic" in str(err.value)


# --- generated outputs --------------------------------------------------------------------------------------------

PIECES = ["a", " ", '"', "\\", "{", "}", "[", "]", ",", ":", ";", "<", "\n", "é", "東", "🙂", "(", ")", "'",
          "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", '{"name": "ping", "arguments": {',
          '{"name": "search", "parameters": ', '"name"', "ping(", "[ping(", "search(query=", "1", "true", "null"]


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randint(0, 5 if depth < 3 else 3)
    if kind == 0:
        return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 4)))
    if kind == 1:
        return rng.choice([True, False, None, -7, 3.25, 10**20])
    if kind in (2, 3):
        return rng.randint(-1000, 1000)
    if kind == 4:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}{rng.choice(PIECES)}": random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def random_output(name: str, rng: random.Random) -> tuple[str, list[tuple[str, dict]]]:
    names = ["get_weather", "search", "ping"]
    calls = [(rng.choice(names), {f"k{i}": random_value(rng) for i in range(rng.randint(0, 3))})
             for _ in range(rng.randint(1, 3))]

    def dumps(obj) -> str:
        return json.dumps(obj, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2]))

    if name == "qwen25":
        return "".join(f"text {i}\n<tool_call>\n{dumps({'name': n, 'arguments': a})}\n</tool_call>"
                       for i, (n, a) in enumerate(calls)), calls
    if name == "llama3":
        return "<|python_tag|>" + "; ".join(dumps({"name": n, "parameters": a}) for n, a in calls), calls
    if name == "mistral":
        return "[TOOL_CALLS] " + dumps([{"name": n, "arguments": a} for n, a in calls]), calls
    return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")" for n, a in calls) + "]", calls


@pytest.mark.parametrize("name", ["qwen25", "llama3", "mistral", "pythonic"])
def test_generated_outputs_whole_and_streamed(name):
    for seed in range(40):
        text, calls = random_output(name, random.Random(seed))
        expected = whole(make_tool_parser(name, TOOLS), text)
        assert expected[1] == calls, text
        for chunks in chunkings(text, seed)[1:4]:
            assert stream(make_tool_parser(name, TOOLS), chunks)[:2] == expected, chunks


@pytest.mark.parametrize("name", ["qwen25", "llama3", "mistral", "pythonic", "required", "named"])
def test_arbitrary_text_never_raises_and_is_kept_when_it_holds_no_call(name):
    for seed in range(300):
        rng = random.Random(seed)
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 20)))
        make = {
            "required": lambda: RequiredCallsParser(TOOLS),
            "named": lambda: NamedCallParser(TOOLS, name="search"),
        }.get(name, lambda: make_tool_parser(name, TOOLS))
        content, calls = make().parse(text)
        assert all(isinstance(json.loads(c.arguments), dict) for c in calls)
        if not calls:
            assert content == text
        parser, deltas = make(), []
        for piece in chunkings(text, seed)[1]:
            deltas += parser.feed(piece)[1]
        deltas += parser.finish()[1]
        firsts = [d.index for d in deltas if d.name is not None]
        assert firsts == list(range(len(firsts))) and all(d.index < len(firsts) for d in deltas)


def test_every_format_is_registered_once_the_registry_is_imported():
    code = (
        "from radixmesh.services.router.tool_call_parsers import TOOL_CALL_PARSERS\n"
        "assert sorted(TOOL_CALL_PARSERS) == ['deepseekv3', 'deepseekv31', 'glm', 'glm45', 'gpt-oss', 'hermes', "
        "'kimi_k2', 'llama3', 'mistral', 'pythonic', 'qwen', 'qwen25', 'qwen3_coder'], sorted(TOOL_CALL_PARSERS)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).parents[2])
