"""The router's OpenAI protocol layer: request JSON -> proto pieces, worker messages -> OpenAI JSON (checked with the
official `openai` package's models and, end to end, its client over an in-memory HTTP transport)."""

from __future__ import annotations

import json

import openai
import pytest

try:  # the HTTP library this version of the openai client is built on
    import httpx2 as httpx
except ImportError:
    import httpx
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from radixmesh.v1 import common_pb2, worker_pb2
from services.router.openai_errors import (OpenAIError, bad_request, from_status, internal, not_found, unauthorized,
                                           unavailable)
from services.router.openai_request import parse_chat_completion, parse_completion
from services.router.openai_response import (SSE_DONE, ChatResult, ChatStream, CompletionResult, CompletionStream,
                                             error_event, sse, worker_error)

SERVED = {"tiny"}
USER = [{"role": "user", "content": "hi"}]
OPTIONAL_SAMPLING = ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
                     "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "no_stop_trim", "n", "sampling_seed")
STOP, LENGTH, ABORT = (common_pb2.FINISH_REASON_TYPE_STOP, common_pb2.FINISH_REASON_TYPE_LENGTH,
                       common_pb2.FINISH_REASON_TYPE_ABORT)


def chat(**fields):
    return parse_chat_completion({"model": "tiny", "messages": USER, **fields}, SERVED)


def completion(**fields):
    return parse_completion({"model": "tiny", "prompt": "Once", **fields}, SERVED)


# ---------------------------------------------------------------------------------------------------------------
# Requests: field mapping


def test_chat_minimal_leaves_every_sampling_field_unset():
    job = parse_chat_completion({"messages": USER}, SERVED)
    assert (job.model, job.kind, job.n, job.stream, job.include_usage, job.echo) == ("tiny", "chat", 1, False, False,
                                                                                     False)
    assert job.prompt_ids is None and job.tokenize.WhichOneof("input") == "chat"
    msgs = job.tokenize.chat.messages
    assert [(m.role, m.content) for m in msgs] == [("user", "hi")]
    assert not job.tokenize.chat.HasField("add_generation_prompt") and not job.tokenize.chat.continue_final_message
    assert not any(job.sampling.HasField(f) for f in OPTIONAL_SAMPLING)
    assert job.sampling.WhichOneof("constraint") is None
    assert not job.sampling.stop and not job.sampling.stop_token_ids and not job.sampling.logit_bias
    assert job.logprobs == common_pb2.LogprobOptions() and not job.want_logprobs and job.top_logprobs == 0


def test_chat_sampling_fields_map_to_sampling_params():
    job = chat(max_completion_tokens=7, max_tokens=99, temperature=0.5, top_p=0.9, presence_penalty=0.25,
               frequency_penalty=-0.5, seed=1234, stop="END", n=3, logit_bias={"17": -100, "5": 2.5}, top_k=40,
               min_p=0.05, repetition_penalty=1.1, min_tokens=2, ignore_eos=True, skip_special_tokens=False,
               spaces_between_special_tokens=False, no_stop_trim=True, stop_token_ids=[2, 3], regex="[a-z]+")
    sp = job.sampling
    assert (sp.max_new_tokens, sp.min_new_tokens, sp.n, sp.sampling_seed, sp.top_k) == (7, 2, 3, 1234, 40)
    assert (sp.temperature, sp.top_p, sp.min_p, sp.repetition_penalty) == pytest.approx((0.5, 0.9, 0.05, 1.1))
    assert (sp.presence_penalty, sp.frequency_penalty) == (0.25, -0.5)
    assert (sp.ignore_eos, sp.skip_special_tokens, sp.spaces_between_special_tokens, sp.no_stop_trim) == (
        True, False, False, True)
    assert list(sp.stop) == ["END"] and list(sp.stop_token_ids) == [2, 3]
    assert dict(sp.logit_bias) == {17: -100.0, 5: 2.5}
    assert sp.WhichOneof("constraint") == "regex" and sp.regex == "[a-z]+"
    assert job.n == 3


def test_max_tokens_alone_and_stop_list():
    job = chat(max_tokens=16, stop=["a", "bb", "c", "d", "e"])
    assert job.sampling.max_new_tokens == 16 and list(job.sampling.stop) == ["a", "bb", "c", "d", "e"]
    assert completion(max_tokens=0).sampling.max_new_tokens == 0
    assert chat(max_tokens=5.0).sampling.max_new_tokens == 5
    assert not chat(stop=[]).sampling.stop


