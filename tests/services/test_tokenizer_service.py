"""The tokenizer service as real OS processes on loopback, checked against the transformers tokenizer of the same
model: Tokenize (text and chat), Detokenize, GetTokenizerInfo, --chat-template overrides, bad input, SIGTERM."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoTokenizer

from radixmesh.v1 import tokenizer_pb2 as pb
from radixmesh.v1 import tokenizer_pb2_grpc
from radixmesh.services.tokenizer.__main__ import main as tokenizer_main
from radixmesh.services.common.chat_templates import CHATML
from tests.conftest import ROOT, model_path
from radixmesh.services.common.ports import free_port

MODEL = model_path("tiny-llama")
SERVICE = "radixmesh.v1.TokenizerService"
# A --chat-template file: a custom variable (greeting) and a role the template refuses.
FILE_TEMPLATE = (
    "{% if greeting %}{{ greeting }}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'forbidden' %}{{ raise_exception('role forbidden is not allowed') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, café 中文?"},
        {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "What is 2+2?"}]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path

    @functools.cached_property
    def channel(self) -> grpc.Channel:
        # reconnect quickly while the process starts (the default backoff grows to seconds)
        return grpc.insecure_channel(f"127.0.0.1:{self.port}", options=[("grpc.initial_reconnect_backoff_ms", 50),
                                                                         ("grpc.min_reconnect_backoff_ms", 50),
                                                                         ("grpc.max_reconnect_backoff_ms", 100)])

    def stub(self) -> tokenizer_pb2_grpc.TokenizerServiceStub:
        return tokenizer_pb2_grpc.TokenizerServiceStub(self.channel)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _start(name: str, tmp: Path, *flags: str) -> Server:
    port = free_port()
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "radixmesh.services.tokenizer", "--model-path", MODEL,
                                 "--port", str(port), *flags], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    return Server(proc, port, log)


def _wait_serving(server: Server, timeout_s: float = 60.0) -> None:
    health = health_pb2_grpc.HealthStub(server.channel)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, f"tokenizer exited with {server.proc.returncode}:\n{server.output()}"
        try:
            status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=1).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"tokenizer not SERVING after {timeout_s} s:\n{server.output()}")


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """Three services started at once: the model's template, a template file, and the built-in chatml."""
    tmp = tmp_path_factory.mktemp("tokenizer")
    template_file = tmp / "template.jinja"
    template_file.write_text(FILE_TEMPLATE)
    servers = {"model": _start("model", tmp), "file": _start("file", tmp, "--chat-template", str(template_file)),
               "chatml": _start("chatml", tmp, "--chat-template", "chatml")}
    yield servers
    for server in servers.values():
        if server.proc.poll() is None:
            server.proc.kill()
        server.proc.wait(timeout=10)
        server.channel.close()


@pytest.fixture(scope="module")
def ref(started):
    """The reference tokenizer, loaded while the services start."""
    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def servers(started, ref):
    for server in started.values():
        _wait_serving(server)
    return started


def _messages(chat: list[dict]) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=m["role"], content=m["content"],
                           tool_calls_json=json.dumps(m["tool_calls"]) if "tool_calls" in m else "") for m in chat]


def _chat(server: Server, chat: list[dict], **fields) -> pb.TokenizeResponse:
    return server.stub().Tokenize(pb.TokenizeRequest(chat=pb.ChatInput(messages=_messages(chat), **fields)))


def test_tokenize_text_matches_transformers(servers, ref):
    stub = servers["model"].stub()
    for text in ["Hello world", "café naïve 中文 😀 <|eot_id|> tail", "", "  spaces\n\nand lines"]:
        out = stub.Tokenize(pb.TokenizeRequest(text=text))
        assert list(out.input_ids) == ref(text).input_ids and out.prompt == text
        bare = stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=False))
        assert list(bare.input_ids) == ref(text, add_special_tokens=False).input_ids
    assert list(stub.Tokenize(pb.TokenizeRequest(text="hi")).input_ids)[0] == ref.bos_token_id


def test_tokenize_chat_matches_apply_chat_template(servers, ref):
    out = _chat(servers["model"], CHAT)
    assert out.prompt == ref.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert list(out.input_ids) == ref.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
    assert out.prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert list(out.input_ids).count(ref.bos_token_id) == 1  # the template's BOS, not a second one


def test_add_generation_prompt_false_and_continue_final_message(servers, ref):
    closed = _chat(servers["model"], CHAT, add_generation_prompt=False)
    assert closed.prompt == ref.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=False)
    assert closed.prompt.endswith("What is 2+2?<|eot_id|>")

    partial = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    cont = _chat(servers["model"], partial, continue_final_message=True)
    assert cont.prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\nThe answer is")
    assert list(cont.input_ids) == ref.apply_chat_template(partial, continue_final_message=True)["input_ids"]


