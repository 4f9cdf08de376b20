"""The router's resilience and admission pieces on their own (the mesh tests trigger them for real): backoff
growth, cap and jitter; the circuit breaker's closed -> open -> half-open -> closed cycle with a clock the test
moves; the concurrency limiter's queue (FIFO hand-over, 429 when full, 408 after the timeout, a cancelled waiter
leaving no hole); per-key token buckets; the power_of_two and manual (sticky) policies; the flags' checks."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest

from radixmesh.services.router.admission import ConcurrencyLimiter, Overloaded, RateLimiter, client_key
from radixmesh.services.router.policies import Manual, PowerOfTwo, routing_key_var
from radixmesh.services.router.resilience import CLOSED, HALF_OPEN, OPEN, Backoff, CircuitBreaker
from radixmesh.services.router.settings import RouterSettings


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_backoff_grows_by_the_multiplier_up_to_the_cap_within_the_jitter():
    b = Backoff(initial_ms=50, max_ms=400, multiplier=2, jitter=0.2)
    rng = random.Random(7)
    for retry, base in ((1, 0.05), (2, 0.1), (3, 0.2), (4, 0.4), (9, 0.4)):
        delays = [b.delay_s(retry, rng) for _ in range(200)]
        assert base * 0.8 <= min(delays) and max(delays) <= base * 1.2
        assert max(delays) - min(delays) > base * 0.2  # really spread
    assert Backoff(jitter=0).delay_s(1) == 0.05


def test_the_breaker_opens_after_failures_in_the_window_and_closes_after_trial_successes():
    clock = Clock()
    cb = CircuitBreaker(failure_threshold=3, success_threshold=2, timeout_s=10, window_s=60, clock=clock)
    for _ in range(2):
        assert cb.allow()
        cb.failure()
    clock.now += 61  # the first two fall out of the window
    cb.allow()
    cb.failure()
    assert cb.state == CLOSED
    for _ in range(2):
        cb.allow()
        cb.failure()
    assert cb.state == OPEN and not cb.available() and not cb.allow()
    clock.now += 10
    assert cb.available() and cb.allow() and cb.state == HALF_OPEN
    assert not cb.available()  # one trial at a time
    cb.success()
    assert cb.state == HALF_OPEN and cb.allow()
    cb.success()
    assert cb.state == CLOSED and cb.available()


def test_a_failed_trial_opens_the_breaker_again_and_a_released_one_frees_the_trial():
    clock = Clock()
    cb = CircuitBreaker(failure_threshold=1, success_threshold=1, timeout_s=5, window_s=60, clock=clock)
    cb.allow()
    cb.failure()
    clock.now += 5
    assert cb.allow() and cb.state == HALF_OPEN
    cb.release()  # the client went away: says nothing about the worker
    assert cb.allow()
    cb.failure()
    assert cb.state == OPEN and not cb.available()
    disabled = CircuitBreaker(failure_threshold=1, enabled=False)
    disabled.failure()
    assert disabled.state == CLOSED and disabled.allow()


def test_failures_of_requests_in_flight_together_count_once():
    """A dead worker fails all its open requests at once: one fault. 100 of them must not open a breaker whose
    threshold is 3; requests sent after a counted failure count again."""
    clock = Clock()
    cb = CircuitBreaker(failure_threshold=3, timeout_s=10, window_s=60, clock=clock)
    sent = [clock() + i * 0.001 for i in range(100)]
    clock.now += 1
    for t in sent:
        cb.allow()
        cb.failure(t)
    assert cb.state == CLOSED
    for _ in range(2):
        clock.now += 1
        sent_now = clock()
        clock.now += 0.5
        cb.failure(sent_now)
    assert cb.state == OPEN


async def test_the_limiter_queues_in_order_refuses_when_full_and_times_out():
    limiter = ConcurrencyLimiter(max_concurrent=1, queue_size=2, queue_timeout_s=0.3)
    await limiter.acquire()
    order = []

    async def wait(name):
        await limiter.acquire()
        order.append(name)

    first, second = asyncio.create_task(wait("a")), asyncio.create_task(wait("b"))
    await asyncio.sleep(0.01)
    assert limiter.queued == 2
    with pytest.raises(Overloaded) as e:
        await limiter.acquire()
    assert e.value.status == 429 and "--queue-size" in str(e.value)
    limiter.release()
    await first
    assert order == ["a"] and limiter.running == 1  # the slot passed on
    second.cancel()  # a waiter that leaves takes its place in the queue with it
    await asyncio.gather(second, return_exceptions=True)
    assert limiter.queued == 0
    with pytest.raises(Overloaded) as e:
        await limiter.acquire()  # nobody releases within the timeout
    assert e.value.status == 408
    limiter.release()
    assert limiter.running == 0 and (limiter.rejected, limiter.timed_out) == (1, 1)


def test_rate_limits_are_per_key_and_refill_over_time():
    clock = Clock()
    rate = RateLimiter(rate=2, burst=2, clock=clock)
    a, b = client_key("Bearer a", "10.0.0.1"), client_key(None, "10.0.0.2")
    assert a.startswith("key:") and "Bearer" not in a and b == "addr:10.0.0.2"
    rate.check(a)
    rate.check(a)
    with pytest.raises(Overloaded) as e:
        rate.check(a)
    assert e.value.status == 429 and e.value.retry_after_s == pytest.approx(0.5)
    rate.check(b)  # another key has its own bucket
    clock.now += 0.5
    rate.check(a)
    assert rate.limited == 1


@dataclass
class W:
    url: str
    in_flight: int = 0


def test_power_of_two_takes_the_less_loaded_of_two():
    workers = [W("a", 5), W("b", 0), W("c", 9)]
    policy = PowerOfTwo(seed=1)
    picks = [policy.pick(workers, []).url for _ in range(300)]
    assert "c" not in picks and picks.count("b") > picks.count("a")  # c always loses; a only wins against c
    assert policy.pick([W("only")], []).url == "only"


def test_manual_keeps_a_routing_key_on_its_worker_and_moves_only_that_key():
    workers = [W(f"10.0.0.{i}:50051") for i in range(4)]
    policy = Manual("min_load")
    homes = {}
    for key in (f"session-{i}" for i in range(40)):
        token = routing_key_var.set(key)
        try:
            homes[key] = policy.pick(workers, []).url
            assert all(policy.pick(list(reversed(workers)), []).url == homes[key] for _ in range(3))
            gone = [w for w in workers if w.url != homes[key]][0]
            assert policy.pick([w for w in workers if w is not gone], []).url == homes[key]
        finally:
            routing_key_var.reset(token)
    assert len(set(homes.values())) == 4  # the keys spread over every worker
    workers[2].in_flight = -1
    assert policy.pick(workers, []).url == workers[2].url  # no key: min_load
    assert policy.counts == {"routing_key": 40 * 5, "no_key": 1}


def test_flags_out_of_range_are_refused_by_name():
    for kwargs, flag in (({"retry_max_retries": 0}, "--retry-max-retries"),
                         ({"retry_max_backoff_ms": 10}, "--retry-max-backoff-ms"),
                         ({"cb_failure_threshold": 0}, "--cb-failure-threshold"),
                         ({"max_concurrent_requests": 0}, "--max-concurrent-requests"),
                         ({"rate_limit_tokens_per_second": 0}, "--rate-limit-tokens-per-second"),
                         ({"prefill_policy": "fastest"}, "--prefill-policy"),
                         ({"assignment_mode": "min_group"}, "--assignment-mode")):
        with pytest.raises(ValueError, match=flag):
            RouterSettings(tokenizer_url="t:1", **kwargs)