def test_nulls_read_as_absent():
    job = chat(temperature=None, max_tokens=None, stop=None, logprobs=None, top_logprobs=None, response_format=None,
               stream_options=None, tools=None, tool_choice=None, seed=None)
    assert not any(job.sampling.HasField(f) for f in OPTIONAL_SAMPLING) and not job.want_logprobs


@pytest.mark.parametrize("fmt, expected", [
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object", "properties": {
        "name": {"type": "string"}}}, "strict": True}},
     {"type": "object", "properties": {"name": {"type": "string"}}}),
    ({"type": "json_object"}, {"type": "object"}),
])
def test_response_format_becomes_json_schema(fmt, expected):
    sp = chat(response_format=fmt).sampling
    assert sp.WhichOneof("constraint") == "json_schema" and json.loads(sp.json_schema) == expected
    if fmt["type"] == "json_object":
        assert sp.json_schema == '{"type": "object"}'


def test_response_format_text_and_ebnf():
    assert chat(response_format={"type": "text"}).sampling.WhichOneof("constraint") is None
    sp = chat(ebnf='root ::= "yes" | "no"').sampling
    assert sp.WhichOneof("constraint") == "ebnf" and sp.ebnf == 'root ::= "yes" | "no"'


def test_chat_logprobs_options():
    job = chat(logprobs=True, top_logprobs=3)
    assert job.want_logprobs and job.top_logprobs == 3
    lo = job.logprobs
    assert (lo.return_logprob, lo.top_logprobs_num, lo.return_text_in_logprobs) == (True, 3, True)
    assert not lo.HasField("logprob_start_len")
    job = chat(logprobs=True)
    assert job.want_logprobs and job.logprobs.return_logprob and job.logprobs.top_logprobs_num == 0
    job = chat(logprobs=False, top_logprobs=0)
    assert not job.want_logprobs and not job.logprobs.return_logprob


def test_chat_messages_content_parts_roles_and_tools():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get", "arguments": "{\"x\": 1}"}}]
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}],
         "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "get"},
    ]
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    job = parse_chat_completion({"messages": messages, "tools": tools, "tool_choice": "auto"}, SERVED)
    m = job.tokenize.chat.messages
    assert [(x.role, x.content) for x in m] == [("system", "be brief"), ("user", "line one\nline two"),
                                                ("assistant", ""), ("tool", "42")]
    assert m[1].name == "ann" and json.loads(m[2].tool_calls_json) == calls
    assert (m[3].tool_call_id, m[3].name) == ("call_1", "get") and m[0].tool_calls_json == ""
    assert json.loads(job.tokenize.chat.tools_json) == tools and job.tool_choice == "auto"


def test_tool_choice_none_keeps_tools_out_and_named_choice_is_kept():
    tools = [{"type": "function", "function": {"name": "get"}}]
    assert chat(tools=tools, tool_choice="none").tokenize.chat.tools_json == ""
    named = {"type": "function", "function": {"name": "get"}}
    job = chat(tools=tools, tool_choice=named)
    assert job.tool_choice == named and json.loads(job.tokenize.chat.tools_json) == tools


def test_chat_template_controls():
    msgs = USER + [{"role": "assistant", "content": "Sure,"}]
    job = parse_chat_completion({"messages": msgs, "continue_final_message": True,
                                 "chat_template_kwargs": {"enable_thinking": False}}, SERVED)
    c = job.tokenize.chat
    assert c.continue_final_message and c.HasField("add_generation_prompt") and not c.add_generation_prompt
    assert json.loads(c.chat_template_kwargs_json) == {"enable_thinking": False}
    c = chat(add_generation_prompt=False).tokenize.chat
    assert c.HasField("add_generation_prompt") and not c.add_generation_prompt


def test_stream_and_include_usage():
    job = chat(stream=True, stream_options={"include_usage": True})
    assert job.stream and job.include_usage
    job = chat(stream=True)
    assert job.stream and not job.include_usage
    job = chat(stream=False, stream_options={"include_usage": True})
    assert not job.stream and not job.include_usage


