"""The router's prefill/decode path: pick a prefill worker (by --prefill-policy, default --policy: its prefix cache
is what the policy models) and a decode worker (by --decode-policy, default the least loaded), mint a random 63-bit
bootstrap room, send
Generate to both at once and stream the decode worker's answer. Both workers get a copy of the router's request, so
the tenant namespace travels with it. The prefill worker's call only reports how the prefill went: if it fails
first, the decode call is cancelled with its reason.

A pair that fails before anything was streamed (a worker gone, a handoff that broke or timed out: UNAVAILABLE or
ABORTED) is retried on another pair (--retry-max-retries attempts with backoff; the failed side's circuit breaker
counts it); input errors are not retried. One that fails mid-stream moves to a new pair, which resumes after the
tokens already streamed (services.router.migration, --max-migrations).

A request with n > 1 becomes n requests, one pair each, as the colocated engine makes n (engine/results.py): sample j
has request id `<id>-<j>`, sampling_seed + j when a seed is given, and n unset; their messages are merged in arrival
order, each carrying index j and the request's own id, as a colocated worker answers n > 1. The prompt is prefilled
once, as the colocated engine does: sample 0 runs first; the others start once one of its prefill calls has
succeeded, on the same prefill worker (the prompt is in its prefix cache) while it is healthy and its breaker allows,
else wherever the policy says. Each sample is retried on its own; one that fails for good fails the request (a
failed sample 0 before the others start), and leaving early cancels every pair still running."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import secrets
import time
from typing import Awaitable, AsyncIterator, Callable, Protocol

import grpc

from radixmesh.v1 import worker_pb2
from radixmesh.services.common import tracing
from radixmesh.services.router.calls import OpenCalls
from radixmesh.services.router.errors import RouterError, status_of
from radixmesh.services.router.lora_directory import LoraDirectory
from radixmesh.services.router.merge import merged
from radixmesh.services.router.migration import Streamed, sample_request
from radixmesh.services.router.policies import Policy
from radixmesh.services.router.resilience import Backoff, attempts_of
from radixmesh.services.router.settings import RouterSettings
from radixmesh.services.router.workers import Worker, WorkerRegistry

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
    lora: LoraDirectory  # which worker has which LoRA adapter


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


class _SharedPrefill:
    """Sample 0's prefill of an n > 1 request: `done` is set once it succeeded, `worker` the prefill worker whose
    prefix cache then holds the prompt."""

    def __init__(self) -> None:
        self.done = asyncio.Event()
        self.worker: Worker | None = None

    def prefilled(self, worker: Worker) -> None:
        if not self.done.is_set():
            self.worker = worker
            self.done.set()


async def generate_pd(router: PairRouter, request: worker_pb2.GenerateRequest
                      ) -> AsyncIterator[worker_pb2.GenerateResponse]:
    """The decode workers' messages for `request`; with n > 1, every sample's, tagged with its index."""
    n = request.sampling_params.n if request.sampling_params.HasField("n") else 1
    if n <= 1:
        async for msg in _generate_one(router, request):
            yield msg
        return
    shared = _SharedPrefill()
    samples = [_sample(router, sample_request(request, j), j, shared) for j in range(n)]
    async with contextlib.aclosing(merged(samples)) as messages:
        async for j, msg in messages:
            msg.index = j
            msg.request_id = request.request_id
            yield msg


async def _sample(router: PairRouter, request: worker_pb2.GenerateRequest, j: int, shared: _SharedPrefill
                  ) -> AsyncIterator[worker_pb2.GenerateResponse]:
    if j == 0:
        async for msg in _generate_one(router, request, shared=shared):
            yield msg
        return
    await shared.done.wait()
    async for msg in _generate_one(router, request, prefer=shared.worker):
        yield msg


async def _generate_one(router: PairRouter, request: worker_pb2.GenerateRequest, shared: _SharedPrefill | None = None,
                        prefer: Worker | None = None) -> AsyncIterator[worker_pb2.GenerateResponse]:
    """One request (n = 1) on a pair, retried on another pair while nothing was streamed. `shared` hears of its
    first successful prefill; `prefer` is the prefill worker to try first (see _pick_pair)."""
    tried: set[str] = set()
    attempts, migrations, attempt, broke = attempts_of(router.settings), 0, 0, ""
    stream = Streamed(request)
    while True:
        if attempt:
            await asyncio.sleep(router.backoff.delay_s(attempt))
        try:
            prefill, decode = await _pick_pair(router, request, tried, prefer)
        except RouterError as e:
            if not migrations:
                raise
            raise RouterError(e.status, f"{broke} ({e.message} to continue on)") from None
        streamed, verdicts = False, {prefill.url: prefill.breaker.release, decode.url: decode.breaker.release}
        sent = {w.url: w.breaker.clock() for w in (prefill, decode)}
        try:
            async for msg in _run_pair(router, request, prefill, decode,
                                       shared.prefilled if shared is not None else None):
                streamed = True
                stream.saw(msg)
                yield msg
            verdicts = {prefill.url: prefill.breaker.success, decode.url: decode.breaker.success}
            if shared is not None:  # the decode side can finish before the prefill call's answer arrives
                shared.prefilled(prefill)
            return
        except _PairFailed as e:
            failed = prefill if e.worker == prefill.url else decode
            verdicts[failed.url] = (functools.partial(failed.breaker.failure, sent[failed.url]) if e.retry
                                    else failed.breaker.success)
            if streamed and e.retry and stream.finished:  # the pair failed after the last token: nothing to redo
                log.warning("pair %s -> %s failed after request %s's last token (%s); ending it with what was "
                            "streamed", prefill.url, decode.url, request.request_id, e.message)
                for msg in stream.completes():
                    yield msg
                return
            if streamed and e.retry:  # mid-stream: a new pair continues after the tokens the client has
                why_not = stream.why_not_migrate(migrations, router.settings.max_migrations)
                if why_not:
                    raise RouterError(status_of(e.code), f"{e.message} ({why_not})") from None
                migrations += 1
                broke = e.message
                request, tried, prefer = stream.continuation(), {e.worker}, None
                log.warning("pair %s -> %s failed mid-stream (%s); migrating request %s after %d streamed tokens "
                            "(migration %d)", prefill.url, decode.url, e.message, request.request_id,
                            len(request.resume_output_ids), migrations)
                if router.metrics is not None:
                    router.metrics.migrated(e.worker)
                continue
            attempt += 1
            if not e.retry or streamed or attempt == attempts:
                raise RouterError(status_of(e.code), e.message) from None
            log.info("pair %s -> %s failed before streaming (%s); retrying on another pair", prefill.url,
                     decode.url, e.message)
            if router.metrics is not None:
                router.metrics.retried(e.worker)
        finally:
            for verdict in verdicts.values():
                verdict()


async def _pick_prefill(router: PairRouter, prefills: list[Worker], request, tried: set[str],
                        prefer: Worker | None) -> Worker:
    """`prefer` when it is healthy and not tried yet for this request (an n > 1 sample goes where the prompt was
    prefilled), else the prefill policy's choice."""
    if prefer is not None and prefer.url not in tried:
        again = next((w for w in prefills if w.url == prefer.url), None)
        if again is not None:
            with tracing.span("route", policy=router.policy_name("prefill"), role="prefill",
                              candidates=len(prefills), prompt_tokens=len(request.input_ids), worker=again.url,
                              reason="shared_prefill"):
                return again
    return await router.pick(_pick(prefills, tried), request, "prefill")


