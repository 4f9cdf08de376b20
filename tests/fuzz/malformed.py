"""Hypothesis strategies for malformed requests: valid ones (tests.fuzz.valid) with fields set to nasty values
(wrong types, NaN and Infinity, huge and negative numbers, empty, very long, non-BMP and lone-surrogate strings,
deep nesting, bad logit_bias, regexes and JSON schemas, stop lists), unknown or missing fields, bodies that are not
JSON objects, wrong content types and API keys, wrong methods and unknown paths. The router must answer each with a
status below 500 (a 4xx carrying an OpenAI error object, or a 200 where the change left the request valid).

Values that would make a still-valid request expensive are left out: no moderate positive integers (a max_tokens
of 900 is valid and slow), and max-token fields are never removed or nulled (the default is 128 tokens)."""

from __future__ import annotations

import dataclasses
import math
import urllib.parse
from typing import Any

from hypothesis import strategies as st

from tests.fuzz import valid
from tests.fuzz.checks import OPEN_PATHS
from tests.fuzz.request import BigInt, Deep, Req, Target

_COSTLY = frozenset({"max_tokens", "max_completion_tokens", "max_new_tokens", "sampling_params"})
_INT_EDGES = [-1, -2**31, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -2**63 - 1, 10**30, 10**300]
INTS = st.integers(-3, 4) | st.sampled_from(_INT_EDGES) | st.integers(max_value=-4) | st.integers(min_value=2**31)


def _cheap(x: float) -> bool:
    return not math.isfinite(x) or x != int(x) or not 4 < abs(x) < 2**31


FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, -1e308, 5e-324, 0.5, 1e-7, 2.0000001,
                          -2.0000001, 100.0001, 1e-300]) | st.floats().filter(_cheap)
STRINGS = st.sampled_from(["", " ", "\x00", "\ud800", "a\udfffb", "\U0001f99c" * 10, "\u202e\u0000\ufeff", "null",
                           "NaN", "1", "-1", "1e400", "true", "x" * 100_000, "\u00e9" * 50_000, "[", "{}"]) | st.text()
DEEP = st.integers(2, 1500).map(Deep) | st.integers(2, 1500).map(lambda n: Deep(n, "o"))
BAD_SCHEMAS = [{"type": "bogus"}, {"$ref": "#/nope"}, {"type": "string", "pattern": "("}, {"enum": []},
               {"type": "string", "minLength": 5, "maxLength": 2}, {"type": "array", "minItems": -1},
               {"properties": "x"}, {"type": ["string", 5]}, {"allOf": [{"type": "string"}, {"type": "integer"}]},
               {"anyOf": []}, {"type": "object", "required": ["a"], "additionalProperties": False}]
BAD_REGEXES = ["(", "[", "a{2,1}", "*", "(?<=a)b", "\\", "a{1000000}", "[^\\s\\S]", "(a|aa)*b", "[z-a]", "\\p{Foo}"]
BAD_EBNFS = ["root ::=", "root ::= undefined", 'x ::= "a"', 'root ::= "a', "root ::= [", "root ::= root",
             "::= 'a'", 'root ::= "a"{2,1}']
BAD_BIAS = st.sampled_from([{"a": 1}, {"-1": 1}, {"1.5": 1}, {"99999": 1}, {str(2**40): 1}, {"5": 101},
                            {"5": -1e308}, {"5": math.nan}, {"5": math.inf}, {"5": "x"}, {"5": None}, {"5": [1]},
                            {"": 1}, {" 5": 1}, {"\u0665": 1}, [1], "5:1"])
BAD_STOPS = st.sampled_from([[""], [1], [None], ["a"] * 5000, [["a"]], ["x" * 20000], "", {"a": 1}])
NASTY: st.SearchStrategy[Any] = st.one_of(
    st.none(), st.booleans(), INTS, FLOATS, STRINGS, DEEP, st.integers(4400, 6000).map(BigInt), BAD_BIAS,
    BAD_STOPS, st.sampled_from(BAD_SCHEMAS), st.sampled_from(BAD_REGEXES), valid.JSON_ANY,
    st.sampled_from([[], {}, [None], [[]], [{}], list(range(3000)), [-1], [2**31], [1.5]]),
    st.lists(valid.JSON_ANY, max_size=4), st.dictionaries(st.text(max_size=8), valid.JSON_ANY, max_size=4))