def test_ignored_fields_and_model_choice():
    job = chat(separate_reasoning=True, rid="abc", user="u1", something_new={"x": 1})
    assert job.model == "tiny"
    assert parse_chat_completion({"messages": USER}, ["b", "a"]).model == "b"
    assert parse_chat_completion({"messages": USER}, {"b", "a"}).model == "a"
    assert parse_chat_completion({"model": "a", "messages": USER}, {"b", "a"}).model == "a"


def test_unknown_model_is_404_and_no_model_is_503():
    with pytest.raises(OpenAIError) as e:
        parse_chat_completion({"model": "gpt-9", "messages": USER}, SERVED)
    assert (e.value.status, e.value.type, e.value.param, e.value.code) == (404, "not_found_error", "model",
                                                                           "model_not_found")
    assert "gpt-9" in e.value.message and "tiny" in e.value.message
    with pytest.raises(OpenAIError) as e:
        parse_completion({"prompt": "x"}, set())
    assert (e.value.status, e.value.type) == (503, "service_unavailable")


@pytest.mark.parametrize("prompt, text, ids", [
    ("Once upon", "Once upon", None),
    ("", "", None),
    ([1, 2, 3], None, (1, 2, 3)),
    (["Once"], "Once", None),
    ([[4, 5]], None, (4, 5)),
])
def test_completion_prompt_forms(prompt, text, ids):
    job = parse_completion({"prompt": prompt}, SERVED)
    assert job.kind == "completion" and job.prompt_ids == ids
    if text is None:
        assert job.tokenize is None
    else:
        assert job.tokenize.WhichOneof("input") == "text" and job.tokenize.text == text
        assert not job.tokenize.HasField("add_special_tokens")


def test_completion_logprobs_and_echo():
    job = completion(logprobs=2, echo=True, n=2, best_of=2)
    lo = job.logprobs
    assert (job.echo, job.want_logprobs, job.top_logprobs, job.n) == (True, True, 2, 2)
    assert (lo.return_logprob, lo.top_logprobs_num, lo.return_text_in_logprobs) == (True, 2, True)
    assert lo.HasField("logprob_start_len") and lo.logprob_start_len == 0
    job = completion(logprobs=0)
    assert job.want_logprobs and job.top_logprobs == 0 and job.logprobs.return_logprob
    assert not job.logprobs.HasField("logprob_start_len")
    job = completion(echo=True)
    assert job.echo and not job.want_logprobs and not job.logprobs.return_logprob


# ---------------------------------------------------------------------------------------------------------------
# Requests: validation


CHAT_ERRORS = [
    ({"messages": None}, "messages", "messages"),
    ({"messages": []}, "messages", "non-empty"),
    ({"messages": "hi"}, "messages", "messages"),
    ({"messages": ["hi"]}, "messages[0]", "messages[0]"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
     "messages[0].content[0]", "text only"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0]", "text part"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content[0]", "text"),
    ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name", "name"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": "x"}]}, "messages[0].tool_calls", "tool_calls"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [1]}]}, "messages[0].tool_calls", "tool_calls"),
    ({"model": 5}, "model", "model"),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"temperature": True}, "temperature", "temperature"),
    ({"temperature": float("nan")}, "temperature", "temperature"),
    ({"temperature": 10**400}, "temperature", "temperature"),
    ({"top_p": 0}, "top_p", "top_p"),
    ({"top_p": 1.5}, "top_p", "top_p"),
    ({"n": 0}, "n", "'n'"),
    ({"n": 129}, "n", "'n'"),
    ({"n": True}, "n", "'n'"),
    ({"n": 2.5}, "n", "'n'"),
    ({"max_tokens": -1}, "max_tokens", "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens", "max_tokens"),
    ({"max_tokens": True}, "max_tokens", "max_tokens"),
    ({"max_tokens": 2**31}, "max_tokens", "max_tokens"),
    ({"max_completion_tokens": "10"}, "max_completion_tokens", "max_completion_tokens"),
    ({"frequency_penalty": 3}, "frequency_penalty", "frequency_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty", "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty"),
    ({"seed": -1}, "seed", "seed"),
    ({"seed": "x"}, "seed", "seed"),
    ({"top_k": 0}, "top_k", "top_k"),
    ({"top_k": -2}, "top_k", "top_k"),
    ({"min_p": 2}, "min_p", "min_p"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens", "min_tokens"),
    ({"stop": ""}, "stop", "stop"),
    ({"stop": [""]}, "stop", "stop"),
    ({"stop": [1]}, "stop", "stop"),
    ({"stop": {"a": 1}}, "stop", "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "stop_token_ids"),
    ({"stop_token_ids": 3}, "stop_token_ids", "stop_token_ids"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "logit_bias"),
    ({"logit_bias": {"5": 200}}, "logit_bias", "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias", "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias", "logit_bias"),
    ({"ignore_eos": "yes"}, "ignore_eos", "ignore_eos"),
    ({"response_format": "json"}, "response_format", "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "string"}}},
     "response_format.json_schema.schema", "schema"),
    ({"response_format": {"type": "json_object"}, "regex": "a+"}, "regex", "at most one"),
    ({"regex": "a+", "ebnf": "root ::= \"a\""}, "ebnf", "at most one"),
    ({"regex": ""}, "regex", "regex"),
    ({"logprobs": "yes"}, "logprobs", "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs", "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs"),
    ({"stream": "true"}, "stream", "stream"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "include_usage"),
    ({"stream_options": []}, "stream_options", "stream_options"),
    ({"tools": {"type": "function"}}, "tools", "tools"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0]", "tools[0]"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools[0]", "tools[0]"),
    ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "'g'"),
    ({"continue_final_message": True}, "continue_final_message", "assistant"),
    ({"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True,
      "add_generation_prompt": True}, "add_generation_prompt", "continue_final_message"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs", "chat_template_kwargs"),
]


