"""The router's OpenAI protocol layer, responses: worker messages -> OpenAI JSON, error bodies and SSE framing
(checked with the official `openai` package's models and, end to end, its client over an in-memory HTTP transport)."""

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
from radixmesh.services.router.openai_errors import (OpenAIError, bad_request, from_status, internal, not_found,
                                                     unauthorized, unavailable)
from radixmesh.services.router.openai_request import parse_chat_completion, parse_completion
from tests.unit.openai_jobs import SERVED, USER, chat, completion
from radixmesh.services.router.completion_response import CompletionResult, CompletionStream
from radixmesh.services.router.openai_response import SSE_DONE, ChatResult, ChatStream, error_event, sse, worker_error

STOP, LENGTH, ABORT = (common_pb2.FINISH_REASON_TYPE_STOP, common_pb2.FINISH_REASON_TYPE_LENGTH,
                       common_pb2.FINISH_REASON_TYPE_ABORT)





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
    stream = CompletionStream(job, "cmpl-1", 7, prompt_texts=["Once"], prompt_tokens=[2])
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
    result = CompletionResult(job, "cmpl-2", 3, prompt_texts=["Once"])
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
    result = CompletionResult(completion(echo=True, logprobs=0), "c", 1, prompt_texts=["Hi"])
    inp = common_pb2.InputLogprobs(token_ids=[5], token_logprobs=[float("nan")], texts=["Hi"],
                                   top_logprobs=[common_pb2.TopLogprobs()])
    result.on_message(complete(0, "!", lps=out_lps(["!"], [-0.5]), inp=inp))
    choice = result.result()["choices"][0]
    assert choice["text"] == "Hi!"
    assert choice["logprobs"] == {"tokens": ["Hi", "!"], "token_logprobs": [None, -0.5], "top_logprobs": None,
                                  "text_offset": [0, 2]}
    plain = CompletionResult(completion(echo=True), "c", 1, prompt_texts=["Hi"])
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


# ---------------------------------------------------------------------------------------------------------------
# events(): the bytes of a message's chunks, a plain single-sample stream's content chunks written from a template


def _both(make, messages):
    """Each message through events() on one builder and through on_message + sse on a twin: (bytes, bytes), or the
    two errors' (status, message) where a message is refused."""
    fast, slow = make(), make()
    fast.slow_calls = 0
    dicts = fast.on_message

    def counted(m):
        fast.slow_calls += 1
        return dicts(m)
    fast.on_message = counted
    out = []
    for m in messages:
        try:
            a = fast.events(m)
        except OpenAIError as e:
            a = (e.status, e.message)
        try:
            b = b"".join(map(sse, slow.on_message(m)))
        except OpenAIError as e:
            b = (e.status, e.message)
        out.append((a, b))
    return out, fast, slow


TEXTS = ["Hel", "", "lo é", 'quote " back\\slash', "ctl \x01\x1f\t\n\u2028 end", "😀 emoji", "中文"]


@pytest.mark.parametrize("fields", [
    {}, {"stream_options": {"include_usage": True}}, {"n": 2}, {"logprobs": True},
])
def test_chat_stream_events_equal_the_chunks_sse(fields):
    job = chat(stream=True, **fields)
    messages = [chunk(0, t, done=i + 1) for i, t in enumerate(TEXTS)]
    messages += [complete(0, "".join(TEXTS) + " rest", kind=LENGTH, usage=(5, 9, 2))]
    if job.n == 2:
        messages += [chunk(1, "x"), complete(1, "x")]
    messages += [chunk(0, "late")]  # after the sample completed: refused the same way
    pairs, fast, slow = _both(lambda: ChatStream(job, "chatcmpl-1", 1700000000, prompt_tokens=5), messages)
    for a, b in pairs:
        assert a == b
    assert fast.final_chunks() == slow.final_chunks()
    assert pairs[-1][0][0] == 500  # the late chunk
    if not fields or "stream_options" in fields:  # the template served every chunk but the first
        assert fast.slow_calls == len(messages) - len(TEXTS) + 1


def test_chat_stream_events_refuse_bad_indices_and_errors_as_on_message():
    job = chat(stream=True)
    error = worker_pb2.GenerateResponse(index=0, error=worker_pb2.GenerateError(message="oom", http_status_code=503))
    for bad in (chunk(3, "x"), error, worker_pb2.GenerateResponse(index=0)):
        pairs, _, _ = _both(lambda: ChatStream(job, "c", 1), [chunk(0, "a"), chunk(0, "b"), bad])
        assert pairs[-1][0] == pairs[-1][1] and isinstance(pairs[-1][0], tuple)


@pytest.mark.parametrize("fields", [{}, {"echo": True}, {"stream_options": {"include_usage": True}}, {"n": 2},
                                    {"logprobs": 1}, {"prompt": ["a", "b"]}])
def test_completion_stream_events_equal_the_chunks_sse(fields):
    job = completion(stream=True, **fields)
    prompts = len(job.prompts)
    messages = [chunk(0, t, done=i + 1, lps=out_lps([t], [-0.5]) if job.want_logprobs else None)
                for i, t in enumerate(TEXTS)]
    messages += [complete(0, "".join(TEXTS), kind=STOP, usage=(5, 7, 2))]
    pairs, fast, slow = _both(lambda: CompletionStream(job, "cmpl-1", 1700000000, ["Once"] * prompts,
                                                       [5] * prompts), messages)
    for a, b in pairs:
        assert a == b
    assert fast.final_chunks() == slow.final_chunks()
    if fields in ({}, {"stream_options": {"include_usage": True}}):
        assert fast.slow_calls == 2  # the first chunk and the complete
