"""The worker as a real process over gRPC: Generate matches the offline engine, Abort and a closed stream free the
request's KV pages at once, loads/info/flush/health answer, a prefill worker answers health, SIGTERM drains."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time

import grpc
import pytest

from radixmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from radixmesh.services.launch import free_port
from tests.conftest import model_path
from tests.engine_utils import running_engine
from tests.services.metrics_utils import spawn_grpc, start_grpc, wait_grpc

MODEL = model_path("tiny-llama")


def start(module: str, *args: str) -> tuple[subprocess.Popen, str]:
    return start_grpc(module, "--model-path", MODEL, *args)


@pytest.fixture(scope="module")
def worker():
    proc, url = start("radixmesh.services.worker")
    ch = grpc.insecure_channel(url)
    stub = worker_pb2_grpc.WorkerServiceStub(ch)
    stub.url = url  # for a stream lane (tests/services/test_generate_stream.py)
    yield stub
    ch.close()
    proc.terminate()
    assert proc.wait(timeout=30) == 0


def greedy(max_new: int, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_new_tokens=max_new, temperature=0.0, **kw)


def used_after_flush(stub) -> int:
    deadline = time.monotonic() + 10
    while not stub.FlushCache(worker_pb2.FlushCacheRequest()).success:
        assert time.monotonic() < deadline, "flush kept failing: requests still in flight"
        time.sleep(0.05)
    return stub.GetLoads(worker_pb2.GetLoadsRequest()).used_kv_tokens


def test_generate_matches_offline_engine(worker):
    prompt = list(range(20, 60))
    with running_engine(MODEL) as llm:
        ref = llm.generate(input_ids=prompt, sampling_params={"max_new_tokens": 12, "temperature": 0.0})
    msgs = list(worker.Generate(worker_pb2.GenerateRequest(request_id="g1", input_ids=prompt,
                                                           sampling_params=greedy(12), stream=True)))
    assert [t for m in msgs[:-1] for t in m.chunk.token_ids] == ref["output_ids"]
    assert "".join(m.chunk.text for m in msgs[:-1]) == msgs[-1].complete.text == ref["text"]
    assert msgs[-1].complete.usage.completion_tokens == 12
    whole = list(worker.Generate(worker_pb2.GenerateRequest(request_id="g2", input_ids=prompt,
                                                            sampling_params=greedy(12, n=2))))
    assert [m.index for m in whole] == [0, 1] and all(m.WhichOneof("response") == "complete" for m in whole)
    assert list(whole[0].complete.output_ids) == ref["output_ids"]


def test_abort_and_closed_stream_free_pages(worker):
    assert used_after_flush(worker) == 0
    stream = worker.Generate(worker_pb2.GenerateRequest(request_id="long", input_ids=list(range(30, 90)),
                                                        sampling_params=greedy(900, ignore_eos=True), stream=True))
    next(stream)
    assert worker.GetLoads(worker_pb2.GetLoadsRequest()).num_running_requests == 1
    assert worker.Abort(worker_pb2.AbortRequest(request_id="long", reason="test")).found
    last = list(stream)[-1].complete
    assert last.finish_reason.type == common_pb2.FINISH_REASON_TYPE_ABORT
    assert last.usage.completion_tokens < 900
    assert used_after_flush(worker) == 0
    assert not worker.Abort(worker_pb2.AbortRequest(request_id="long")).found
    stream = worker.Generate(worker_pb2.GenerateRequest(request_id="dropped", input_ids=list(range(30, 90)),
                                                        sampling_params=greedy(900, ignore_eos=True), stream=True))
    next(stream)
    stream.cancel()  # the client goes away
    assert used_after_flush(worker) == 0
    assert worker.GetLoads(worker_pb2.GetLoadsRequest()).num_running_requests == 0


def test_info_loads_health_and_errors(worker):
    info = worker.GetModelInfo(worker_pb2.GetModelInfoRequest())
    assert info.model_path == MODEL and info.vocab_size == 1000 and info.disaggregation_mode == "null"
    assert info.max_total_num_tokens > 0 and info.max_context_length == 1024
    server = json.loads(worker.GetServerInfo(worker_pb2.GetServerInfoRequest()).server_info_json)
    assert server["max_total_num_tokens"] == info.max_total_num_tokens and server["page_size"] >= 1
    assert worker.HealthCheck(worker_pb2.HealthCheckRequest()).healthy
    loads = worker.GetLoads(worker_pb2.GetLoadsRequest())
    assert loads.total_kv_tokens == info.max_total_num_tokens and 0 <= loads.cache_hit_rate <= 1
    for bad, text in ((worker_pb2.GenerateRequest(request_id="b1", input_ids=[5, 99999]), "99999"),
                      (worker_pb2.GenerateRequest(request_id="b2", input_ids=[5], sampling_params=common_pb2.
                                                  SamplingParams(temperature=-1.0)), "temperature"),
                      (worker_pb2.GenerateRequest(input_ids=[5]), "request_id")):
        with pytest.raises(grpc.RpcError) as err:
            list(worker.Generate(bad))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # started without --kv-events-config / --kvstore-url
        list(worker.SubscribeKvEvents(worker_pb2.SubscribeKvEventsRequest()))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "kv-events" in err.value.details()


def test_a_text_prompt_is_tokenized_by_the_worker_as_the_tokenizer_service_does(worker):
    """A request with text and no input_ids (what the router sends when it routes on text): the worker's prompt ids
    are the tokenizer service's, so the output is the tokenized request's, on GenerateStream as on Generate."""
    from radixmesh.services.tokenizer.backend import TokenizerBackend
    from radixmesh.services.tokenizer.settings import TokenizerSettings

    assert worker.GetModelInfo(worker_pb2.GetModelInfoRequest()).tokenizes_text
    text = "Hello, world! Ünïcödé, 1234 numbers\tand tabs: the tokenizer sees it all."
    backend = TokenizerBackend.from_settings(TokenizerSettings(model_path=MODEL))
    try:
        ids = asyncio.run(backend.run(backend.tokenize_text, text)).input_ids
    finally:
        backend.close()
    by_ids = list(worker.Generate(worker_pb2.GenerateRequest(request_id="t-ids", input_ids=ids,
                                                             sampling_params=greedy(10))))[-1].complete
    by_text = list(worker.Generate(worker_pb2.GenerateRequest(request_id="t-text", text=text,
                                                              sampling_params=greedy(10), stream=True)))[-1].complete
    assert list(by_text.output_ids) == list(by_ids.output_ids) and by_text.text == by_ids.text
    assert by_text.usage.prompt_tokens == len(ids)
    with pytest.raises(grpc.RpcError) as err:
        list(worker.Generate(worker_pb2.GenerateRequest(request_id="t-none", sampling_params=greedy(4))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "neither input_ids nor text" in err.value.details()


def test_a_chat_prompt_is_rendered_by_the_worker_as_the_tokenizer_service_does(worker):
    """A request with chat messages and no input_ids (what the router sends when it routes chat to the workers): the
    worker renders the model's chat template (tools, a tool call's JSON arguments, template kwargs) and tokenizes it
    as the tokenizer service does, and reports that template's SHA-256; messages the template cannot take are the
    request's INVALID_ARGUMENT."""
    from radixmesh.v1 import tokenizer_pb2
    from radixmesh.services.common.chat_render import chat_from_proto, template_sha256
    from radixmesh.services.tokenizer.backend import TokenizerBackend
    from radixmesh.services.tokenizer.settings import TokenizerSettings

    chat = tokenizer_pb2.ChatInput(
        messages=[tokenizer_pb2.ChatMessage(role="system", content="You answer briefly."),
                  tokenizer_pb2.ChatMessage(role="user", content="What is 2 + 2? Ünïcödé too."),
                  tokenizer_pb2.ChatMessage(role="assistant", content="",
                                            tool_calls_json=json.dumps([{"id": "c1", "type": "function", "function": {
                                                "name": "add", "arguments": "{\"a\": 2, \"b\": 2}"}}])),
                  tokenizer_pb2.ChatMessage(role="tool", content="4", tool_call_id="c1")],
        tools_json=json.dumps([{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]),
        chat_template_kwargs_json=json.dumps({"enable_thinking": False}))
    backend = TokenizerBackend.from_settings(TokenizerSettings(model_path=MODEL))
    try:
        ids = asyncio.run(backend.run(backend.tokenize_chat, chat_from_proto(chat))).input_ids
        sha = template_sha256(backend.info.chat_template)
    finally:
        backend.close()
    assert sha and worker.GetModelInfo(worker_pb2.GetModelInfoRequest()).chat_template_sha256 == sha
    by_ids = list(worker.Generate(worker_pb2.GenerateRequest(request_id="c-ids", input_ids=ids,
                                                             sampling_params=greedy(10))))[-1].complete
    by_chat = list(worker.Generate(worker_pb2.GenerateRequest(request_id="c-chat", chat=chat,
                                                              sampling_params=greedy(10), stream=True)))[-1].complete
    assert list(by_chat.output_ids) == list(by_ids.output_ids) and by_chat.text == by_ids.text
    assert by_chat.usage.prompt_tokens == len(ids)
    for bad, text in ((tokenizer_pb2.ChatInput(), "chat.messages is empty"),
                      (tokenizer_pb2.ChatInput(messages=chat.messages, tools_json="{not json"), "tools_json"),
                      (tokenizer_pb2.ChatInput(messages=chat.messages, continue_final_message=True,
                                               add_generation_prompt=True), "cannot both be true")):
        with pytest.raises(grpc.RpcError) as err:
            list(worker.Generate(worker_pb2.GenerateRequest(request_id="c-bad", chat=bad, sampling_params=greedy(4))))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in err.value.details()


def test_a_chat_with_reasoning_tags_says_where_the_rendering_leaves_the_thinking(worker):
    """What a router's --reasoning-parser needs of a chat the worker renders (GenerateRequest.reasoning_tags): the
    request's first message, streamed or not, says where the rendering leaves the thinking, as prompt_thinking finds
    it in the tokenizer service's rendering; and a constraint's reasoning gate, sent as both tags' token ids, is
    kept as answer_gate gives it for that state: the output is the one of the prompt's ids with that gate."""
    from radixmesh.v1 import tokenizer_pb2
    from radixmesh.services.common import thinking
    from radixmesh.services.common.chat_render import chat_from_proto
    from radixmesh.services.tokenizer.backend import TokenizerBackend
    from radixmesh.services.tokenizer.settings import TokenizerSettings

    assert worker.GetModelInfo(worker_pb2.GetModelInfoRequest()).reports_prompt_thinking
    user = tokenizer_pb2.ChatMessage(role="user", content="What is two plus two?")
    chats = {state: tokenizer_pb2.ChatInput(messages=[user, tokenizer_pb2.ChatMessage(role="assistant", content=c)],
                                            continue_final_message=True)
             for state, c in ((thinking.OPEN, "<think>\nLet me see"), (thinking.CLOSED, "<think>a</think>\n"))}
    chats[thinking.OUTSIDE] = tokenizer_pb2.ChatInput(messages=[user])
    tags = worker_pb2.ReasoningTags(start="<think>", end="</think>")
    regex = r"Sure\. [a-z]{2,6}"
    backend = TokenizerBackend.from_settings(TokenizerSettings(model_path=MODEL))
    try:
        rendered = {s: asyncio.run(backend.run(backend.tokenize_chat, chat_from_proto(c))) for s, c in chats.items()}
    finally:
        backend.close()
    texts = {}
    for state, chat in chats.items():
        assert thinking.prompt_thinking(rendered[state].prompt, tags.start, tags.end) == state
        gate = thinking.answer_gate(state, False, 7, 9)
        gated = {} if gate is None else {"reasoning_end_token_id": gate.end}
        if gate is not None and gate.start is not None:
            gated["reasoning_start_token_id"] = gate.start
        by_ids = list(worker.Generate(worker_pb2.GenerateRequest(
            request_id=f"think-ids-{state}", input_ids=rendered[state].input_ids,
            sampling_params=greedy(8, regex=regex, **gated))))
        assert all(not m.prompt_thinking for m in by_ids)
        texts[state] = by_ids[-1].complete.text
        for stream in (False, True):
            out = list(worker.Generate(worker_pb2.GenerateRequest(
                request_id=f"think-{state}-{stream}", chat=chat, reasoning_tags=tags, stream=stream,
                sampling_params=greedy(8, regex=regex, reasoning_start_token_id=7, reasoning_end_token_id=9))))
            assert [m.prompt_thinking for m in out] == [state] + [thinking.UNSPECIFIED] * (len(out) - 1)
            assert out[-1].complete.text == texts[state], (state, stream)
    assert len(set(texts.values())) == 3, texts  # the gates differ: a gate kept wrongly changes the output
    plain = list(worker.Generate(worker_pb2.GenerateRequest(request_id="think-none", chat=chats[thinking.OPEN],
                                                            sampling_params=greedy(2))))
    assert all(not m.prompt_thinking for m in plain)  # no tags, nothing said
    with pytest.raises(grpc.RpcError) as err:
        list(worker.Generate(worker_pb2.GenerateRequest(request_id="think-bad", chat=chats[thinking.OPEN],
                                                        reasoning_tags=worker_pb2.ReasoningTags(start="<think>"),
                                                        sampling_params=greedy(2))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "reasoning_tags" in err.value.details()


def test_unpaired_prefill_and_decode_requests_fail_within_the_bootstrap_timeout():
    """A prefill request no decode worker registers for, and a decode request whose room the prefill worker never
    gets, each end in ABORTED with the reason within --disaggregation-bootstrap-timeout, holding no page."""
    fast = ("--disaggregation-bootstrap-timeout", "1", "--disaggregation-transfer-backend", "mooncake")
    proc, url = spawn_grpc("radixmesh.services.prefill", "--model-path", MODEL, "--disaggregation-bootstrap-port",
                           str(free_port()), *fast)
    dproc, durl = spawn_grpc("radixmesh.services.worker", "--model-path", MODEL, "--disaggregation-mode", "decode",
                             *fast)
    try:
        wait_grpc(proc, url)
        wait_grpc(dproc, durl)
        with grpc.insecure_channel(url) as ch, grpc.insecure_channel(durl) as dch:
            stub, dstub = worker_pb2_grpc.WorkerServiceStub(ch), worker_pb2_grpc.WorkerServiceStub(dch)
            info = stub.GetModelInfo(worker_pb2.GetModelInfoRequest())
            assert info.disaggregation_mode == "prefill" and info.bootstrap_port > 0
            assert stub.HealthCheck(worker_pb2.HealthCheckRequest()).healthy
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(worker_pb2.GenerateRequest(request_id="p", input_ids=[5, 6])))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "disaggregated_params" in err.value.details()
            pd = worker_pb2.DisaggregatedParams(bootstrap_host="127.0.0.1", bootstrap_port=info.bootstrap_port)
            for target, room, words in ((stub, 7, "no decode worker registered"),
                                        (dstub, 8, "failed in state 'bootstrapping'")):
                pd.bootstrap_room = room
                t = time.monotonic()
                with pytest.raises(grpc.RpcError) as err:
                    list(target.Generate(worker_pb2.GenerateRequest(
                        request_id=f"r{room}", input_ids=list(range(10, 60)), disaggregated_params=pd)))
                assert err.value.code() == grpc.StatusCode.ABORTED and words in err.value.details()
                assert time.monotonic() - t < 5
            for s_ in (stub, dstub):
                load = s_.GetLoads(worker_pb2.GetLoadsRequest())
                assert load.used_kv_tokens == 0 and load.num_prealloc_rooms == load.num_transfer_rooms == 0
    finally:
        for p_ in (proc, dproc):
            p_.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0 and dproc.wait(timeout=30) == 0


def test_sigterm_lets_an_open_stream_finish():
    proc, url = start("radixmesh.services.worker", "--shutdown-grace-s", "20")
    with grpc.insecure_channel(url) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        stream = stub.Generate(worker_pb2.GenerateRequest(request_id="s", input_ids=list(range(30, 60)),
                                                          sampling_params=greedy(150, ignore_eos=True),
                                                          stream=True))
        next(stream)
        proc.send_signal(signal.SIGTERM)
        rest = list(stream)
        assert rest[-1].complete.usage.completion_tokens == 150
    assert proc.wait(timeout=30) == 0