@pytest.mark.parametrize("fields, param, needle", CHAT_ERRORS)
def test_chat_validation_errors(fields, param, needle):
    with pytest.raises(OpenAIError) as e:
        parse_chat_completion({"model": "tiny", "messages": USER, **fields}, SERVED)
    err = e.value
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param), err
    assert needle in err.message, err.message
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error", "param": param,
                                    "code": None}}


COMPLETION_ERRORS = [
    ({"prompt": None}, "prompt", "prompt"),
    ({"prompt": 5}, "prompt", "prompt"),
    ({"prompt": []}, "prompt", "prompt"),
    ({"prompt": [1, "a"]}, "prompt", "prompt"),
    ({"prompt": [-1]}, "prompt", "prompt"),
    ({"prompt": [True]}, "prompt", "prompt"),
    ({"prompt": [[]]}, "prompt", "prompt"),
    ({"prompt": ["a", "b"]}, "prompt", "batched prompts"),
    ({"prompt": [[1], [2]]}, "prompt", "batched prompts"),
    ({"logprobs": 21}, "logprobs", "logprobs"),
    ({"logprobs": True}, "logprobs", "logprobs"),
    ({"echo": "yes"}, "echo", "echo"),
    ({"suffix": "end"}, "suffix", "suffix"),
    ({"best_of": 3, "n": 2}, "best_of", "best_of"),
    ({"temperature": "hot"}, "temperature", "temperature"),
]


@pytest.mark.parametrize("fields, param, needle", COMPLETION_ERRORS)
def test_completion_validation_errors(fields, param, needle):
    with pytest.raises(OpenAIError) as e:
        parse_completion({"model": "tiny", "prompt": "x", **fields}, SERVED)
    assert (e.value.status, e.value.type, e.value.param) == (400, "invalid_request_error", param), e.value
    assert needle in e.value.message, e.value.message


@pytest.mark.parametrize("body", [[1, 2], "text", None, 3])
def test_body_must_be_an_object(body):
    for parse in (parse_chat_completion, parse_completion):
        with pytest.raises(OpenAIError) as e:
            parse(body, SERVED)
        assert e.value.status == 400 and "JSON object" in e.value.message


# ---------------------------------------------------------------------------------------------------------------
# Errors and SSE framing