# Fields of each endpoint's bodies beyond those its valid requests happen to carry (for set/replace mutations).
FIELDS = {
    "/v1/chat/completions": ["messages", "model", "max_tokens", "n", "temperature", "top_p", "top_k", "stop", "seed",
                             "logit_bias", "response_format", "regex", "ebnf", "tools", "tool_choice", "logprobs",
                             "top_logprobs", "stream", "stream_options", "min_tokens", "chat_template_kwargs",
                             "continue_final_message", "stop_token_ids", "repetition_penalty", "min_p"],
    "/v1/completions": ["prompt", "model", "max_tokens", "n", "best_of", "echo", "logprobs", "suffix", "stop",
                        "logit_bias", "response_format", "regex", "ebnf", "temperature", "seed", "stream",
                        "frequency_penalty", "presence_penalty", "ignore_eos", "user"],
    "/generate": ["text", "input_ids", "sampling_params", "stream", "return_logprob", "logprob_start_len",
                  "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "rid"],
    "sampling_params": ["max_new_tokens", "min_new_tokens", "n", "temperature", "top_p", "top_k", "min_p",
                        "frequency_penalty", "presence_penalty", "repetition_penalty", "stop", "stop_token_ids",
                        "logit_bias", "json_schema", "regex", "ebnf", "sampling_seed", "ignore_eos"],
    "message": ["role", "content", "name", "tool_calls", "tool_call_id"],
    "/tokenize": ["prompt", "add_special_tokens", "model"], "/detokenize": ["tokens", "skip_special_tokens", "model"],
    "/v1/embeddings": ["input", "model", "dimensions", "encoding_format", "user"],
    "/encode": ["text", "input_ids", "rid", "dimensions", "model"],
}
# (field, value) pairs aimed at the parsers that need the value's content: grammars, logit_bias, stop and n.
TARGETED = st.one_of(
    st.sampled_from(BAD_SCHEMAS).map(lambda s: ("response_format", {"type": "json_schema",
                                                                    "json_schema": {"name": "x", "schema": s}})),
    st.sampled_from(BAD_REGEXES).map(lambda r: ("regex", r)), st.sampled_from(BAD_EBNFS).map(lambda g: ("ebnf", g)),
    BAD_BIAS.map(lambda b: ("logit_bias", b)), BAD_STOPS.map(lambda v: ("stop", v)),
    st.sampled_from([0, 2, 3, 128, 129, 2**31 - 1]).map(lambda n: ("n", n)))
_CONSTRAINTS = ("response_format", "regex", "ebnf", "json_schema", "tool_choice")
REQUIRED = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/generate": "text",
            "/tokenize": "prompt", "/detokenize": "tokens", "/v1/embeddings": "input", "/encode": "text"}


def _valid_post(target: Target) -> st.SearchStrategy[Req]:
    if target.embedding:
        return valid.embeddings(target)
    return st.one_of(valid.chat(target), valid.completion(target), valid.generate(target), valid.tokenizer(target),
                     valid.embeddings(target))


def _fields_of(path: str) -> list[str]:
    return FIELDS[path.removeprefix("/v1") if path.endswith("tokenize") else path]


def _nasty_for(name: str) -> st.SearchStrategy[Any]:
    if name in _COSTLY:  # never absent, null, an object or a list of objects (default sampling: 128 tokens)
        return NASTY.filter(lambda v: v is not None and not isinstance(v, dict) and v != [] and not (
            isinstance(v, list) and any(isinstance(x, dict) for x in v)))
    return NASTY


@st.composite
def _mutate(draw, body: dict[str, Any], path: str) -> dict[str, Any]:
    body = dict(body)
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["set", "set", "targeted", "targeted", "nested", "unknown", "drop_required"]))
        if how == "targeted" and path in ("/v1/chat/completions", "/v1/completions", "/generate"):
            _aim(body, path, *draw(TARGETED))
        elif how == "set":
            name = draw(st.sampled_from(_fields_of(path)))
            body[name] = draw(_nasty_for(name))
        elif how == "unknown":
            body[draw(st.text(max_size=12).filter(lambda k: k not in body))] = draw(NASTY)
        elif how == "drop_required":
            body.pop(REQUIRED.get(path.removeprefix("/v1") if path.endswith("tokenize") else path), None)
        elif isinstance(body.get("sampling_params"), dict):
            name = draw(st.sampled_from(FIELDS["sampling_params"]))
            body["sampling_params"] = {**body["sampling_params"], name: draw(_nasty_for(name))}
        elif isinstance(body.get("messages"), list) and body["messages"]:
            i = draw(st.integers(0, len(body["messages"]) - 1))
            message = body["messages"][i]
            message = {**message, draw(st.sampled_from(FIELDS["message"])): draw(NASTY)} \
                if isinstance(message, dict) else draw(NASTY)
            body["messages"] = [*body["messages"][:i], message, *body["messages"][i + 1:]]
    return body


def _aim(body: dict[str, Any], path: str, name: str, value: Any) -> None:
    """Sets `name` (a constraint replacing any other) in an OpenAI body, or in a /generate body's sampling_params."""
    if path == "/generate":
        sp = body.get("sampling_params")
        sp = dict(sp) if isinstance(sp, dict) else {"max_new_tokens": 1}
        if name == "response_format":
            name, value = "json_schema", value["json_schema"]["schema"]
        for key in _CONSTRAINTS:
            sp.pop(key, None)
        body["sampling_params"] = {**sp, name: value}
        return
    if name in _CONSTRAINTS:
        for key in _CONSTRAINTS:
            body.pop(key, None)
    body[name] = value


@st.composite
def mutated(draw, target: Target) -> Req:
    """A valid POST request with one to three fields changed, added, dropped or nested into."""
    req = draw(_valid_post(target))
    return Req("POST", req.path, draw(_mutate(req.body, req.path)), req.headers, ascii=draw(st.booleans()))


