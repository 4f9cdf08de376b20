"""Several tokenizer service replicas behind one router (`--tokenizer-url h1:p1,h2:p2`; `radixmesh serve
--num-tokenizers N`): each call goes to the replica with the fewest calls open (in turn among equals), skipping one
that is down; a call whose replica is unreachable (or did not answer in time) is tried on the next, so while a
replica is down or restarting the others answer and no request notices. A replica that failed gets no calls until
it answers a probe (GetTokenizerInfo, every PROBE_S); a hung one (SIGSTOPped, stuck) costs the calls that were
waiting on it one timeout, then nothing. Only when every replica fails does the call fail (TokenizerUnavailable: the
router answers 503 at once). One replica is the plain case."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, TypeVar

from radixmesh.v1 import tokenizer_pb2
from radixmesh.services.router.tokenizer_client import TokenizeCache, TokenizerClient, TokenizerUnavailable

log = logging.getLogger(__name__)

PROBE_S = 0.5
T = TypeVar("T")


def tokenizer_urls(value: str) -> list[str]:
    """The replicas of a --tokenizer-url value (comma-separated host:port)."""
    return [u.strip() for u in value.split(",") if u.strip()]


class TokenizerPool:
    def __init__(self, urls: list[str], timeout_s: float, cache_entries: int = 0, stream_lanes: bool = True):
        """`cache_entries` > 0: repeated tokenize requests are answered from one cache for all replicas;
        `stream_lanes`: TokenizeStream over the replicas' stream lanes where they offer them."""
        if not urls:
            raise ValueError("no tokenizer URL")
        self.clients = [TokenizerClient(u, timeout_s, stream_lanes=stream_lanes) for u in urls]
        self.url = ",".join(urls)
        self.cache = TokenizeCache(cache_entries) if cache_entries > 0 else None
        self.info: tokenizer_pb2.GetTokenizerInfoResponse | None = None
        self._open = [0] * len(urls)
        self._down = [False] * len(urls)  # failed, not answered a probe since
        self._probes: dict[int, asyncio.Task] = {}
        self._turn = 0

    async def connect(self, wait_s: float) -> tokenizer_pb2.GetTokenizerInfoResponse:
        """Ready when one replica answers (the others may still be starting); TokenizerUnavailable when none does."""
        results = await asyncio.gather(*(c.connect(wait_s) for c in self.clients), return_exceptions=True)
        for client, result in zip(self.clients, results):
            if isinstance(result, BaseException):
                log.warning("%s", result)
            elif self.info is None:
                self.info = result
        if self.info is None:
            raise next(r for r in results if isinstance(r, BaseException))
        return self.info

    def _pick(self, tried: set[int]) -> int:
        left = [i for i in range(len(self.clients)) if i not in tried]
        up = [i for i in left if not self._down[i]] or left
        self._turn += 1
        return min(up, key=lambda i: (self._open[i], (i - self._turn) % len(self.clients)))

    async def _call(self, fn: Callable[[TokenizerClient], Awaitable[T]]) -> T:
        tried: set[int] = set()
        while True:
            i = self._pick(tried)
            tried.add(i)
            self._open[i] += 1
            try:
                return await fn(self.clients[i])
            except TokenizerUnavailable as e:
                self._mark_down(i)
                if len(tried) == len(self.clients):
                    raise
                log.warning("%s; trying another tokenizer", e)
            finally:
                self._open[i] -= 1

    def _mark_down(self, i: int) -> None:
        self._down[i] = True
        if len(self.clients) > 1 and i not in self._probes:
            self._probes[i] = asyncio.create_task(self._probe(i))

    async def _probe(self, i: int) -> None:
        try:
            while not await self.clients[i].ping(PROBE_S * 2):
                await asyncio.sleep(PROBE_S)
            self._down[i] = False
            log.info("tokenizer %s answers again", self.clients[i].url)
        finally:
            self._probes.pop(i, None)

    async def tokenize(self, request: tokenizer_pb2.TokenizeRequest, span=None) -> tokenizer_pb2.TokenizeResponse:
        """ValueError for input the tokenizer rejects (bad chat messages, a template error). `span`: the caller's
        span for the call (default: the current span)."""
        if self.cache is None:
            return await self._call(lambda c: c.tokenize(request, span))
        key = request.SerializeToString(deterministic=True)
        found = self.cache.get(key)
        if found is None:
            found = await self._call(lambda c: c.tokenize(request, span))
            self.cache.put(key, found)
        return found

    async def detokenize(self, ids: list[int], skip_special_tokens: bool | None = None) -> str:
        return await self._call(lambda c: c.detokenize(ids, skip_special_tokens))

    async def close(self) -> None:
        for task in list(self._probes.values()):
            task.cancel()
        for c in self.clients:
            await c.close()