def test_error_helpers_and_bodies():
    cases = [(bad_request("m", "p"), 400, "invalid_request_error"), (unauthorized(), 401, "authentication_error"),
             (not_found("m"), 404, "not_found_error"), (unavailable("m"), 503, "service_unavailable"),
             (internal("m"), 500, "internal_server_error"), (from_status(429, "m"), 429, "rate_limit_error"),
             (from_status(0, "m"), 500, "internal_server_error"), (from_status(418, "m"), 418, "invalid_request_error")]
    for err, status, kind in cases:
        assert (err.status, err.type, set(err.body()["error"])) == (status, kind, {"message", "type", "param", "code"})
    assert unauthorized().body()["error"]["code"] == "invalid_api_key"
    err = worker_error(worker_pb2.GenerateError(message="KV pool full", http_status_code=503))
    assert (err.status, err.message, err.type) == (503, "KV pool full", "service_unavailable")
    assert worker_error(worker_pb2.GenerateError()).status == 500
    assert error_event(err) == {"error": {"message": "KV pool full", "type": "service_unavailable", "param": None,
                                          "code": None}}


def test_sse_framing():
    assert sse({"a": [1, 2], "b": "héllo"}) == 'data: {"a":[1,2],"b":"héllo"}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------------------------
# Worker messages


def out_lps(texts, lps, tops=None):
    tl = [common_pb2.TopLogprobs(token_ids=list(range(len(t))), logprobs=[v for _, v in t], texts=[s for s, _ in t])
          for t in (tops or [])]
    return common_pb2.OutputLogprobs(token_ids=list(range(100, 100 + len(texts))), token_logprobs=lps, texts=texts,
                                     top_logprobs=tl)


def chunk(index, text, n_tokens=1, lps=None, prompt=5, done=1, cached=2, inp=None):
    c = worker_pb2.GenerateStreamChunk(token_ids=list(range(n_tokens)), text=text, prompt_tokens=prompt,
                                       completion_tokens=done, cached_tokens=cached)
    if lps is not None:
        c.output_logprobs.CopyFrom(lps)
    if inp is not None:
        c.input_logprobs.CopyFrom(inp)
    return worker_pb2.GenerateResponse(request_id="r", index=index, chunk=c)


def complete(index, text, kind=STOP, matched=None, usage=(5, 3, 2), lps=None, inp=None):
    fr = common_pb2.FinishReason(type=kind)
    if isinstance(matched, int):
        fr.matched_token_id = matched
    elif isinstance(matched, str):
        fr.matched_stop_str = matched
    c = worker_pb2.GenerateComplete(output_ids=[1, 2, 3], text=text, finish_reason=fr,
                                    usage=common_pb2.Usage(prompt_tokens=usage[0], completion_tokens=usage[1],
                                                           cached_tokens=usage[2]))
    if lps is not None:
        c.output_logprobs.CopyFrom(lps)
    if inp is not None:
        c.input_logprobs.CopyFrom(inp)
    return worker_pb2.GenerateResponse(request_id="r", index=index, complete=c)


def feed(builder, messages):
    out = []
    for m in messages:
        out.extend(builder.on_message(m))
    return out


def test_chat_stream_two_interleaved_samples_with_logprobs_and_usage():
    job = chat(n=2, stream=True, stream_options={"include_usage": True}, logprobs=True, top_logprobs=2)
    stream = ChatStream(job, "chatcmpl-1", 1700000000, prompt_tokens=5)
    chunks = feed(stream, [
        chunk(0, "Hel", lps=out_lps(["Hel"], [-0.5], [[("Hel", -0.5), ("He", -1.5)]]), done=1),
        chunk(1, "Wor", lps=out_lps(["Wor"], [-0.25], [[("Wor", -0.25), ("W", -2.0)]]), done=1),
        chunk(0, "lo é", n_tokens=2, done=3,
              lps=out_lps(["lo", " é"], [-0.1, float("-inf")], [[("lo", -0.1)], [(" é", float("-inf"))]])),
        complete(1, "Wor", kind=STOP, matched="!", usage=(5, 2, 2)),
        complete(0, "Hello é", kind=LENGTH, usage=(5, 3, 2)),
    ]) + stream.final_chunks()
    assert stream.done
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert all((p.id, p.created, p.model) == ("chatcmpl-1", 1700000000, "tiny") for p in parsed)
    per = {0: [], 1: []}
    for p in parsed[:-1]:
        assert len(p.choices) == 1 and p.usage is None
        per[p.choices[0].index].append(p.choices[0])
    for i, expected_text, reason in ((0, "Hello é", "length"), (1, "Wor", "stop")):
        choices = per[i]
        assert choices[0].delta.role == "assistant" and choices[0].delta.content == ""
        assert "".join(c.delta.content or "" for c in choices) == expected_text
        assert [c.finish_reason for c in choices] == [None] * (len(choices) - 1) + [reason]
    assert chunks[-2]["choices"][0]["matched_stop"] is None
    finish1 = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == 1][-1]
    assert finish1["choices"][0]["matched_stop"] == "!"
    tokens0 = [t for c in per[0] if c.logprobs for t in c.logprobs.content]
    assert [(t.token, t.logprob) for t in tokens0] == [("Hel", -0.5), ("lo", pytest.approx(-0.1)), (" é", -9999.0)]
    assert tokens0[2].bytes == list(" é".encode()) and [a.token for a in tokens0[0].top_logprobs] == ["Hel", "He"]
    assert tokens0[0].top_logprobs[1].logprob == -1.5 and tokens0[0].top_logprobs[1].bytes == list(b"He")
    usage = parsed[-1]
    assert usage.choices == [] and usage.usage.prompt_tokens == 5 and usage.usage.completion_tokens == 5
    assert usage.usage.total_tokens == 10 and usage.usage.prompt_tokens_details.cached_tokens == 2


