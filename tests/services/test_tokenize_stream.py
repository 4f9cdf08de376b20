"""TokenizerService.TokenizeStream (Tokenize requests in batches over one stream) and the router's batching client,
against the real tokenizer service process: results equal the unary Tokenize's, a rejected input fails alone with
INVALID_ARGUMENT (a ValueError in the router), concurrent requests share messages (over the service's stream lane
and over gRPC), a dead service is a bounded TokenizerUnavailable for every waiting request, and a service without
the method (or without lanes) is served a call per request."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from radixmesh.v1 import tokenizer_pb2 as pb
from radixmesh.v1 import tokenizer_pb2_grpc
from radixmesh.services.common.server import GrpcService, GrpcSettings
from radixmesh.services.launch import free_port
from radixmesh.services.router.tokenizer_client import TokenizerClient, TokenizerUnavailable
from tests.services.metrics_utils import start_grpc, stop
from tests.conftest import model_path

MODEL = model_path("tiny-llama")
CHAT = pb.ChatInput(messages=[pb.ChatMessage(role="system", content="Be brief."),
                              pb.ChatMessage(role="user", content="Hello, café 中文?")])
BAD = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hi", tool_calls_json="not json")])


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    proc, url = start_grpc("radixmesh.services.tokenizer", "--model-path", MODEL,
                           log=tmp_path_factory.mktemp("ts") / "tokenizer.log")
    yield proc, url
    stop(proc)


def requests() -> list[pb.TokenizeRequest]:
    return [pb.TokenizeRequest(text="The quick brown fox"), pb.TokenizeRequest(chat=CHAT),
            pb.TokenizeRequest(), pb.TokenizeRequest(text="no BOS here", add_special_tokens=False),
            pb.TokenizeRequest(chat=BAD)]


def test_stream_results_equal_unary_calls(tokenizer):
    _, url = tokenizer
    with grpc.insecure_channel(url) as ch:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(ch)
        expected = []
        for r in requests():
            try:
                expected.append(stub.Tokenize(r, timeout=10))
            except grpc.RpcError as e:
                expected.append((e.code().value[0], e.details()))
        answers = list(stub.TokenizeStream(iter([pb.TokenizeStreamRequest(),
                                                 pb.TokenizeStreamRequest(id=7, requests=requests())]), timeout=30))
    assert answers[0] == pb.TokenizeStreamResponse()  # the handshake
    assert answers[1].id == 7 and len(answers[1].results) == len(expected)
    for want, got in zip(expected, answers[1].results):
        if isinstance(want, tuple):
            assert (got.error.code, got.error.message) == want
            assert want[0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        else:
            assert got.response == want


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "grpc"])
def test_router_client_batches_and_fails_cleanly(tmp_path, lane):
    """Over the service's stream lane (the router's default) and over gRPC."""
    proc, url = start_grpc("radixmesh.services.tokenizer", "--model-path", MODEL, log=tmp_path / "tokenizer.log")

    async def run():
        client = TokenizerClient(url, timeout_s=10, stream_lanes=lane)
        await client.connect(30)
        texts = [f"prompt number {i} with some words" for i in range(40)]
        got = await asyncio.gather(*(client.tokenize(pb.TokenizeRequest(text=t)) for t in texts))
        assert client.batcher.supported and client.batcher.requests == 40 and client.batcher.batches < 10
        assert client.batcher.link.on_lane is lane
        one = await client.tokenize(pb.TokenizeRequest(text=texts[3]))
        assert list(one.input_ids) == list(got[3].input_ids) and one.prompt == texts[3]
        with pytest.raises(ValueError):
            await client.tokenize(pb.TokenizeRequest(chat=BAD))
        chat = await client.tokenize(pb.TokenizeRequest(chat=CHAT))
        assert chat.prompt.startswith("<|begin_of_text|>") or chat.input_ids
        # the service dies with requests waiting: every one fails with TokenizerUnavailable, none hangs
        stop(proc)
        outcomes = await asyncio.wait_for(asyncio.gather(
            *(client.tokenize(pb.TokenizeRequest(text=t)) for t in texts[:5]), return_exceptions=True), 30)
        assert all(isinstance(o, TokenizerUnavailable) for o in outcomes), outcomes
        await client.close()
    asyncio.run(run())


class _UnaryOnly(tokenizer_pb2_grpc.TokenizerServiceServicer):
    """A tokenizer service of an older release: Tokenize only (TokenizeStream is UNIMPLEMENTED)."""

    def __init__(self):
        self.calls = 0

    async def Tokenize(self, request, context):
        self.calls += 1
        return pb.TokenizeResponse(input_ids=[len(request.text)], prompt=request.text)

    async def GetTokenizerInfo(self, request, context):
        return pb.GetTokenizerInfoResponse()


def test_router_client_falls_back_to_unary_calls():
    async def run():
        servicer = _UnaryOnly()

        def register(server):
            tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(servicer, server)
            return ["radixmesh.v1.TokenizerService"]
        port = free_port()
        service = GrpcService(GrpcSettings("127.0.0.1", port, 1.0, "warning"), register)
        await service.start()
        try:
            client = TokenizerClient(f"127.0.0.1:{port}", timeout_s=10)
            await client.connect(10)
            got = await asyncio.gather(*(client.tokenize(pb.TokenizeRequest(text="x" * i)) for i in range(1, 6)))
            assert [list(r.input_ids) for r in got] == [[i] for i in range(1, 6)]
            assert client.batcher.supported is False and servicer.calls == 5
            await client.close()
        finally:
            await service.stop()
    asyncio.run(run())
