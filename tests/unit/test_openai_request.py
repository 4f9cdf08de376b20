"""The router's OpenAI protocol layer, requests: OpenAI request JSON -> TokenizeRequest, SamplingParams and
LogprobOptions, and the 400/404 errors that name the bad field."""

from __future__ import annotations

import json

import pytest

from radixmesh.v1 import common_pb2
from radixmesh.services.router.openai_errors import OpenAIError
from radixmesh.services.router.openai_request import parse_chat_completion, parse_completion
from tests.unit.openai_jobs import SERVED, USER, chat, completion

OPTIONAL_SAMPLING = ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
                     "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "no_stop_trim", "n", "sampling_seed")




# ---------------------------------------------------------------------------------------------------------------
# Requests: field mapping


def test_chat_minimal_leaves_every_sampling_field_unset():
    job = parse_chat_completion({"messages": USER}, SERVED)
    assert (job.model, job.kind, job.n, job.stream, job.include_usage, job.echo) == ("tiny", "chat", 1, False, False,
                                                                                     False)
    (prompt,) = job.prompts
    assert prompt.ids is None and prompt.tokenize.WhichOneof("input") == "chat"
    msgs = prompt.tokenize.chat.messages
    assert [(m.role, m.content) for m in msgs] == [("user", "hi")]
    assert not prompt.tokenize.chat.HasField("add_generation_prompt")
    assert not prompt.tokenize.chat.continue_final_message
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
    m = job.prompts[0].tokenize.chat.messages
    assert [(x.role, x.content) for x in m] == [("system", "be brief"), ("user", "line one\nline two"),
                                                ("assistant", ""), ("tool", "42")]
    assert m[1].name == "ann" and json.loads(m[2].tool_calls_json) == calls
    assert (m[3].tool_call_id, m[3].name) == ("call_1", "get") and m[0].tool_calls_json == ""
    assert json.loads(job.prompts[0].tokenize.chat.tools_json) == tools and job.tool_choice == "auto"


def test_tool_choice_none_keeps_tools_out_and_named_choice_is_kept():
    tools = [{"type": "function", "function": {"name": "get"}}]
    assert chat(tools=tools, tool_choice="none").prompts[0].tokenize.chat.tools_json == ""
    named = {"type": "function", "function": {"name": "get"}}
    job = chat(tools=tools, tool_choice=named)
    assert job.tool_choice == named and json.loads(job.prompts[0].tokenize.chat.tools_json) == tools


def test_chat_template_controls():
    msgs = USER + [{"role": "assistant", "content": "Sure,"}]
    job = parse_chat_completion({"messages": msgs, "continue_final_message": True,
                                 "chat_template_kwargs": {"enable_thinking": False}}, SERVED)
    c = job.prompts[0].tokenize.chat
    assert c.continue_final_message and c.HasField("add_generation_prompt") and not c.add_generation_prompt
    assert json.loads(c.chat_template_kwargs_json) == {"enable_thinking": False}
    c = chat(add_generation_prompt=False).prompts[0].tokenize.chat
    assert c.HasField("add_generation_prompt") and not c.add_generation_prompt
    # OpenAI's reasoning_effort reaches the template (GPT-OSS's reads it), unless chat_template_kwargs gives its own
    c = chat(reasoning_effort="high").prompts[0].tokenize.chat
    assert json.loads(c.chat_template_kwargs_json) == {"reasoning_effort": "high"}
    c = chat(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "medium", "x": 1}).prompts[0].tokenize.chat
    assert json.loads(c.chat_template_kwargs_json) == {"reasoning_effort": "medium", "x": 1}


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


@pytest.mark.parametrize("prompt, expected", [
    ("Once upon", ["Once upon"]),
    ("", [""]),
    ([1, 2, 3], [(1, 2, 3)]),
    (["Once"], ["Once"]),
    ([[4, 5]], [(4, 5)]),
    (["a", [7, 8], ""], ["a", (7, 8), ""]),
    ([[1], [2]], [(1,), (2,)]),
])
def test_completion_prompt_forms(prompt, expected):
    job = parse_completion({"prompt": prompt}, SERVED)
    assert job.kind == "completion" and len(job.prompts) == len(expected)
    for p, want in zip(job.prompts, expected):
        if isinstance(want, tuple):
            assert p.ids == want and p.tokenize is None
        else:
            assert p.ids is None and p.tokenize.WhichOneof("input") == "text" and p.tokenize.text == want
            assert not p.tokenize.HasField("add_special_tokens")


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
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "low, medium, high"),
    ({"reasoning_effort": 2}, "reasoning_effort", "string"),
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
    ({"prompt": [1, "a"]}, "prompt[0]", "prompt[0]"),
    ({"prompt": [-1]}, "prompt", "prompt"),
    ({"prompt": [True]}, "prompt", "prompt"),
    ({"prompt": [[]]}, "prompt[0]", "prompt[0]"),
    ({"prompt": ["a", 5]}, "prompt[1]", "prompt[1]"),
    ({"prompt": ["a", [1, -2]]}, "prompt[1]", "prompt[1]"),
    ({"prompt": ["a"] * 1025}, "prompt", "at most 1024"),
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



def test_a_message_without_content_is_rejected_unless_it_carries_tool_calls():
    with pytest.raises(OpenAIError) as err:
        parse_chat_completion({"model": "tiny", "messages": [{"role": "user"}]}, SERVED)
    assert err.value.status == 400 and err.value.param == "messages[0].content"
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    job = parse_chat_completion({"model": "tiny", "messages": [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "tool_calls": calls}]}, SERVED)
    assert job.prompts[0].tokenize.chat.messages[1].content == ""