def test_template_file_override_with_kwargs(servers, ref):
    server = servers["file"]
    out = _chat(server, CHAT[:2], chat_template_kwargs_json=json.dumps({"greeting": "hey"}))
    assert out.prompt == "hey\n[system] Be brief.\n[user] Hello, café 中文?\n[assistant] "
    assert list(out.input_ids) == ref(out.prompt, add_special_tokens=False).input_ids
    info = server.stub().GetTokenizerInfo(pb.GetTokenizerInfoRequest())
    assert info.chat_template == FILE_TEMPLATE


def test_builtin_chatml_override_with_tools_and_tool_calls(servers, ref):
    server = servers["chatml"]
    out = _chat(server, [{"role": "user", "content": "hi"}])
    assert out.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert list(out.input_ids) == ref.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=CHATML,
                                                          add_generation_prompt=True)["input_ids"]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chat = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    with_tools = _chat(server, chat, tools_json=json.dumps([tool]), add_generation_prompt=False)
    assert with_tools.prompt.startswith("<|im_start|>system\n") and '"name": "get_weather"' in with_tools.prompt
    # OpenAI's JSON-text arguments reach the template as an object
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in with_tools.prompt
    info = server.stub().GetTokenizerInfo(pb.GetTokenizerInfoRequest())
    assert info.chat_template == CHATML


def test_detokenize_batch_matches_decode(servers, ref):
    sequences = [ref("café 中文 😀 <|eot_id|> done").input_ids, ref("Hello world").input_ids, []]
    stub = servers["model"].stub()
    request = pb.DetokenizeRequest(sequences=[pb.TokenIds(ids=s) for s in sequences])
    assert list(stub.Detokenize(request).texts) == [ref.decode(s, skip_special_tokens=True) for s in sequences]
    request.skip_special_tokens = False
    kept = list(stub.Detokenize(request).texts)
    assert kept == [ref.decode(s, skip_special_tokens=False) for s in sequences]
    assert kept[0].startswith("<|begin_of_text|>")


def test_get_tokenizer_info(servers, ref):
    info = servers["model"].stub().GetTokenizerInfo(pb.GetTokenizerInfoRequest())
    assert info.vocab_size == len(ref) == 1000
    assert list(info.eos_token_ids) == [7] and info.context_length == 1024
    assert info.tokenizer_path == MODEL and info.chat_template == ref.chat_template
    named = {t.name: (t.content, t.id) for t in info.special_tokens if t.name != "additional_special_token"}
    assert named == {"bos_token": ("<|begin_of_text|>", 3), "eos_token": ("<|eot_id|>", 7),
                     "pad_token": ("<|end_of_text|>", 4)}
    extra = {t.content: t.id for t in info.special_tokens if t.name == "additional_special_token"}
    assert extra["<|start_header_id|>"] == 5 and extra["<|im_start|>"] == 1 and len(info.special_tokens) == 8


def _code_and_message(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_bad_input_is_invalid_argument_and_service_keeps_serving(servers):
    stub = servers["model"].stub()
    user = [pb.ChatMessage(role="user", content="hi")]
    cases = {
        "messages is empty": pb.TokenizeRequest(chat=pb.ChatInput()),
        "tools_json is not valid JSON": pb.TokenizeRequest(chat=pb.ChatInput(messages=user, tools_json="[{oops")),
        "tools_json must be a list": pb.TokenizeRequest(chat=pb.ChatInput(messages=user, tools_json='{"a": 1}')),
        "messages[0].tool_calls_json is not valid JSON": pb.TokenizeRequest(chat=pb.ChatInput(
            messages=[pb.ChatMessage(role="assistant", tool_calls_json="{")])),
        "chat_template_kwargs_json must be an object": pb.TokenizeRequest(chat=pb.ChatInput(
            messages=user, chat_template_kwargs_json="[1]")),
        "may not set tokenize": pb.TokenizeRequest(chat=pb.ChatInput(
            messages=user, chat_template_kwargs_json='{"tokenize": true}')),
        "cannot both be true": pb.TokenizeRequest(chat=pb.ChatInput(
            messages=user, continue_final_message=True, add_generation_prompt=True)),
        "needs `text` or `chat`": pb.TokenizeRequest(),
    }
    for expected, request in cases.items():
        code, message = _code_and_message(lambda: stub.Tokenize(request))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and expected in message, (expected, message)
    code, message = _code_and_message(lambda: stub.Detokenize(pb.DetokenizeRequest(
        sequences=[pb.TokenIds(ids=[3]), pb.TokenIds(ids=[5, 1000])])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "sequences[1]: token id 1000" in message
    raising = pb.TokenizeRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="forbidden", content="x")]))
    code, message = _code_and_message(lambda: servers["file"].stub().Tokenize(raising))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "role forbidden is not allowed" in message
    assert list(stub.Tokenize(pb.TokenizeRequest(text="still here", add_special_tokens=False)).input_ids)
    assert all(s.proc.poll() is None for s in servers.values())


def test_missing_model_path_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        tokenizer_main([])
    assert exit_.value.code == 2 and "--model-path is required" in capsys.readouterr().err


def test_sigterm_exits_zero(servers):
    """Last on purpose: it stops the chatml service."""
    proc = servers["chatml"].proc
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert "stopped" in servers["chatml"].output()