def test_chat_stream_flushes_text_held_until_the_end_and_matched_token_id():
    job = chat(stream=True)
    stream = ChatStream(job, "c", 1)
    chunks = feed(stream, [chunk(0, "Hi"), complete(0, "Hi there", matched=2)])
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {"content": "Hi"},
                                                          {"content": " there"}]
    assert chunks[-1]["choices"][0]["matched_stop"] == 2 and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in chunks) and stream.final_chunks() == []
    assert all(c["choices"][0]["logprobs"] is None for c in chunks)


def test_chat_stream_complete_without_chunks_and_logprobs_in_complete():
    job = chat(stream=True, logprobs=True)
    stream = ChatStream(job, "c", 1)
    chunks = feed(stream, [chunk(0, "", n_tokens=0), complete(0, "ok", lps=out_lps(["o", "k"], [-1.0, -2.0]))])
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {"content": "ok"}]
    entries = chunks[-1]["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["logprob"], e["top_logprobs"]) for e in entries] == [("o", -1.0, []), ("k", -2.0, [])]
    ChatCompletionChunk.model_validate(chunks[-1])


def test_chat_stream_abort_and_worker_error():
    stream = ChatStream(chat(stream=True, n=2), "c", 1)
    out = stream.on_message(complete(0, "part", kind=ABORT))
    assert out[-1]["choices"][0]["finish_reason"] == "abort"
    with pytest.raises(OpenAIError) as e:
        stream.on_message(worker_pb2.GenerateResponse(index=1, error=worker_pb2.GenerateError(
            message="out of memory", http_status_code=503)))
    assert e.value.status == 503 and e.value.message == "out of memory"
    line = sse(error_event(e.value))
    assert json.loads(line[len(b"data: "):])["error"]["message"] == "out of memory"


@pytest.mark.parametrize("msgs, needle", [
    ([chunk(2, "x")], "index 2"),
    ([complete(0, "x"), chunk(0, "y")], "after sample 0"),
    ([worker_pb2.GenerateResponse(index=0)], "empty"),
])
def test_stream_rejects_broken_worker_streams(msgs, needle):
    stream = ChatStream(chat(stream=True, n=2), "c", 1)
    with pytest.raises(OpenAIError) as e:
        feed(stream, msgs)
    assert e.value.status == 500 and needle in e.value.message


def test_chat_result_two_samples_out_of_order():
    job = chat(n=2, logprobs=True, top_logprobs=1)
    result = ChatResult(job, "chatcmpl-9", 42, prompt_tokens=5)
    result.on_message(complete(1, "B", kind=LENGTH, usage=(5, 4, 3), lps=out_lps(["B"], [-0.5], [[("B", -0.5)]])))
    assert not result.done
    with pytest.raises(OpenAIError) as e:
        result.result()
    assert e.value.status == 500 and "[0]" in e.value.message
    result.on_message(complete(0, "Añ", matched=7, usage=(5, 2, 3), lps=out_lps(["A", "ñ"], [-0.1, -0.2])))
    assert result.done
    body = result.result()
    parsed = ChatCompletion.model_validate(body)
    assert (parsed.id, parsed.object, parsed.created, parsed.model) == ("chatcmpl-9", "chat.completion", 42, "tiny")
    assert [(c.index, c.message.role, c.message.content, c.finish_reason) for c in parsed.choices] == [
        (0, "assistant", "Añ", "stop"), (1, "assistant", "B", "length")]
    assert [c["matched_stop"] for c in body["choices"]] == [7, None]
    assert [(t.token, t.bytes) for t in parsed.choices[0].logprobs.content] == [("A", [65]), ("ñ", [195, 177])]
    assert parsed.choices[1].logprobs.content[0].top_logprobs[0].token == "B"
    u = parsed.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens, u.prompt_tokens_details.cached_tokens) == (5, 6, 11,
                                                                                                             3)


