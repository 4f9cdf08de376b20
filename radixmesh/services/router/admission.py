"""Admission control in front of the router's request path, with SGLang router's flags: at most
--max-concurrent-requests requests run at once (-1: no limit); up to --queue-size more wait, first come first
served, for at most --queue-timeout-secs (then 408); a request that finds the queue full gets 429 at once. Per API
key (the client address when none is presented), --rate-limit-tokens-per-second refills a token bucket of
--rate-limit-burst tokens; a request that finds its bucket empty gets 429 with Retry-After. Probes, metrics and admin
endpoints are never limited."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import math
import time
from dataclasses import dataclass

from radixmesh.services.router.errors import RouterError


class Overloaded(RouterError):
    """429 or 408 with the seconds after which a retry may succeed (Retry-After)."""

    def __init__(self, status: int, message: str, retry_after_s: float):
        super().__init__(status, message)
        self.retry_after_s = retry_after_s


class ConcurrencyLimiter:
    def __init__(self, max_concurrent: int, queue_size: int, queue_timeout_s: float):
        self.max_concurrent = max_concurrent
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        self.running = 0
        self.rejected = 0  # queue full
        self.timed_out = 0  # waited past the queue timeout
        self._waiting: collections.deque[asyncio.Future] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    async def acquire(self) -> None:
        if self.max_concurrent < 0 or (self.running < self.max_concurrent and not self._waiting):
            self.running += 1
            return
        if len(self._waiting) >= self.queue_size:
            self.rejected += 1
            raise Overloaded(429, f"too many requests: {self.running} running and {len(self._waiting)} queued "
                                  f"(--max-concurrent-requests {self.max_concurrent}, --queue-size "
                                  f"{self.queue_size}); retry later", 1.0)
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await asyncio.wait_for(asyncio.shield(turn), self.queue_timeout_s)
        except asyncio.TimeoutError:
            self._leave(turn)
            self.timed_out += 1
            raise Overloaded(408, f"the request waited {self.queue_timeout_s:g} s in the router's queue "
                                  "(--queue-timeout-secs) without a free slot", 1.0) from None
        except BaseException:
            self._leave(turn)
            raise

    def _leave(self, turn: asyncio.Future) -> None:
        """A waiter gives up: out of the queue, or, if its turn came meanwhile, the slot goes to the next."""
        if turn.done() and not turn.cancelled():
            self.release()
        else:
            turn.cancel()
            try:
                self._waiting.remove(turn)
            except ValueError:
                pass

    def release(self) -> None:
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot passes on: `running` stays the same
                return
        self.running -= 1


class RateLimiter:
    """Token buckets per client key; `rate` tokens per second up to `burst`."""

    def __init__(self, rate: float, burst: float, max_keys: int = 100_000, clock=time.monotonic):
        self.rate = rate
        self.burst = max(burst, 1.0)
        self.max_keys = max_keys
        self.clock = clock
        self.limited = 0
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()

    def check(self, key: str) -> None:
        """Take one token for `key` or raise Overloaded(429) saying when the next one is due."""
        now = self.clock()
        tokens, last = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            self.limited += 1
            wait = (1.0 - tokens) / self.rate
            raise Overloaded(429, f"rate limit exceeded for this API key ({self.rate:g} requests/s, burst "
                                  f"{self.burst:g}); retry in {wait:.2f} s", wait)
        self._buckets[key] = (tokens - 1.0, now)
        if len(self._buckets) > self.max_keys:  # forget the least recently seen client
            self._buckets.popitem(last=False)


def client_key(authorization: str | None, peer: str | None) -> str:
    """The rate limit's key: a digest of the presented API key (never the key itself), else the client address."""
    if authorization:
        return "key:" + hashlib.blake2b(authorization.encode(), digest_size=12).hexdigest()
    return "addr:" + (peer or "?")


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


@dataclass(frozen=True, slots=True)
class Admission:
    limiter: ConcurrencyLimiter | None = None
    rate: RateLimiter | None = None

    @classmethod
    def from_settings(cls, s) -> "Admission":
        """From RouterSettings: each part only when its flag turns it on."""
        limiter = None if s.max_concurrent_requests < 0 else ConcurrencyLimiter(
            s.max_concurrent_requests, s.queue_size, s.queue_timeout_secs)
        rate = None
        if s.rate_limit_tokens_per_second is not None:
            rate = RateLimiter(s.rate_limit_tokens_per_second,
                               s.rate_limit_burst or max(s.rate_limit_tokens_per_second, 1.0))
        return cls(limiter, rate)

    async def admit(self, key: str) -> None:
        """The rate limit for `key` (see client_key), then a slot; Overloaded when refused. Call done() after."""
        if self.rate is not None:
            self.rate.check(key)
        if self.limiter is not None:
            await self.limiter.acquire()

    def done(self) -> None:
        if self.limiter is not None:
            self.limiter.release()


def admission_middleware(admission: Admission, open_paths: frozenset[str]):
    """aiohttp middleware (after authentication): the rate limit, then a slot for the whole request, streamed
    responses included. Probes, scrapes (`open_paths`) and admin endpoints pass untouched."""
    from aiohttp import web

    from radixmesh.services.router.http_common import ADMIN_PATHS, error_response
    from radixmesh.services.router.openai_errors import from_status

    exempt = open_paths | ADMIN_PATHS

    @web.middleware
    async def admission_check(request: web.Request, handler):
        if request.path in exempt:
            return await handler(request)
        try:
            await admission.admit(client_key(request.headers.get("Authorization"), request.remote))
        except Overloaded as e:
            response = error_response(from_status(e.status, e.message))
            response.headers["Retry-After"] = retry_after_header(e.retry_after_s)
            return response
        try:
            return await handler(request)
        finally:
            admission.done()
    return admission_check
