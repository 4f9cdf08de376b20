"""Hypothesis strategies for requests the router must serve: each `Req` they give has `ok=True` (only a 200 will
do), except embedding requests to a generation model (a 400 naming `model`), model cards of other names (404) and
admin requests with a bad url or lease (400, or 404 for an unknown worker). Generation asks for at most MAX_TOKENS
tokens, so the suite stays fast.

They know the mesh they target through `Target`: tiny-llama (vocabulary VOCAB, context 1024) or tiny-qwen3-embed
(`Target.embedding`) served with an API key by colocated workers, with no --completion-template."""

from __future__ import annotations

import dataclasses
import json
import urllib.parse
from typing import Any

from hypothesis import strategies as st

from radixmesh.services.router.workers import normalize_url
from tests.fuzz.request import Req, Target

MAX_TOKENS = 4
VOCAB = 1000
INT64_MAX = 2**63 - 1


# ---- building blocks ------------------------------------------------------------------------------------------
TEXT = st.text(max_size=60)  # any code point but lone surrogates
SHORT = st.text(min_size=1, max_size=6)
TOKEN = st.integers(0, VOCAB - 1)
TOKENS = st.lists(TOKEN, min_size=1, max_size=24)
NAME = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
UNKNOWN_KEY = NAME.map(lambda s: "x_" + s)
JSON_LEAF = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False,
                                                                                allow_infinity=False) | TEXT
JSON_ANY = st.recursive(JSON_LEAF, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(SHORT, kids, max_size=3),
                        max_leaves=8)
SCHEMAS = [{"type": "object"}, {"type": "string", "maxLength": 3}, {"type": "integer"}, {"enum": ["a", "b"]},
           {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
           {"type": "array", "items": {"type": "number"}, "maxItems": 2}]
REGEXES = ["[a-z]+", "(yes|no)", r"\d{1,3}", "a*b?", ".{0,5}", "[^x]*"]
EBNFS = ['root ::= "a" | "b"', 'root ::= [0-9]+', 'root ::= "x" root | "y"']
OPENAI_SAMPLING = {
    "temperature": st.floats(0, 2) | st.just(0), "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.just(-1) | st.integers(1, 2**31 - 1), "min_p": st.floats(0, 1),
    "frequency_penalty": st.floats(-2, 2), "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0, 2, exclude_min=True), "seed": st.integers(0, 2**63 - 1),
    "n": st.integers(1, 3), "stop": SHORT | st.lists(SHORT, max_size=4),
    "stop_token_ids": st.lists(TOKEN, max_size=3), "ignore_eos": st.booleans(),
    "logit_bias": st.dictionaries(TOKEN.map(str), st.floats(-100, 100), max_size=4),
    "skip_special_tokens": st.booleans(), "spaces_between_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(), "stream": st.booleans(), "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans()}), "user": TEXT,
}
CONSTRAINTS = st.one_of(
    st.just({}), st.builds(lambda s: {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                                 "schema": s}}},
                           st.sampled_from(SCHEMAS)),
    st.sampled_from([{"response_format": {"type": "json_object"}}, {"response_format": {"type": "text"}}]),
    st.sampled_from(REGEXES).map(lambda r: {"regex": r}), st.sampled_from(EBNFS).map(lambda g: {"ebnf": g}))


@st.composite
def _sampling(draw, target: Target) -> dict[str, Any]:
    body = draw(st.fixed_dictionaries({}, optional={**OPENAI_SAMPLING, "model": st.just(target.model)}))
    cap = draw(st.integers(0, MAX_TOKENS))
    body[draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))] = cap
    if draw(st.booleans()):
        body["min_tokens"] = draw(st.integers(0, cap))
    body.update(draw(st.dictionaries(UNKNOWN_KEY, JSON_ANY, max_size=2)))  # unknown fields are ignored
    if "seed" in body:  # sample j draws with seed + j, a signed 64-bit integer
        body["seed"] = min(body["seed"], INT64_MAX - (body.get("n", 1) - 1))
    return body


# ---- requests the router must serve ---------------------------------------------------------------------------
_TOOL = st.builds(lambda name, params: {"type": "function", "function": {"name": name, "parameters": params}},
                  NAME, st.sampled_from([None, *SCHEMAS[:1], SCHEMAS[4]]))
_PART = st.builds(lambda t: {"type": "text", "text": t}, TEXT)
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
                                  "content": TEXT | st.lists(_PART, min_size=1, max_size=2)},
                                 optional={"name": TEXT})


