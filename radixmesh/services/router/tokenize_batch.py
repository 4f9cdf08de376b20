"""The router's Tokenize requests in batches over one TokenizerService.TokenizeStream: the requests made in the same
turn of the event loop (the requests that arrived together) go as one message, whose answer carries each result.
A request costs the router a share of one stream message instead of a unary call of its own (a completion queue
operation and a wake-up by gRPC's I/O thread each), and the tokenizer service one pool hand-off per batch.

`submit(request)` returns the response, raises ValueError for input the tokenizer rejects and TokenizerUnavailable
when the service cannot answer: the stream broke (the next request opens another), or no answer within the
timeout (the stream is then closed: what else waited on it fails at once, not each at its own timeout). A service
without TokenizeStream (UNIMPLEMENTED at the handshake) makes `open()` return False: the client goes back to a call
per request."""

from __future__ import annotations

import asyncio
import functools
import itertools

import grpc

from radixmesh.v1 import tokenizer_pb2
from radixmesh.services.common import stream_lane
from radixmesh.services.router.stream_link import StreamLink

_INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


class TokenizerUnavailable(Exception):
    pass


class TokenizeBatcher:
    def __init__(self, stub, url: str, timeout_s: float, lane_channel=None):
        """`lane_channel`: the service's channel, to open a stream lane over (services.common.stream_lane); None:
        gRPC only."""
        self.url, self.timeout_s = url, timeout_s
        lane = None if lane_channel is None else functools.partial(
            stream_lane.open_lane, lane_channel, url, "TokenizeStream", tokenizer_pb2.TokenizeStreamResponse,
            timeout_s)
        self.link = StreamLink(url, "TokenizeStream", stub.TokenizeStream, tokenizer_pb2.TokenizeStreamRequest(),
                               timeout_s, lambda why: TokenizerUnavailable(f"tokenizer {url}: {why}"), self._read,
                               lane)
        self._ids = itertools.count(1)
        self._batch: list[tuple[tokenizer_pb2.TokenizeRequest, asyncio.Future]] = []
        self._flush: asyncio.Handle | None = None
        self._waiting: dict[int, tuple[list[asyncio.Future], asyncio.TimerHandle]] = {}
        self.batches = self.requests = 0  # for tests
        self._broken: str | None = None  # why this side closed a hung stream

    @property
    def supported(self) -> bool | None:
        return self.link.supported

    async def open(self) -> bool:
        """True when the stream is up (opened now if needed); False when this request goes as a call of its own (the
        service has no TokenizeStream, or its handshake just failed: stream_link.StreamLink). TokenizerUnavailable
        when the handshake timed out."""
        return await self.link.open()

    def submit(self, request: tokenizer_pb2.TokenizeRequest) -> asyncio.Future:
        """The response's future (open() first); requests submitted in one turn of the loop share a message."""
        fut = asyncio.get_running_loop().create_future()
        self._batch.append((request, fut))
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self._send_batch)
        return fut

    def _send_batch(self) -> None:
        self._flush = None
        batch, self._batch = self._batch, []
        futures = [f for _, f in batch]
        batch_id = next(self._ids)
        if not self.link.send(tokenizer_pb2.TokenizeStreamRequest(id=batch_id, requests=[r for r, _ in batch])):
            _fail(futures, TokenizerUnavailable(f"tokenizer {self.url}: the TokenizeStream broke"))
            return
        timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, batch_id)
        self._waiting[batch_id] = (futures, timer)
        self.batches += 1
        self.requests += len(batch)

    def _expire(self, batch_id: int) -> None:
        futures, _ = self._waiting.pop(batch_id, ([], None))
        why = f"no answer in {self.timeout_s:.0f} s"
        _fail(futures, TokenizerUnavailable(f"tokenizer {self.url}: {why}"))
        # The stream hangs (the service is stopped or stuck): the batches sent after this one will not be answered
        # either. Closing it fails them now, so their callers can go to another replica, and the next request opens
        # a new stream.
        if self.link.call is not None:
            self._broken = why
            self.link.call.cancel()

    async def _read(self, call) -> None:
        reason = "the tokenizer ended TokenizeStream"
        try:
            while (answer := await call.read()) is not grpc.aio.EOF:
                futures, timer = self._waiting.pop(answer.id, (None, None))
                if futures is None:
                    continue  # expired
                timer.cancel()
                for fut, result in zip(futures, answer.results):
                    if fut.done():
                        continue  # its caller gave up
                    if result.HasField("response"):
                        fut.set_result(result.response)
                    elif result.error.code == _INVALID:
                        fut.set_exception(ValueError(result.error.message))
                    else:
                        fut.set_exception(TokenizerUnavailable(f"tokenizer {self.url}: {result.error.message}"))
        except grpc.aio.AioRpcError as e:
            reason = f"{e.code().name} {e.details()}"
        except asyncio.CancelledError:
            reason = self._broken or "closed"
            raise
        finally:
            self._broken = None
            self.link.ended(call)
            waiting, self._waiting = self._waiting, {}
            for futures, timer in waiting.values():
                timer.cancel()
                _fail(futures, TokenizerUnavailable(f"tokenizer {self.url}: TokenizeStream: {reason}"))

    async def close(self) -> None:
        await self.link.close()


def _fail(futures: list[asyncio.Future], error: Exception) -> None:
    for fut in futures:
        if not fut.done():
            fut.set_exception(error)