def test_chat_result_without_logprobs_uses_router_prompt_count():
    result = ChatResult(chat(), "c", 1, prompt_tokens=9)
    result.on_message(complete(0, "x", usage=(0, 1, 0)))
    body = result.result()
    assert body["choices"][0]["logprobs"] is None and body["usage"]["prompt_tokens"] == 9
    assert ChatCompletion.model_validate(body).usage.total_tokens == 10


def test_completion_stream_with_echo_and_logprobs():
    job = completion(stream=True, echo=True, logprobs=1, stream_options={"include_usage": True})
    stream = CompletionStream(job, "cmpl-1", 7, prompt_text="Once", prompt_tokens=2)
    prompt_lps = common_pb2.InputLogprobs(token_ids=[1, 9], token_logprobs=[float("nan"), -3.0], texts=["<s>", "Once"],
                                          top_logprobs=[common_pb2.TopLogprobs(),
                                                        common_pb2.TopLogprobs(token_ids=[9], logprobs=[-3.0],
                                                                               texts=["Once"])])
    chunks = feed(stream, [
        chunk(0, " upon", lps=out_lps([" upon"], [-0.5], [[(" upon", -0.5)]]), inp=prompt_lps, prompt=2, done=1),
        chunk(0, " a", lps=out_lps([" a"], [-0.25], [[(" a", -0.25)]]), prompt=2, done=2),
        complete(0, " upon a time", kind=LENGTH, usage=(2, 3, 0)),
    ]) + stream.final_chunks()
    first, second, last, usage = chunks
    assert first["choices"][0]["text"] == "Once upon"
    lp = first["choices"][0]["logprobs"]
    assert lp["tokens"] == ["<s>", "Once", " upon"] and lp["token_logprobs"] == [None, -3.0, -0.5]
    assert lp["top_logprobs"] == [None, {"Once": -3.0}, {" upon": -0.5}] and lp["text_offset"] == [0, 3, 4]
    assert second["choices"][0]["logprobs"]["text_offset"] == [9] and second["choices"][0]["finish_reason"] is None
    assert last["choices"][0]["text"] == " time" and last["choices"][0]["finish_reason"] == "length"
    assert last["choices"][0]["logprobs"]["tokens"] == [] and last["choices"][0]["matched_stop"] is None
    assert "".join(c["choices"][0]["text"] for c in chunks[:3]) == "Once upon a time"
    Completion.model_validate(last)
    u = Completion.model_validate(usage).usage
    assert (usage["choices"], u.prompt_tokens, u.completion_tokens, u.total_tokens) == ([], 2, 3, 5)