@st.composite
def chat(draw, target: Target) -> Req:
    body = {**draw(_sampling(target)), "messages": draw(st.lists(_MESSAGE, min_size=1, max_size=3))}
    tools = draw(st.lists(_TOOL, max_size=2, unique_by=lambda t: t["function"]["name"]))
    choice = draw(st.sampled_from([None, "none", "auto"] + (["required", "named"] if tools else [])))
    if tools:
        body["tools"] = tools
    if choice == "named":
        body["tool_choice"] = {"type": "function", "function": {"name": draw(st.sampled_from(tools))["function"][
            "name"]}}
    elif choice is not None:
        body["tool_choice"] = choice
    if choice not in ("required", "named"):  # those constrain the output themselves
        body.update(draw(CONSTRAINTS))
    if draw(st.booleans()):
        body["logprobs"] = True
        body["top_logprobs"] = draw(st.integers(0, 5))
    if body["messages"][-1]["role"] == "assistant" and draw(st.booleans()):
        body["continue_final_message"] = True
    elif draw(st.booleans()):
        body["add_generation_prompt"] = draw(st.booleans())
    return Req("POST", "/v1/chat/completions", body, target.auth(), ok=True)


_PROMPT = st.text(max_size=80) | TOKENS
_PROMPTS = _PROMPT | st.lists(_PROMPT, min_size=1, max_size=3)


@st.composite
def completion(draw, target: Target) -> Req:
    body = {**draw(_sampling(target)), "prompt": draw(_PROMPTS), **draw(CONSTRAINTS)}
    body.update(draw(st.fixed_dictionaries({}, optional={"logprobs": st.integers(0, 5), "echo": st.booleans(),
                                                         "suffix": st.just("")})))
    if draw(st.booleans()):
        body["best_of"] = body.get("n", 1)
    return Req("POST", "/v1/completions", body, target.auth(), ok=True)


_NATIVE = {"temperature": st.floats(0, 2), "top_p": st.floats(0, 1, exclude_min=True), "top_k": st.just(-1),
           "min_p": st.floats(0, 1), "frequency_penalty": st.floats(-2, 2), "presence_penalty": st.floats(-2, 2),
           "repetition_penalty": st.floats(0, 2, exclude_min=True), "n": st.integers(1, 3),
           "sampling_seed": st.integers(0, 2**63 - 1), "ignore_eos": st.booleans(), "stop": SHORT,
           "stop_token_ids": st.lists(TOKEN, max_size=3), "skip_special_tokens": st.booleans(),
           "logit_bias": st.dictionaries(TOKEN.map(str), st.floats(-1e6, 1e6), max_size=3),
           "no_stop_trim": st.booleans(), "json_schema": st.sampled_from(SCHEMAS).map(json.dumps)}


def _native_sp(d: dict[str, Any], cap: int) -> dict[str, Any]:
    if "sampling_seed" in d:  # sample j draws with seed + j, a signed 64-bit integer
        d = {**d, "sampling_seed": min(d["sampling_seed"], INT64_MAX - (d.get("n", 1) - 1))}
    return {**d, "max_new_tokens": cap}


_NATIVE_SP = st.builds(_native_sp, st.fixed_dictionaries({}, optional=_NATIVE), st.integers(0, MAX_TOKENS))


@st.composite
def generate(draw, target: Target) -> Req:
    batch = draw(st.integers(0, 3))  # 0: one prompt, not a batch
    count = max(batch, 1)
    if draw(st.booleans()):
        prompts = draw(st.lists(st.text(min_size=1, max_size=80), min_size=count, max_size=count))
        body = {"text": prompts if batch else prompts[0]}
    else:
        prompts = draw(st.lists(TOKENS, min_size=count, max_size=count))
        body = {"input_ids": prompts if batch else prompts[0]}
    sp = draw(st.lists(_NATIVE_SP, min_size=count, max_size=count))
    body["sampling_params"] = sp if batch and draw(st.booleans()) else sp[0]
    body.update(draw(st.fixed_dictionaries({}, optional={
        "stream": st.booleans(), "return_logprob": st.booleans(), "logprob_start_len": st.sampled_from([-1, 0]),
        "top_logprobs_num": st.integers(0, 3), "token_ids_logprob": st.lists(TOKEN, max_size=3),
        "return_text_in_logprobs": st.booleans()})))
    if draw(st.booleans()):
        rids = draw(st.lists(st.text(min_size=1, max_size=8), min_size=count, max_size=count))
        body["rid"] = rids if batch else rids[0]
    return Req("POST", "/generate", body, target.auth(), ok=True)


@st.composite
def tokenizer(draw, target: Target) -> Req:
    if draw(st.booleans()):
        prompt = draw(st.text(max_size=200) | st.lists(st.text(max_size=50), min_size=1, max_size=3))
        body = {"prompt": prompt, **draw(st.fixed_dictionaries({}, optional={"add_special_tokens": st.booleans(),
                                                                             "model": st.just(target.model)}))}
        path = "/tokenize"
    else:
        tokens = draw(st.lists(TOKEN, max_size=30) | st.lists(st.lists(TOKEN, max_size=10), min_size=1, max_size=3))
        body = {"tokens": tokens, **draw(st.fixed_dictionaries({}, optional={"skip_special_tokens": st.booleans()}))}
        path = "/detokenize"
    return Req("POST", draw(st.sampled_from(["", "/v1"])) + path, body, target.auth(), ok=True)


