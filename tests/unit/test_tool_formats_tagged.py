"""The mixture-of-experts families' tool-call formats (deepseekv3, deepseekv31, kimi_k2, glm45/glm, qwen3_coder):
each whole and streamed in any chunking, failures kept as content, XML-like values typed by the tool's schema."""

from __future__ import annotations

import json
import random

import pytest

from radixmesh.services.router.tool_call_parsers import TOOL_CALL_PARSERS, make_tool_parser
from radixmesh.services.router.tool_parsers import ToolCallDelta
from tests.unit.test_tool_parsers import (PING, SEARCH, TRICKY_ARGS, UNICODE_ARGS, WEATHER, call, chunkings, stream,
                                          whole)

CONFIGURE = {
    "type": "function",
    "function": {
        "name": "configure",
        "parameters": {
            "type": "object",
            "properties": {
                "count": {"type": "integer"},
                "ratio": {"type": "number"},
                "on": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "opts": {"type": "object"},
                "limit": {"type": ["integer", "null"]},
                "level": {"enum": [1, 2, 3]},
                "label": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "size": {"anyOf": [{"type": "integer"}, {"type": "array"}]},
                "note": {"type": "string"},
            },
        },
    },
}
TOOLS = [WEATHER, SEARCH, PING, CONFIGURE]
FORMATS = ["deepseekv3", "deepseekv31", "kimi_k2", "glm45", "qwen3_coder"]
JSON_FORMATS = FORMATS[:3]

S3, E3 = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
B3, F3, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
SK, EK = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
BK, FK, AK = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


def xml_value(value) -> str:
    """A value as the chat templates write it: text as is, anything else as JSON."""
    return value if isinstance(value, str) else dumps(value)


def glm_call(name: str, arguments: dict) -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{xml_value(v)}</arg_value>\n" for k, v in arguments.items())
    return f"\n<tool_call>{name}\n{pairs}</tool_call>"


