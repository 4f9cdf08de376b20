"""radixmesh.v1.TokenizerService over a TokenizerBackend. Errors are ValueErrors, which the shared interceptor turns
into INVALID_ARGUMENT with the message; the service keeps serving. With metrics on, each call is counted and timed
(services.tokenizer.metrics)."""

from __future__ import annotations

import contextlib

import grpc

from radixmesh.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer import convert
from services.tokenizer.backend import TokenizerBackend
from services.tokenizer.metrics import TokenizerMetrics

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"].full_name


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    def __init__(self, backend: TokenizerBackend, metrics: TokenizerMetrics | None = None):
        self.backend = backend
        self.metrics = metrics

    def _observe(self, method: str):
        return self.metrics.call(method) if self.metrics is not None else contextlib.nullcontext()

    async def Tokenize(self, request: tokenizer_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> tokenizer_pb2.TokenizeResponse:
        kind = request.WhichOneof("input")
        method = f"tokenize_{kind or 'none'}"
        with self._observe(method):
            if kind == "text":
                add_special = convert.optional_bool(request, "add_special_tokens", True)
                out = await self.backend.run(self.backend.tokenize_text, request.text, add_special)
            elif kind == "chat":
                out = await self.backend.run(self.backend.tokenize_chat, convert.chat_from_proto(request.chat))
            else:
                raise ValueError("TokenizeRequest needs `text` or `chat`")
        if self.metrics is not None:
            self.metrics.counted(method, len(out.input_ids))
        return convert.tokenized_to_proto(out)

    async def Detokenize(self, request: tokenizer_pb2.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> tokenizer_pb2.DetokenizeResponse:
        sequences = [list(s.ids) for s in request.sequences]
        with self._observe("detokenize"):
            texts = await self.backend.run(self.backend.detokenize, sequences,
                                           convert.optional_bool(request, "skip_special_tokens", True),
                                           convert.optional_bool(request, "spaces_between_special_tokens", True))
        if self.metrics is not None:
            self.metrics.counted("detokenize", sum(len(s) for s in sequences))
        return tokenizer_pb2.DetokenizeResponse(texts=texts)

    async def GetTokenizerInfo(self, request: tokenizer_pb2.GetTokenizerInfoRequest,
                               context: grpc.aio.ServicerContext) -> tokenizer_pb2.GetTokenizerInfoResponse:
        return convert.info_to_proto(self.backend.info)


def add_to_server(servicer: TokenizerServicer, server: grpc.aio.Server) -> list[str]:
    """Register `servicer` on `server`; returns the full service names (for health and reflection)."""
    tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(servicer, server)
    return [SERVICE_NAME]
