"""The router's client of the tokenizer service (the router never loads a tokenizer itself). Its channel has no
interceptors: the calls pass the trace context themselves (services.common.trace_grpc). With
--tokenizer-cache-enable-l0 (SGLang router's flag) a repeated request (the same text, or the same chat messages,
tools and template options) is answered from an LRU of the last --tokenizer-cache-l0-max-entries results, without
a call. Requests go in batches over one TokenizeStream (services/router/tokenize_batch.py), each with its trace
context when tracing is on, unless the service lacks the method."""

from __future__ import annotations

import collections

import grpc

from radixmesh.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from radixmesh.services.common import tracing
from radixmesh.services.common.server import RECONNECT_OPTIONS, untraced_channel
from radixmesh.services.router.tokenize_batch import TokenizeBatcher, TokenizerUnavailable

__all__ = ["TokenizeCache", "TokenizerClient", "TokenizerUnavailable"]


class TokenizeCache:
    """Whole tokenize requests (their deterministic serialization) to their responses, least recently used out."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self.hits = self.misses = 0
        self._entries: collections.OrderedDict[bytes, tokenizer_pb2.TokenizeResponse] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> tokenizer_pb2.TokenizeResponse | None:
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return found

    def put(self, key: bytes, response: tokenizer_pb2.TokenizeResponse) -> None:
        self._entries[key] = response
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


class TokenizerClient:
    def __init__(self, url: str, timeout_s: float, cache_entries: int = 0, stream_lanes: bool = True):
        """`cache_entries` > 0: answer repeated tokenize requests from a cache of that many (responses are shared:
        callers read them, never change them); `stream_lanes`: TokenizeStream goes over the service's stream lane
        where it offers one."""
        self.url = url
        self.timeout_s = timeout_s
        self.cache = TokenizeCache(cache_entries) if cache_entries > 0 else None
        # reconnects within a second of a restarted tokenizer coming back (gRPC's default backoff grows to 2 min)
        self.channel = untraced_channel(url, RECONNECT_OPTIONS)
        self.stub = tokenizer_pb2_grpc.TokenizerServiceStub(self.channel)
        self.info: tokenizer_pb2.GetTokenizerInfoResponse | None = None
        self.batcher = TokenizeBatcher(self.stub, url, timeout_s, self.channel if stream_lanes else None)

    async def connect(self, wait_s: float) -> tokenizer_pb2.GetTokenizerInfoResponse:
        try:
            self.info = await self.stub.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest(), timeout=wait_s,
                                                         wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise TokenizerUnavailable(f"tokenizer {self.url}: {e.code().name} {e.details()}") from None
        return self.info

    async def ping(self, timeout_s: float) -> bool:
        """Whether the service answers GetTokenizerInfo within `timeout_s` (not waiting for a connection)."""
        try:
            await self.stub.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest(), timeout=timeout_s)
            return True
        except grpc.aio.AioRpcError:
            return False

    async def tokenize(self, request: tokenizer_pb2.TokenizeRequest, span=None) -> tokenizer_pb2.TokenizeResponse:
        """ValueError for input the tokenizer rejects (bad chat messages, a template error). `span`: the caller's
        span for the call, whose context goes with it (default: the current span)."""
        if self.cache is None:
            return await self._tokenize(request, span)
        key = request.SerializeToString(deterministic=True)
        found = self.cache.get(key)
        if found is None:
            found = await self._tokenize(request, span)
            self.cache.put(key, found)
        return found

    async def _tokenize(self, request: tokenizer_pb2.TokenizeRequest, span) -> tokenizer_pb2.TokenizeResponse:
        if span is None:
            span = tracing.current_span()
        if await self.batcher.open():
            if span is None or not tracing.put_context(request, span):
                return await self.batcher.submit(request)
            try:  # the context travels in the request, which is given back as it came (a retry's cache key)
                return await self.batcher.submit(request)
            finally:
                tracing.clear_context(request, span)
        try:
            return await self.stub.Tokenize(request, timeout=self.timeout_s, metadata=tracing.metadata_for(span))
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(e.details()) from None
            raise TokenizerUnavailable(f"tokenizer {self.url}: {e.code().name} {e.details()}") from None

    async def detokenize(self, ids: list[int], skip_special_tokens: bool | None = None) -> str:
        request = tokenizer_pb2.DetokenizeRequest(sequences=[tokenizer_pb2.TokenIds(ids=ids)],
                                                  skip_special_tokens=skip_special_tokens)
        try:
            return (await self.stub.Detokenize(request, timeout=self.timeout_s,
                                             metadata=tracing.current_metadata())).texts[0]
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(e.details()) from None
            raise TokenizerUnavailable(f"tokenizer {self.url}: {e.code().name} {e.details()}") from None

    async def close(self) -> None:
        await self.batcher.close()
        await self.channel.close(grace=None)