def qwen3_coder_call(name: str, arguments: dict) -> str:
    parameters = "".join(f"<parameter={k}>\n{xml_value(v)}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


def render(name: str, calls: list[tuple[str, dict]], json_text=dumps) -> str:
    """Calls written the way each model's chat template writes them."""
    if name == "deepseekv3":
        body = "\n".join(f"{B3}function{SEP}{n}\n```json\n{json_text(a)}\n```{F3}" for n, a in calls)
        return S3 + body + E3
    if name == "deepseekv31":
        return S3 + "".join(f"{B3}{n}{SEP}{json_text(a)}{F3}" for n, a in calls) + E3
    if name == "kimi_k2":
        return SK + "".join(f"{BK}functions.{n}:{i}{AK}{json_text(a)}{FK}" for i, (n, a) in enumerate(calls)) + EK
    if name in ("glm45", "glm"):
        return "".join(glm_call(n, a) for n, a in calls)
    return "\n".join(qwen3_coder_call(n, a) for n, a in calls)


TWO_CALLS = [call("get_weather", city="Paris", unit="c"), ("search", TRICKY_ARGS)]

# (parser name, generated text, expected content, expected calls): well-formed outputs
UNICODE_CALLS = [("get_weather", UNICODE_ARGS), call("ping")]
CASES = [
    *[(name, "Let me look." + render(name, TWO_CALLS) + "That is all.", "Let me look.That is all.", TWO_CALLS)
      for name in FORMATS],
    *[(name, render(name, UNICODE_CALLS), "", UNICODE_CALLS) for name in FORMATS],
    ("glm", render("glm", [call("ping")]) + "\n", "", [call("ping")]),
    (
        "deepseekv3",
        f"{S3}\n{B3} function {SEP} ping \n\n```json\n  {{}}  \n```\n{F3}\n\n{E3} bye",
        " bye",
        [call("ping")],
    ),
    ("deepseekv31", f"{B3}ping{SEP}{{}}{F3} outside any section", "outside any section", [call("ping")]),
    (
        "kimi_k2",
        f"{SK} {BK} get_weather:3 {AK} {{\"city\": \"Rome\"}} {FK} {BK}functions.ping:4{AK}{{}}{FK}{EK}",
        "",
        [call("get_weather", city="Rome"), call("ping")],
    ),
    (
        "glm45",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value> Oslo </arg_value></tool_call>"
        "<tool_call>ping</tool_call>",
        "",
        [call("get_weather", city=" Oslo "), call("ping")],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nLa\nPaz\n<parameter=unit>\nc\n</function>\n"
        "<function=ping>\n</function>\n</tool_call>\nok",
        "ok",
        [call("get_weather", city="La\nPaz", unit="c"), call("ping")],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=search>\n<parameter=query>\n\n  indented\n\n</parameter>\n</function>\n</tool_call>",
        "",
        [call("search", query="\n  indented\n")],
    ),
    ("glm45", "no calls, just <b>html</b> and < tool_call >", "no calls, just <b>html</b> and < tool_call >", []),
    ("kimi_k2", "a <|tool_call|> lookalike", "a <|tool_call|> lookalike", []),
]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_whole(name, text, content, calls):
    assert whole(make_tool_parser(name, TOOLS), text) == (content, calls)


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_streamed_in_any_chunking_matches_whole(name, text, content, calls):
    for seed, chunks in enumerate(chunkings(text, seed=len(text))):
        got_content, got_calls, _ = stream(make_tool_parser(name, TOOLS), chunks)
        assert (got_content, got_calls) == (content, calls), f"chunking #{seed}: {chunks}"


def test_glm45_keeps_the_newline_before_a_call_with_the_call():
    text = "Checking.\n<tool_call>ping\n</tool_call>\nDone."
    assert whole(make_tool_parser("glm45", TOOLS), text) == ("Checking.Done.", [call("ping")])


@pytest.mark.parametrize("name", JSON_FORMATS)
def test_json_formats_stream_arguments_incrementally(name):
    text = render(name, [("search", TRICKY_ARGS)])
    parser = make_tool_parser(name, TOOLS)
    cut = text.index('"filters"')  # mid-arguments
    _, first = parser.feed(text[:cut])
    assert first[0] == ToolCallDelta(0, "search", first[0].arguments)
    assert "".join(d.arguments for d in first).startswith('{"query": "a \\"quoted\\" {brace}')
    _, rest = parser.feed(text[cut:])
    assert rest and all(d.name is None and d.index == 0 for d in rest)
    _, tail = parser.finish()
    assert json.loads("".join(d.arguments for d in first + rest + tail)) == TRICKY_ARGS


@pytest.mark.parametrize("name", ["glm45", "qwen3_coder"])
def test_xml_formats_announce_the_name_then_send_the_arguments_when_the_call_closes(name):
    text = render(name, [("search", TRICKY_ARGS)])
    parser = make_tool_parser(name, TOOLS)
    cut = text.index("query")  # the name is read, the arguments are not
    assert parser.feed(text[:cut]) == ("", [ToolCallDelta(0, "search", "")])
    assert parser.feed(text[cut : text.rindex("filters")]) == ("", [])  # nothing until the call closes
    content, deltas = parser.feed(text[text.rindex("filters") :])
    assert content == "" and len(deltas) == 1 and deltas[0].index == 0 and deltas[0].name is None
    assert json.loads(deltas[0].arguments) == TRICKY_ARGS
    assert parser.finish() == ("", [])


@pytest.mark.parametrize(
    "name,partial",
    [("deepseekv3", "Hi <｜tool▁calls"), ("deepseekv31", "x <｜tool▁call▁be"), ("kimi_k2", "ok <|tool_calls_sec"),
     ("glm45", "see <tool_"), ("qwen3_coder", "a\n<tool_ca")],
)
def test_a_marker_prefix_that_never_completes_is_flushed_at_finish(name, partial):
    parser = make_tool_parser(name, TOOLS)
    first, deltas = parser.feed(partial)
    assert deltas == [] and partial.startswith(first) and first != partial
    assert parser.finish() == (partial[len(first) :], [])


UNKNOWN_OR_BROKEN = [
    ("deepseekv3", f"A{S3}{B3}function{SEP}launch_missiles\n```json\n{{}}\n```{F3}{E3}B"),
    ("deepseekv3", f"A{S3}{B3}tool{SEP}ping\n```json\n{{}}\n```{F3}{E3}B"),
    ("deepseekv3", f"A{S3}{B3}function{SEP}ping\n{{}}\n{F3}{E3}B"),
    ("deepseekv3", f"A{S3}{B3}function{SEP}ping\n```json\n{{\"x\": }}\n```{F3}{E3}B"),
    ("deepseekv3", f"A{S3}{E3}B"),
    ("deepseekv31", f"A{S3}{B3}launch_missiles{SEP}{{}}{F3}{E3}B"),
    ("deepseekv31", f"A{S3}{B3}ping{SEP}[1, 2]{F3}{E3}B"),
    ("deepseekv31", f"A{S3}{B3}ping{SEP}{{\"a\": 01}}{F3}{E3}B"),
    ("deepseekv31", f"A{S3}{B3}ping{SEP}{{\"a\": 1"),
    ("deepseekv31", f"A{S3}{B3}get weather{SEP}{{}}{F3}{E3}"),
    ("kimi_k2", f"A{SK}{BK}functions.launch_missiles:0{AK}{{}}{FK}{EK}B"),
    ("kimi_k2", f"A{SK}{BK}{AK}{{}}{FK}{EK}B"),
    ("kimi_k2", f"A{SK}{BK}functions.ping:0{AK}not json{FK}{EK}B"),
    ("glm45", "A\n<tool_call>launch_missiles\n<arg_key>now</arg_key>\n<arg_value>1</arg_value>\n</tool_call>\nB"),
    ("glm45", "A\n<tool_call>ping\nhello\n</tool_call>\nB"),
    ("glm45", "A\n<tool_call>ping\n<arg_key>x</arg_key>\n</tool_call>\nB"),
    ("glm45", "A\n<tool_call>ping\n<arg_key>x</arg_key>\n<arg_value>1"),
    ("glm45", "A\n<tool_call>\n{\"name\": \"ping\", \"arguments\": {}}\n</tool_call>\nB"),
    ("qwen3_coder", "A\n<tool_call>\n<function=launch_missiles>\n</function>\n</tool_call>\nB"),
    ("qwen3_coder", "A\n<tool_call>\n{\"name\": \"ping\", \"arguments\": {}}\n</tool_call>\nB"),
    ("qwen3_coder", "A\n<tool_call>\n<function=ping>\n<parameter=x>\n1\n</parameter>\n"),
    ("qwen3_coder", "A\n<tool_call>\n<function=ping>\nhello\n</function>\n</tool_call>\nB"),
]


@pytest.mark.parametrize("name,text", UNKNOWN_OR_BROKEN)
def test_unknown_or_malformed_calls_stay_in_the_content(name, text):
    assert make_tool_parser(name, TOOLS).parse(text) == (text, [])  # nothing lost, the markers included


@pytest.mark.parametrize("name,text", [case for case in UNKNOWN_OR_BROKEN if "missiles" in case[1]])
def test_unknown_functions_stay_in_the_content_when_streamed(name, text):
    for chunks in chunkings(text, seed=7):
        content, calls, _ = stream(make_tool_parser(name, TOOLS), chunks)
        assert (content, calls) == (text, [])


@pytest.mark.parametrize("name", JSON_FORMATS)
def test_a_failed_call_in_a_section_does_not_hide_the_others(name):
    bad, good = ("nope", {}), call("ping")
    begin, end, call_begin, call_end = (SK, EK, BK, FK) if name == "kimi_k2" else (S3, E3, B3, F3)
    first_bad = render(name, [bad, good])
    # the section's markers go with its failed first call: the content is the section less the good call
    good_at, good_end = first_bad.rindex(call_begin), first_bad.rindex(call_end) + len(call_end)
    assert whole(make_tool_parser(name, TOOLS), first_bad) == (first_bad[:good_at] + first_bad[good_end:], [good])
    second_bad = render(name, [good, bad])
    inner = second_bad[len(begin) : -len(end)]
    assert whole(make_tool_parser(name, TOOLS), second_bad) == (inner[inner.index(call_begin, 1) :], [good])
    for chunks in chunkings(first_bad + second_bad, seed=11):
        assert stream(make_tool_parser(name, TOOLS), chunks)[:2] == whole(make_tool_parser(name, TOOLS),
                                                                           first_bad + second_bad)


@pytest.mark.parametrize("name", ["glm45", "qwen3_coder"])
def test_a_failed_block_does_not_hide_the_next_one(name):
    bad = render(name, [("nope", {"x": "1"})])
    text = bad + render(name, [call("ping")])
    content, calls = whole(make_tool_parser(name, TOOLS), text)
    assert (content, calls) == (bad, [call("ping")])


def test_the_first_failed_call_takes_the_section_markers_with_it():
    text = f"A{S3}{B3}nope{SEP}{{}}{F3}\n{B3}ping{SEP}{{}}{F3}\n{E3}B"
    assert make_tool_parser("deepseekv31", TOOLS).parse(text)[0] == f"A{S3}{B3}nope{SEP}{{}}{F3}\n\n{E3}B"


# --- XML-like values typed by the schema ---------------------------------------------------------------------------

TYPED = [  # (parameter, its text, its value)
    ("count", "42", 42),
    ("count", " 7 ", 7),
    ("count", "4.5", "4.5"),  # not an integer: the text
    ("count", "many", "many"),
    ("count", "true", "true"),
    ("ratio", "2.5", 2.5),
    ("ratio", "3", 3),
    ("ratio", "1e400", "1e400"),  # no JSON number
    ("ratio", "NaN", "NaN"),
    ("on", "true", True),
    ("on", "False", False),  # Python's spelling, as Qwen3-Coder's template writes booleans
    ("on", "yes", "yes"),
    ("tags", '["a", "東"]', ["a", "東"]),
    ("tags", "['a', (1, 2)]", ["a", [1, 2]]),  # a Python literal
    ("tags", "[1,", "[1,"),
    ("tags", "__import__('os').system('x')", "__import__('os').system('x')"),
    ("opts", '{"k": {"n": null}}', {"k": {"n": None}}),
    ("opts", "{'k': None, 'b': True}", {"k": None, "b": True}),
    ("opts", "{1: 2}", "{1: 2}"),  # no JSON object: its keys are no strings
    ("opts", "{'s': {1, 2}}", "{'s': {1, 2}}"),
    ("limit", "null", None),
    ("limit", "None", None),
    ("limit", "7", 7),
    ("level", "2", 2),
    ("label", "null", "null"),  # a string is allowed: the text
    ("size", "5", 5),
    ("size", "[1]", [1]),
    ("note", '{"x": 1}', '{"x": 1}'),
    ("undeclared", "123", "123"),  # no schema: the text
]


def typed_text(name: str) -> str:
    """One call to `configure` per TYPED row, its value written raw."""
    if name == "glm45":
        return "".join(f"<tool_call>configure\n<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n</tool_call>\n"
                       for k, v, _ in TYPED)
    return "".join(f"<tool_call>\n<function=configure>\n<parameter={k}>\n{v}\n</parameter>\n</function>\n</tool_call>\n"
                   for k, v, _ in TYPED)


@pytest.mark.parametrize("name", ["glm45", "qwen3_coder"])
def test_values_are_typed_by_the_tools_schema(name):
    text = typed_text(name)
    expected = ("", [("configure", {k: value}) for k, _, value in TYPED])
    assert whole(make_tool_parser(name, TOOLS), text) == expected
    for chunks in chunkings(text, seed=3)[:4]:
        assert stream(make_tool_parser(name, TOOLS), chunks)[:2] == expected


def test_qwen3_coder_reads_what_its_template_writes_for_python_values():
    calls = [("configure", {"on": True, "tags": ["x", "y"], "count": 3, "note": "None"})]
    assert whole(make_tool_parser("qwen3_coder", TOOLS), render("qwen3_coder", calls)) == ("", calls)
    python_style = render("qwen3_coder", calls).replace("\ntrue\n", "\nTrue\n").replace('["x", "y"]', "['x', 'y']")
    assert "True" in python_style and "['x', 'y']" in python_style
    assert whole(make_tool_parser("qwen3_coder", TOOLS), python_style) == ("", calls)


# --- registry ------------------------------------------------------------------------------------------------------


def test_registered_under_sglangs_names():
    assert set(FORMATS) | {"glm"} <= set(TOOL_CALL_PARSERS)
    assert TOOL_CALL_PARSERS["glm"] is TOOL_CALL_PARSERS["glm45"]


@pytest.mark.parametrize("name,special", [("deepseekv3", True), ("deepseekv31", True), ("kimi_k2", True),
                                          ("glm45", False), ("qwen3_coder", False)])
def test_special_markers_where_the_markers_are_special_tokens(name, special):
    assert TOOL_CALL_PARSERS[name].special_markers is special


# --- generated outputs --------------------------------------------------------------------------------------------

PIECES = ["a", " ", '"', "\\", "{", "}", "[", "]", ",", ":", "<", ">", "\n", "`", "é", "東", "🙂", "'", "=", "1", "true",
          "null", "```", "```json", "function", "functions.ping:0", "ping", "get_weather", S3, E3, B3, F3, SEP, SK, EK,
          BK, FK, AK, "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
          "<function=", "<function=ping>", "</function>", "<parameter=", "<parameter=city>", "</parameter>"]
TEXT_PIECES = [p for p in PIECES[:21] if p not in ("<", "\n")] + ["<b>", "line\n", "\n\n", " x "]


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(TEXT_PIECES) for _ in range(rng.randint(0, 4)))


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randint(0, 5 if depth < 3 else 3)
    if kind == 0:
        return random_text(rng)
    if kind == 1:
        return rng.choice([True, False, None, -7, 3.25, 10**20, 1e-7])
    if kind in (2, 3):
        return rng.randint(-1000, 1000)
    if kind == 4:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}{rng.choice(TEXT_PIECES)}": random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def random_configure_args(rng: random.Random) -> dict:
    """Arguments of each of configure's types, as the schema types them."""
    makers = {
        "count": lambda: rng.randint(-10**6, 10**6),
        "ratio": lambda: rng.choice([rng.random() * 100, rng.randint(0, 9), -2.5e-8]),
        "on": lambda: rng.random() < 0.5,
        "tags": lambda: [random_value(rng, 1) for _ in range(rng.randint(0, 3))],
        "opts": lambda: {f"o{i}": random_value(rng, 1) for i in range(rng.randint(0, 3))},
        "limit": lambda: rng.choice([None, rng.randint(0, 99)]),
        "note": lambda: random_text(rng),
    }
    return {k: make() for k, make in makers.items() if rng.random() < 0.6}


