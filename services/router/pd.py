"""The router's prefill/decode path: pick a prefill worker (by --prefill-policy, default --policy: its prefix cache
is what the policy models) and a decode worker (by --decode-policy, default the least loaded), mint a random 63-bit
bootstrap room, send
Generate to both at once and stream the decode worker's answer. Both workers get a copy of the router's request, so
the tenant namespace travels with it. The prefill worker's call only reports how the prefill went: if it fails
first, the decode call is cancelled with its reason.

A pair that fails before anything was streamed (a worker gone, a handoff that broke or timed out: UNAVAILABLE or
ABORTED) is retried on another pair (--retry-max-retries attempts with backoff; the failed side's circuit breaker
counts it); input errors are not retried."""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from typing import Awaitable, AsyncIterator, Callable, Protocol

import grpc

from radixmesh.v1 import worker_pb2
from services.common import tracing
from services.router.calls import OpenCalls
from services.router.errors import RouterError, status_of
from services.router.policies import Policy
from services.router.resilience import Backoff, attempts_of
from services.router.settings import RouterSettings
from services.router.workers import Worker, WorkerRegistry

log = logging.getLogger(__name__)

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
_rotation = itertools.count()


class PairRouter(Protocol):
    """What this path needs of the router (services.router.core.Router, which calls generate_pd with itself)."""

    settings: RouterSettings
    registry: WorkerRegistry
    role_policies: dict[str, Policy]
    backoff: Backoff
    pick: Callable[..., Awaitable[Worker]]  # the role's policy's choice, traced as the `route` span
    policy_name: Callable[[str], str]
    metrics: object | None  # services.router.metrics.RouterMetrics when metrics are on
    calls: OpenCalls


def new_room() -> int:
    return secrets.randbits(63)


def _pick(workers: list[Worker], tried: set[str]) -> list[Worker]:
    """Workers not tried yet for this request, or every one when all were (a retry may reuse a healthy one)."""
    fresh = [w for w in workers if w.url not in tried]
    return fresh or workers


def _least_loaded(workers: list[Worker]) -> Worker:
    """Fewest in-flight requests; ties go round robin (the list is rotated, then min keeps the first)."""
    k = next(_rotation) % len(workers)
    return min(workers[k:] + workers[:k], key=lambda w: w.in_flight)


def _paired(request: worker_pb2.GenerateRequest, prefill: Worker, room: int, stream: bool):
    out = worker_pb2.GenerateRequest()
    out.CopyFrom(request)
    out.stream = stream
    out.disaggregated_params.bootstrap_host = prefill.url.rpartition(":")[0]
    out.disaggregated_params.bootstrap_port = prefill.info.bootstrap_port
    out.disaggregated_params.bootstrap_room = room
    return out


class _PairFailed(Exception):
    def __init__(self, status: grpc.StatusCode, message: str, retry: bool, worker: str):
        super().__init__(message)
        self.code, self.message, self.retry = status, message, retry
        self.worker = worker  # the url of the side that failed


async def generate_pd(router: PairRouter, request: worker_pb2.GenerateRequest
                      ) -> AsyncIterator[worker_pb2.GenerateResponse]:
    if request.sampling_params.HasField("n") and request.sampling_params.n > 1:
        raise RouterError(400, "n > 1 is not supported with prefill/decode disaggregation")
    tried: set[str] = set()
    attempts = attempts_of(router.settings)
    for attempt in range(attempts):
        if attempt:
            await asyncio.sleep(router.backoff.delay_s(attempt))
        prefill, decode = await _pick_pair(router, request, tried)
        streamed, verdicts = False, {prefill.url: prefill.breaker.release, decode.url: decode.breaker.release}
        try:
            async for msg in _run_pair(router, request, prefill, decode):
                streamed = True
                yield msg
            verdicts = {prefill.url: prefill.breaker.success, decode.url: decode.breaker.success}
            return
        except _PairFailed as e:
            failed = prefill if e.worker == prefill.url else decode
            verdicts[failed.url] = failed.breaker.failure if e.retry else failed.breaker.success
            if not e.retry or streamed or attempt == attempts - 1:
                raise RouterError(status_of(e.code), e.message) from None
            log.info("pair %s -> %s failed before streaming (%s); retrying on another pair", prefill.url,
                     decode.url, e.message)
            if router.metrics is not None:
                router.metrics.retried(e.worker)
        finally:
            for verdict in verdicts.values():
                verdict()


