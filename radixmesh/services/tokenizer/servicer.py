"""radixmesh.v1.TokenizerService over a TokenizerBackend. Errors are ValueErrors, which the shared interceptor turns
into INVALID_ARGUMENT with the message; the service keeps serving. With metrics on, each call is counted and timed
(services.tokenizer.metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from radixmesh.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from radixmesh.services.common import tracing
from radixmesh.services.common.chat_render import chat_from_proto
from radixmesh.services.tokenizer import convert
from radixmesh.services.tokenizer.backend import TokenizerBackend
from radixmesh.services.tokenizer.metrics import TokenizerMetrics

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"].full_name
log = logging.getLogger(__name__)
_INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
TOKENIZE = f"{SERVICE_NAME}/Tokenize"
SPAN_ATTRIBUTES = {"rpc.system": "grpc", "rpc.service": SERVICE_NAME, "rpc.method": "Tokenize"}


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    def __init__(self, backend: TokenizerBackend, metrics: TokenizerMetrics | None = None):
        self.backend = backend
        self.metrics = metrics
        self.draining: asyncio.Event | None = None  # GrpcService.draining: TokenizeStream ends when it is set

    def _observe(self, method: str):
        return self.metrics.call(method) if self.metrics is not None else contextlib.nullcontext()

    def _tokenize_one(self, request: tokenizer_pb2.TokenizeRequest):
        """On a pool thread: the Tokenized of one request; ValueError for input the tokenizer rejects."""
        kind = request.WhichOneof("input")
        if kind == "text":
            return self.backend.tokenize_text(request.text,
                                              convert.optional_bool(request, "add_special_tokens", True))
        if kind == "chat":
            return self.backend.tokenize_chat(chat_from_proto(request.chat))
        raise ValueError("TokenizeRequest needs `text` or `chat`")

    async def Tokenize(self, request: tokenizer_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> tokenizer_pb2.TokenizeResponse:
        method = f"tokenize_{request.WhichOneof('input') or 'none'}"
        with self._observe(method):
            out = await self.backend.run(self._tokenize_one, request)
        if self.metrics is not None:
            self.metrics.counted(method, len(out.input_ids))
        return convert.tokenized_to_proto(out)

    def _tokenize_batch(self, requests) -> list[tokenizer_pb2.TokenizeResult]:
        """On one pool thread: every request of a stream message, each result or error on its own; a request with
        a trace context gets the server span a traced Tokenize call gets."""
        results = []
        for request in requests:
            method = f"tokenize_{request.WhichOneof('input') or 'none'}"
            carried = tracing.carried_context(request)
            span = contextlib.nullcontext() if carried is None else tracing.root_span(TOKENIZE, carried,
                                                                                      **SPAN_ATTRIBUTES)
            try:
                with span, self._observe(method):
                    out = self._tokenize_one(request)
            except ValueError as e:
                results.append(tokenizer_pb2.TokenizeResult(error=tokenizer_pb2.TokenizeError(code=_INVALID,
                                                                                              message=str(e))))
                continue
            except Exception as e:  # noqa: BLE001 - one request's failure, not the stream's
                log.exception("tokenize failed")
                results.append(tokenizer_pb2.TokenizeResult(error=tokenizer_pb2.TokenizeError(
                    code=_INTERNAL, message=str(e) or type(e).__name__)))
                continue
            if self.metrics is not None:
                self.metrics.counted(method, len(out.input_ids))
            results.append(tokenizer_pb2.TokenizeResult(response=convert.tokenized_to_proto(out)))
        return results

    async def TokenizeStream(self, requests, context: grpc.aio.ServicerContext):
        """Batches of Tokenize requests: each message's requests run together on one pool thread (one hand-off
        for all of them), and its answer goes back under its id as soon as it is done."""
        done: asyncio.Queue = asyncio.Queue()
        running: set[asyncio.Task] = set()

        async def one(msg: tokenizer_pb2.TokenizeStreamRequest) -> None:
            try:
                results = await self.backend.run(self._tokenize_batch, list(msg.requests)) if msg.requests else []
            except Exception as e:  # noqa: BLE001 - the pool is gone (shutting down): every request fails
                error = tokenizer_pb2.TokenizeError(code=grpc.StatusCode.UNAVAILABLE.value[0], message=str(e))
                results = [tokenizer_pb2.TokenizeResult(error=error) for _ in msg.requests]
            await done.put(tokenizer_pb2.TokenizeStreamResponse(id=msg.id, results=results))

        async def read() -> None:
            async for msg in requests:
                task = asyncio.create_task(one(msg))
                running.add(task)
                task.add_done_callback(running.discard)
            await finish()

        async def finish() -> None:  # the batches that came in are answered, then the stream ends
            while running:
                await asyncio.wait(set(running))
            await done.put(None)

        async def drain() -> None:  # the service is stopping: no new batches; the client opens another stream
            await self.draining.wait()
            reader.cancel()
            await finish()

        reader = asyncio.create_task(read())
        drainer = asyncio.create_task(drain()) if self.draining is not None else None
        try:
            while (answer := await done.get()) is not None:
                yield answer
        finally:
            reader.cancel()
            if drainer is not None:
                drainer.cancel()
            for task in list(running):
                task.cancel()

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