RAW_BODIES = st.sampled_from([
    b"", b"{", b"}", b"null", b"[]", b"[1, 2]", b'"text"', b"123", b"true", b"NaN", b"-Infinity", b"{'a': 1}",
    b'{"a": 1,}', b"\xef\xbb\xbf{}", b'{"prompt": "\xff\xfe"}', b"\x00" * 16, "{}".encode("utf-16"),
    b"[" * 100_000, b'{"prompt": ' + b"[" * 5000, b'{"k":' * 3000, b'{"max_tokens": 1' + b"0" * 5000 + b"}",
    b'{"prompt": "a", "prompt": [1]}', b"prompt=hi&max_tokens=2", b"--x\r\nContent-Disposition: form-data\r\n\r\n",
    b'{"text": "hi"} trailing', b" " * 1000 + b"{}",
]) | st.binary(max_size=64)
CONTENT_TYPES = st.sampled_from([None, "application/json", "text/plain", "application/x-www-form-urlencoded",
                                 "multipart/form-data; boundary=x", "application/json; charset=latin-1",
                                 "application/octet-stream", "*/*", "application/json; charset=utf-16"])
POST_PATHS = ["/v1/chat/completions", "/v1/completions", "/generate", "/tokenize", "/detokenize", "/v1/tokenize",
              "/v1/detokenize", "/v1/embeddings", "/encode"]


@st.composite
def garbage(draw, target: Target) -> Req:
    """A body that is not a JSON object (or not JSON at all), under any content type."""
    headers = {"Authorization": f"Bearer {target.key}"}
    content_type = draw(CONTENT_TYPES)
    if content_type:
        headers["Content-Type"] = content_type
    body = draw(RAW_BODIES | st.builds(Deep, st.integers(900, 1100)) | NASTY.filter(lambda v: not isinstance(v, dict)))
    return Req("POST", draw(st.sampled_from(POST_PATHS)), body, headers)


# A long key stays under aiohttp's 8190-byte limit on one header line: past it the HTTP parser answers a plain-text
# 400 before the application (and its error objects) sees the request.
AUTHORIZATIONS = st.sampled_from([None, "", "Bearer", "Bearer ", "Bearer wrong", "Basic c2stZnV6ejo=", "sk-fuzz",
                                  "Bearer " + "x" * 8000, "Bearer sk-fuzz ", "Bearer\tsk-fuzz", "bearer sk-fuzz"])


@st.composite
def unauthorized(draw, target: Target) -> Req:
    """Any request with a missing or wrong API key: a 401 before anything else is looked at (the probes, /metrics
    and the model card of a valid request still answer)."""
    req = draw(_valid_post(target) | valid.reads(target) | valid.admin(target))
    auth = draw(AUTHORIZATIONS)
    headers = {k: v for k, v in req.headers.items() if k != "Authorization"}
    if auth is not None:
        headers["Authorization"] = auth.replace("sk-fuzz", target.key + "x")
    is_open = urllib.parse.urlsplit(req.path).path in OPEN_PATHS
    return Req(req.method, req.path, req.body, headers, expect=None if is_open else 401)


UNKNOWN_PATHS = st.sampled_from(["/", "/v2/chat/completions", "/generate/", "/v1/chat/completions/x", "/v1",
                                 "/%2e%2e/etc/passwd", "/v1/models/", "/get_model_info/..", "/GENERATE",
                                 "/v1/completions%00", "//generate"]) | st.text(min_size=1, max_size=30).map(
    lambda t: "/" + urllib.parse.quote(t))


@st.composite
def wrong_routes(draw, target: Target) -> Req:
    """A wrong method on a known path, or any method on an unknown path."""
    if draw(st.booleans()):
        path = draw(st.sampled_from([*POST_PATHS, "/health", "/v1/models", "/flush_cache", "/get_server_info",
                                     "/openapi.json", "/metrics"]))
        method = draw(st.sampled_from(["PUT", "DELETE", "PATCH", "OPTIONS", "GET" if path in POST_PATHS else "POST"]))
    else:
        path, method = draw(UNKNOWN_PATHS), draw(st.sampled_from(["GET", "POST", "PUT", "HEAD"]))
    body = draw(st.none() | valid.JSON_ANY)
    return Req(method, path, body, target.auth())


def concurrent(target: Target) -> st.SearchStrategy[list[Req]]:
    """Two to six requests sent at once: valid, malformed and hung-up ones, and /flush_cache, which is refused (a
    400) when it finds requests running."""
    flush = st.builds(lambda body: Req("POST", "/flush_cache", body, target.auth()), st.none() | valid.JSON_ANY)
    if target.embedding:
        gone = valid.embeddings(target).map(lambda r: dataclasses.replace(r, ok=False, hang_up="at once"))
        return st.lists(st.one_of(valid.embeddings(target), gone, mutated(target), garbage(target), flush),
                        min_size=2, max_size=6)
    one = st.one_of(valid.chat(target), valid.completion(target), valid.generate(target), valid.tokenizer(target),
                    valid.hang_up(target), mutated(target), garbage(target), flush)
    return st.lists(one, min_size=2, max_size=6)
