"""How the router rides out failing workers, with SGLang router's knobs: retries before the first byte with
exponential backoff and jitter (--retry-max-retries, --retry-initial-backoff-ms, --retry-max-backoff-ms,
--retry-backoff-multiplier, --retry-jitter-factor, --disable-retries), and a circuit breaker per worker
(--cb-failure-threshold failures within --cb-window-duration-secs open it: the worker gets no requests for
--cb-timeout-duration-secs; then one trial request at a time is let through (half-open), and --cb-success-threshold
successes in a row close it again, while one failure opens it anew; --disable-circuit-breaker)."""

from __future__ import annotations

import collections
import random
import time
from dataclasses import dataclass

_RNG = random.Random()
CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_VALUES = {CLOSED: 0, OPEN: 1, HALF_OPEN: 2}  # the gauge's encoding, as SGLang's router exports it


@dataclass(frozen=True, slots=True)
class Backoff:
    initial_ms: float = 50.0
    max_ms: float = 30_000.0
    multiplier: float = 1.5
    jitter: float = 0.2

    def delay_s(self, retry: int, rng: random.Random = _RNG) -> float:
        """Seconds to wait before retry number `retry` (1 = the first retry): initial * multiplier^(retry-1), capped
        at max, then spread by +-jitter so that many clients retrying together do not arrive together."""
        base = min(self.max_ms, self.initial_ms * self.multiplier ** max(retry - 1, 0))
        return max(0.0, base * (1.0 + self.jitter * (2.0 * rng.random() - 1.0))) / 1000.0


class CircuitBreaker:
    """One worker's breaker. `allow()` before sending it a request (False: pick another worker), then exactly one
    of `success()` / `failure(sent)` for every request allow() let through, or `release()` when the request ended
    without saying anything about the worker (the client went away)."""

    def __init__(self, failure_threshold: int = 10, success_threshold: int = 3, timeout_s: float = 60.0,
                 window_s: float = 120.0, enabled: bool = True, clock=time.monotonic):
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.timeout_s = timeout_s
        self.window_s = window_s
        self.enabled = enabled
        self.clock = clock
        self.state = CLOSED
        self.transitions = 0
        self._failures: collections.deque[float] = collections.deque()  # times of recent failures (closed)
        self._opened_at = 0.0
        self._successes = 0  # in a row, while half-open
        self._trial = False  # a half-open trial request is in flight
        self._counted_at = float("-inf")  # when the last failure was counted

    def _move(self, state: str) -> None:
        self.state = state
        self.transitions += 1

    def available(self) -> bool:
        """Whether a request could be sent now (no side effect: policies look before they pick)."""
        if not self.enabled or self.state == CLOSED:
            return True
        if self.state == OPEN:
            return self.clock() - self._opened_at >= self.timeout_s
        return not self._trial

    def allow(self) -> bool:
        """Take the permission to send one request (moves an expired open breaker to half-open)."""
        if not self.available():
            return False
        if self.enabled and self.state == OPEN:
            self._move(HALF_OPEN)
            self._successes = 0
        if self.state == HALF_OPEN:
            self._trial = True
        return True

    def success(self) -> None:
        if self.state == HALF_OPEN:
            self._trial = False
            self._successes += 1
            if self._successes >= self.success_threshold:
                self._failures.clear()
                self._move(CLOSED)

    def failure(self, sent: float | None = None) -> None:
        """`sent`: when the failed request was sent (this breaker's clock). A request sent before the last counted
        failure was in flight when it happened and most likely failed of the same cause (a dead worker fails all
        its open requests at once): one fault, counted once, so a crash under load does not open the breaker."""
        if not self.enabled or (sent is not None and sent < self._counted_at):
            return
        now = self._counted_at = self.clock()
        if self.state == HALF_OPEN:
            self._trial = False
            self._open(now)
            return
        self._failures.append(now)
        while self._failures and now - self._failures[0] > self.window_s:
            self._failures.popleft()
        if self.state == CLOSED and len(self._failures) >= self.failure_threshold:
            self._open(now)

    def release(self) -> None:
        if self.state == HALF_OPEN:
            self._trial = False

    def _open(self, now: float) -> None:
        self._opened_at = now
        self._failures.clear()
        self._move(OPEN)


def check_settings(s) -> None:
    """ValueError naming the flag for a resilience or admission setting out of range (RouterSettings calls it)."""
    checks = [
        ("--retry-max-retries", s.retry_max_retries >= 1, "at least 1 (1: no retry)"),
        ("--retry-initial-backoff-ms", s.retry_initial_backoff_ms > 0, "> 0"),
        ("--retry-max-backoff-ms", s.retry_max_backoff_ms >= s.retry_initial_backoff_ms,
         ">= --retry-initial-backoff-ms"),
        ("--retry-backoff-multiplier", s.retry_backoff_multiplier >= 1, ">= 1"),
        ("--retry-jitter-factor", 0 <= s.retry_jitter_factor <= 1, "between 0 and 1"),
        ("--cb-failure-threshold", s.cb_failure_threshold >= 1, "at least 1"),
        ("--cb-success-threshold", s.cb_success_threshold >= 1, "at least 1"),
        ("--cb-timeout-duration-secs", s.cb_timeout_duration_secs > 0, "> 0"),
        ("--cb-window-duration-secs", s.cb_window_duration_secs > 0, "> 0"),
        ("--health-failure-threshold", s.health_failure_threshold >= 1, "at least 1"),
        ("--health-success-threshold", s.health_success_threshold >= 1, "at least 1"),
        ("--health-check-timeout-secs", s.health_check_timeout_secs > 0, "> 0"),
        ("--health-check-interval-s", s.health_check_interval_s > 0, "> 0"),
        ("--max-concurrent-requests", s.max_concurrent_requests == -1 or s.max_concurrent_requests >= 1,
         "-1 (no limit) or at least 1"),
        ("--queue-size", s.queue_size >= 0, ">= 0"),
        ("--queue-timeout-secs", s.queue_timeout_secs > 0, "> 0"),
        ("--rate-limit-tokens-per-second", s.rate_limit_tokens_per_second is None
         or s.rate_limit_tokens_per_second > 0, "> 0"),
        ("--rate-limit-burst", s.rate_limit_burst is None or s.rate_limit_burst >= 1, "at least 1"),
    ]
    for flag, ok, rule in checks:
        if not ok:
            raise ValueError(f"{flag} must be {rule}")


def attempts_of(settings) -> int:
    """Attempts per request (the first included) from RouterSettings."""
    return 1 if settings.disable_retries else settings.retry_max_retries


def backoff_of(settings) -> Backoff:
    return Backoff(settings.retry_initial_backoff_ms, settings.retry_max_backoff_ms, settings.retry_backoff_multiplier,
                   settings.retry_jitter_factor)