def random_output(name: str, rng: random.Random) -> tuple[str, list[tuple[str, dict]]]:
    calls = []
    for _ in range(rng.randint(1, 3)):
        pick = rng.choice(["search", "ping", "configure", "get_weather"])
        if pick == "configure":
            arguments = random_configure_args(rng)
        elif pick == "ping" and name in JSON_FORMATS:
            arguments = {f"k{i}": random_value(rng) for i in range(rng.randint(0, 3))}
        elif pick == "ping":
            arguments = {}
        elif name in JSON_FORMATS:
            arguments = {"query" if pick == "search" else "city": random_value(rng, 3)}
        else:  # typed by the schema: text, and an object
            arguments = {"query" if pick == "search" else "city": random_text(rng)}
            if pick == "search" and rng.random() < 0.5:
                arguments["filters"] = {f"f{i}": random_value(rng, 1) for i in range(rng.randint(0, 3))}
        calls.append((pick, arguments))
    indent = rng.choice([None, 2])
    text = render(name, calls, lambda obj: json.dumps(obj, ensure_ascii=rng.random() < 0.5, indent=indent))
    return "".join(rng.choice(TEXT_PIECES) for _ in range(rng.randint(0, 3))) + text, calls


@pytest.mark.parametrize("name", FORMATS)
def test_generated_outputs_whole_and_streamed(name):
    for seed in range(40):
        text, calls = random_output(name, random.Random(seed))
        expected = whole(make_tool_parser(name, TOOLS), text)
        assert expected[1] == calls, text
        for chunks in chunkings(text, seed)[1:4]:
            assert stream(make_tool_parser(name, TOOLS), chunks)[:2] == expected, chunks


@pytest.mark.parametrize("name", FORMATS)
def test_arbitrary_text_never_raises_and_is_kept_when_it_holds_no_call(name):
    for seed in range(300):
        rng = random.Random(seed)
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 24)))
        content, calls = make_tool_parser(name, TOOLS).parse(text)
        assert all(isinstance(json.loads(c.arguments), dict) for c in calls)
        if not calls:
            assert content == text
        parser, deltas = make_tool_parser(name, TOOLS), []
        for piece in chunkings(text, seed)[1]:
            deltas += parser.feed(piece)[1]
        deltas += parser.finish()[1]
        firsts = [d.index for d in deltas if d.name is not None]
        assert firsts == list(range(len(firsts))) and all(d.index < len(firsts) for d in deltas)
