"""The router's client of the tokenizer service (the router never loads a tokenizer itself). Its channel has no
interceptors: the calls pass the trace context themselves (services.common.trace_grpc)."""

from __future__ import annotations

import grpc

from radixmesh.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.common import tracing
from services.common.trace_grpc import untraced_channel


class TokenizerUnavailable(Exception):
    pass


class TokenizerClient:
    def __init__(self, url: str, timeout_s: float):
        self.url = url
        self.timeout_s = timeout_s
        self.channel = untraced_channel(url)
        self.stub = tokenizer_pb2_grpc.TokenizerServiceStub(self.channel)
        self.info: tokenizer_pb2.GetTokenizerInfoResponse | None = None

    async def connect(self, wait_s: float) -> tokenizer_pb2.GetTokenizerInfoResponse:
        try:
            self.info = await self.stub.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest(), timeout=wait_s,
                                                         wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise TokenizerUnavailable(f"tokenizer {self.url}: {e.code().name} {e.details()}") from None
        return self.info

    async def tokenize(self, request: tokenizer_pb2.TokenizeRequest) -> tokenizer_pb2.TokenizeResponse:
        """ValueError for input the tokenizer rejects (bad chat messages, a template error)."""
        try:
            return await self.stub.Tokenize(request, timeout=self.timeout_s, metadata=tracing.current_metadata())
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(e.details()) from None
            raise TokenizerUnavailable(f"tokenizer {self.url}: {e.code().name} {e.details()}") from None

    async def detokenize(self, ids: list[int]) -> str:
        request = tokenizer_pb2.DetokenizeRequest(sequences=[tokenizer_pb2.TokenIds(ids=ids)])
        try:
            return (await self.stub.Detokenize(request, timeout=self.timeout_s,
                                             metadata=tracing.current_metadata())).texts[0]
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(e.details()) from None
            raise TokenizerUnavailable(f"tokenizer {self.url}: {e.code().name} {e.details()}") from None

    async def close(self) -> None:
        await self.channel.close(grace=None)