async def _pick_pair(router: PairRouter, request, tried: set[str], prefer: Worker | None = None
                     ) -> tuple[Worker, Worker]:
    """A prefill and a decode worker, each by its role's policy (the prefill one `prefer` when it can take it: see
    _pick_prefill), both with the request's LoRA adapter loaded, not tried yet where possible, each holding its
    circuit breaker's permission; RouterError(503) when no healthy pair is left (400 for an adapter no worker has)."""
    while True:
        prefills, decodes = router.registry.healthy("prefill"), router.registry.healthy("decode")
        if not prefills or not decodes:
            raise RouterError(503, f"no healthy prefill/decode pair ({len(prefills)} prefill, {len(decodes)} "
                                   "decode workers healthy)")
        if request.lora_path:
            prefills = await router.lora.serving(prefills, request.lora_path, "prefill")
            decodes = await router.lora.serving(decodes, request.lora_path, "decode")
        prefill = await _pick_prefill(router, prefills, request, tried, prefer)
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


async def _run_pair(router: PairRouter, request, prefill: Worker, decode: Worker,
                    prefilled: Callable[[Worker], None] | None = None):
    """The decode worker's messages for `request` on this pair; `prefilled(prefill)` is called once the prefill
    call has ended well (the prompt is then in that worker's prefix cache)."""
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
    decoding = [False]  # the decode side streams: the handoff is over, whatever happens to the prefill call now

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
            if e.code() != grpc.StatusCode.ABORTED and not decoding[0]:
                # ABORTED is a failed handoff, which the decode worker hears of through its own handoff stream
                # (and then frees its pages at once); anything else it might only learn of by timing out.
                dcall.cancel()

    async def drain() -> None:
        async for _ in pcall:
            pass
        if metrics is not None:
            metrics.worker_done(prefill.url, time.monotonic() - sent)
        if prefilled is not None:
            prefilled(prefill)
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
            first, decoding[0] = False, True
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