@st.composite
def embeddings(draw, target: Target) -> Req:
    """Well-formed embedding requests: valid on an embedding mesh, a 400 naming `model` on a generation one."""
    inputs = TEXT.filter(bool) | st.lists(SHORT, min_size=1, max_size=3) | TOKENS | st.lists(TOKENS, min_size=1,
                                                                                          max_size=2)
    verdict = {"ok": True} if target.embedding else {"expect": 400}
    if draw(st.booleans()):
        body = {"input": draw(inputs), **draw(st.fixed_dictionaries({}, optional={
            "model": st.just(target.model), "dimensions": st.integers(1, 64),
            "encoding_format": st.sampled_from(["float", "base64"]), "user": TEXT}))}
        return Req("POST", "/v1/embeddings", body, target.auth(), **verdict)
    field = draw(st.sampled_from(["text", "input_ids"]))
    value = draw(st.lists(SHORT, min_size=1, max_size=3) | SHORT) if field == "text" else draw(
        TOKENS | st.lists(TOKENS, min_size=1, max_size=2))
    body = {field: value, **draw(st.fixed_dictionaries({}, optional={"dimensions": st.integers(1, 64)}))}
    if draw(st.booleans()):
        batch = isinstance(value, list) and isinstance(value[0], (str, list))
        count = len(value) if batch else 1
        rids = draw(st.lists(st.text(min_size=1, max_size=8), min_size=count, max_size=count))
        body["rid"] = rids if batch else rids[0]
    return Req("POST", "/encode", body, target.auth(), **verdict)


_GETS = ["/health", "/liveness", "/readiness", "/health_generate", "/get_model_info", "/get_server_info",
         "/v1/models", "/metrics", "/openapi.json"]


@st.composite
def reads(draw, target: Target) -> Req:
    """The GET endpoints (and HEAD), with stray query strings; /v1/models/{name} with any name."""
    query = draw(st.dictionaries(SHORT, TEXT, max_size=2))
    path = draw(st.sampled_from([*_GETS, "model"]))
    ok = True
    if path == "model":
        name = draw(st.just(target.model) | TEXT.filter(bool))
        ok = name == target.model
        path = "/v1/models/" + urllib.parse.quote(name, safe="")
    if query:
        path += "?" + urllib.parse.urlencode(query)
    return Req(draw(st.sampled_from(["GET", "HEAD"])), path, None, target.auth(), ok=ok, expect=None if ok else 404)


def _not_a_worker_url(text: str) -> bool:
    try:
        normalize_url(text)
    except ValueError:
        return True
    return False


@st.composite
def admin(draw, target: Target) -> Req:
    """/flush_cache (with a stray body), /add_worker of a registered worker (idempotent) or of a malformed url or
    lease, /remove_worker of a malformed or unknown url; never a registered worker's removal or lease."""
    what = draw(st.sampled_from(["flush", "add", "add_bad", "remove_bad"]))
    if what == "flush":
        return Req("POST", "/flush_cache", draw(st.none() | JSON_ANY), target.auth(), ok=True)
    bad_url = st.text(max_size=30).filter(_not_a_worker_url) | st.just("127.0.0.1:1")
    query: dict[str, str] = {}
    if what == "add":
        query["url"] = draw(st.sampled_from(target.worker_urls))
    elif what == "add_bad":
        query = draw(st.sampled_from([{"url": draw(bad_url.filter(lambda u: u != "127.0.0.1:1"))},
                                      {"url": draw(st.sampled_from(target.worker_urls)),
                                       "lease_s": draw(st.sampled_from(["0", "-1", "nan", "inf", "1e400", "86400",
                                                                        "x", ""]))}, {}]))
    else:
        query = draw(st.sampled_from([{"url": draw(bad_url)}, {}]))
    path = "/" + what.split("_")[0] + "_worker"
    expect = {"add": None, "add_bad": 400, "remove_bad": 404 if query.get("url") == "127.0.0.1:1" else 400}[what]
    return Req("POST", path + ("?" + urllib.parse.urlencode(query) if query else ""), None, target.auth(),
               ok=what == "add", expect=expect)


@st.composite
def hang_up(draw, target: Target) -> Req:
    """A valid generation request for up to 100 tokens whose client goes away at once, or (streamed) after the first
    event: the router must cancel it on the worker, whose KV pages come back."""
    req = draw(st.one_of(chat(target), completion(target), generate(target)))
    when = draw(st.sampled_from(["at once", "after the first bytes"]))
    body = dict(req.body)
    if req.path == "/generate":
        sp = body["sampling_params"]
        body["sampling_params"] = [{**s, "max_new_tokens": 100, "ignore_eos": True} for s in sp] \
            if isinstance(sp, list) else {**sp, "max_new_tokens": 100, "ignore_eos": True}
    else:
        body.pop("max_completion_tokens", None)
        body.pop("min_tokens", None)
        body.update(max_tokens=100, ignore_eos=True)
    if when != "at once":
        body["stream"] = True
    return dataclasses.replace(req, body=body, ok=False, hang_up=when)