async def _pick_pair(router: PairRouter, request, tried: set[str]) -> tuple[Worker, Worker]:
    """A prefill and a decode worker, each by its role's policy, not tried yet where possible, each holding its
    circuit breaker's permission; RouterError(503) when no healthy pair is left."""
    while True:
        prefills, decodes = router.registry.healthy("prefill"), router.registry.healthy("decode")
        if not prefills or not decodes:
            raise RouterError(503, f"no healthy prefill/decode pair ({len(prefills)} prefill, {len(decodes)} "
                                   "decode workers healthy)")
        prefill = await router.pick(_pick(prefills, tried), request, "prefill")
        decode = (await router.pick(_pick(decodes, tried), request, "decode") if "decode" in router.role_policies
                  else _least_loaded(_pick(decodes, tried)))
        tried |= {prefill.url, decode.url}
        if not prefill.breaker.allow():
            continue
        if not decode.breaker.allow():
            prefill.breaker.release()
            continue
        if router.metrics is not None:
            router.metrics.picked(prefill.url, router.policy_name("prefill"))
            router.metrics.picked(decode.url, router.settings.decode_policy or "least_loaded")
        return prefill, decode


async def _run_pair(router: PairRouter, request, prefill: Worker, decode: Worker):
    room = new_room()
    timeout = router.settings.request_timeout_s
    room_hex = format(room, "016x")
    pspan = tracing.start_span("worker Generate", worker=prefill.url, role="prefill", bootstrap_room=room_hex)
    dspan = tracing.start_span("worker Generate", worker=decode.url, role="decode", bootstrap_room=room_hex)
    pcall = prefill.stub.Generate(_paired(request, prefill, room, stream=False), timeout=timeout,
                                  metadata=tracing.metadata_for(pspan))
    dcall = decode.stub.Generate(_paired(request, prefill, room, stream=request.stream), timeout=timeout,
                                 metadata=tracing.metadata_for(dspan))
    failure: list[_PairFailed] = []
    metrics, sent = router.metrics, time.monotonic()

    def prefill_done(task: asyncio.Task) -> None:
        tracing.end_span(pspan, asyncio.CancelledError() if task.cancelled() else task.exception())
        if task.cancelled() or task.exception() is None:
            return
        e = task.exception()
        if isinstance(e, grpc.aio.AioRpcError):
            if metrics is not None:
                metrics.worker_failed(prefill.url, e.code().name)
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                router.registry.mark_failed(prefill, e.details() or "unavailable")
            failure.append(_PairFailed(e.code(), f"prefill worker {prefill.url}: {e.details()}",
                                       e.code() in RETRYABLE, prefill.url))
            if e.code() != grpc.StatusCode.ABORTED:
                # ABORTED is a failed handoff, which the decode worker hears of through its own handoff stream
                # (and then frees its pages at once); anything else it might only learn of by timing out.
                dcall.cancel()

    async def drain() -> None:
        async for _ in pcall:
            pass
        if metrics is not None:
            metrics.worker_done(prefill.url, time.monotonic() - sent)
    ptask = asyncio.ensure_future(drain())
    ptask.add_done_callback(prefill_done)
    for worker, call in ((prefill, pcall), (decode, dcall)):
        worker.in_flight += 1
        router.calls.track(call, worker.url)
    error = None
    try:
        first = True
        async for msg in dcall:
            if metrics is not None and first and request.stream:
                metrics.first_message(decode.url, time.monotonic() - sent)
            first = False
            yield msg
        if metrics is not None:
            metrics.worker_done(decode.url, time.monotonic() - sent)
    except grpc.aio.AioRpcError as e:
        error = e
        code = e.code()
        if metrics is not None:
            metrics.worker_failed(decode.url, code.name)
        if code == grpc.StatusCode.UNAVAILABLE:
            router.registry.mark_failed(decode, e.details() or "unavailable")
        # The prefill side's error says more (bad input, or which worker died); give it a moment to arrive.
        await asyncio.wait([ptask], timeout=1.0)
        if failure:
            raise failure[0] from None
        raise _PairFailed(code, f"decode worker {decode.url}: {e.details()}", code in RETRYABLE, decode.url) from None
    except BaseException as e:
        error = e
        if not isinstance(e, asyncio.CancelledError):
            raise
        task = asyncio.current_task()
        cancelled = router.calls.why_cancelled(dcall) or router.calls.why_cancelled(pcall)
        if failure and not (task is not None and task.cancelling()):
            raise failure[0] from None
        if cancelled is None or (task is not None and task.cancelling()):
            raise
        reason, retry = cancelled
        raise _PairFailed(grpc.StatusCode.UNAVAILABLE, reason, retry,
                          decode.url if router.calls.why_cancelled(dcall) else prefill.url) from None
    finally:
        tracing.end_span(dspan, error)
        for worker, call in ((prefill, pcall), (decode, dcall)):
            router.calls.forget(call)
            worker.in_flight -= 1
            call.cancel()
        ptask.cancel()