def test_completion_stream_n2_without_logprobs():
    stream = CompletionStream(completion(stream=True, n=2), "cmpl", 1)
    chunks = feed(stream, [chunk(1, "b"), chunk(0, "a"), chunk(0, ""), complete(0, "a!", matched="!"),
                           complete(1, "b", kind=LENGTH)])
    assert [(c["choices"][0]["index"], c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [
        (1, "b", None), (0, "a", None), (0, "!", "stop"), (1, "", "length")]
    assert all(c["choices"][0]["logprobs"] is None and "usage" not in c for c in chunks)
    assert stream.done and stream.final_chunks() == []


def test_completion_result_with_logprobs():
    job = completion(n=2, logprobs=2)
    result = CompletionResult(job, "cmpl-2", 3, prompt_text="Once")
    tops = [[("a", -0.1), ("b", -2.0)], [("c", -0.2), ("c", -3.0)]]
    result.on_message(complete(1, "ac", kind=LENGTH, usage=(4, 2, 1), lps=out_lps(["a", "c"], [-0.1, -0.2], tops)))
    result.on_message(complete(0, "x", matched="\n", usage=(4, 1, 1), lps=out_lps(["x"], [-1.0], [[("x", -1.0)]])))
    parsed = Completion.model_validate(result.result())
    assert (parsed.id, parsed.object, parsed.model) == ("cmpl-2", "text_completion", "tiny")
    assert [(c.index, c.text, c.finish_reason) for c in parsed.choices] == [(0, "x", "stop"), (1, "ac", "length")]
    lp = parsed.choices[1].logprobs
    assert lp.tokens == ["a", "c"] and lp.token_logprobs == pytest.approx([-0.1, -0.2]) and lp.text_offset == [0, 1]
    assert lp.top_logprobs[0] == pytest.approx({"a": -0.1, "b": -2.0}) and lp.top_logprobs[1] == pytest.approx(
        {"c": -0.2})
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens, parsed.usage.total_tokens) == (4, 3, 7)


def test_completion_result_echo_and_zero_top_logprobs():
    result = CompletionResult(completion(echo=True, logprobs=0), "c", 1, prompt_text="Hi")
    inp = common_pb2.InputLogprobs(token_ids=[5], token_logprobs=[float("nan")], texts=["Hi"],
                                   top_logprobs=[common_pb2.TopLogprobs()])
    result.on_message(complete(0, "!", lps=out_lps(["!"], [-0.5]), inp=inp))
    choice = result.result()["choices"][0]
    assert choice["text"] == "Hi!"
    assert choice["logprobs"] == {"tokens": ["Hi", "!"], "token_logprobs": [None, -0.5], "top_logprobs": None,
                                  "text_offset": [0, 2]}
    plain = CompletionResult(completion(echo=True), "c", 1, prompt_text="Hi")
    plain.on_message(complete(0, "!"))
    assert Completion.model_validate(plain.result()).choices[0].text == "Hi!"


# ---------------------------------------------------------------------------------------------------------------
# End to end through the official client (its SSE parser and error handling), over an in-memory transport


def _client(handler) -> openai.OpenAI:
    return openai.OpenAI(api_key="k", base_url="http://router.test/v1", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handler)))


def test_official_client_reads_our_chat_stream():
    def handler(request: httpx.Request) -> httpx.Response:
        job = parse_chat_completion(json.loads(request.content), SERVED)
        stream = ChatStream(job, "chatcmpl-e2e", 5)
        events = [sse(c) for m in (chunk(0, "Hello"), chunk(0, " world"), complete(0, "Hello world", usage=(3, 2, 0)))
                  for c in stream.on_message(m)]
        events += [sse(c) for c in stream.final_chunks()] + [SSE_DONE]
        return httpx.Response(200, content=b"".join(events), headers={"content-type": "text/event-stream"})

    got = list(_client(handler).chat.completions.create(model="tiny", messages=USER, stream=True,
                                                        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in got if c.choices) == "Hello world"
    assert got[-2].choices[0].finish_reason == "stop" and got[-1].usage.completion_tokens == 2


def test_official_client_reads_our_completion_and_errors():
    def handler(request: httpx.Request) -> httpx.Response:
        try:
            job = parse_completion(json.loads(request.content), SERVED)
        except OpenAIError as e:
            return httpx.Response(e.status, json=e.body())
        result = CompletionResult(job, "cmpl-e2e", 5)
        result.on_message(complete(0, " there", kind=LENGTH, usage=(1, 2, 0)))
        return httpx.Response(200, json=result.result())

    client = _client(handler)
    got = client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    assert got.choices[0].text == " there" and got.choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="Hi")
    assert e.value.code == "model_not_found" and "nope" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="Hi", temperature=-1)
    assert e.value.param == "temperature" and "temperature" in e.value.message


def test_a_message_without_content_is_rejected_unless_it_carries_tool_calls():
    with pytest.raises(OpenAIError) as err:
        parse_chat_completion({"model": "tiny", "messages": [{"role": "user"}]}, SERVED)
    assert err.value.status == 400 and err.value.param == "messages[0].content"
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    job = parse_chat_completion({"model": "tiny", "messages": [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "tool_calls": calls}]}, SERVED)
    assert job.tokenize.chat.messages[1].content == ""
