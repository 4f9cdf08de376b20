"""The router's request path shared by every front end (OpenAI, /generate, gRPC): tokenize through the tokenizer
service, pick a healthy worker with the policy, stream the worker's messages back. A worker that fails before it
streamed anything is marked unhealthy and the request is retried once on another; failures map to HTTP statuses
(RouterError) so each front end can answer in its own error format."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator

import grpc

from radixmesh.v1 import tokenizer_pb2, worker_pb2
from services.common import tracing
from services.router.calls import OpenCalls
from services.router.errors import RouterError, status_of
from services.router.pd import generate_pd
from services.router.policies import Policy
from services.router.settings import RouterSettings
from services.router.tenants import TenantResolver
from services.router.tokenizer_client import TokenizerClient, TokenizerUnavailable
from services.router.workers import WorkerRegistry

log = logging.getLogger(__name__)

__all__ = ["Router", "RouterError", "new_request_id", "status_of"]

async def _tokenizer_call(pending):
    """Await a tokenizer-service call: rejected input -> RouterError 400, an unreachable service -> 503."""
    try:
        return await pending
    except ValueError as e:
        raise RouterError(400, str(e)) from None
    except TokenizerUnavailable as e:
        raise RouterError(503, str(e)) from None


def new_request_id() -> str:
    return uuid.uuid4().hex


class Router:
    def __init__(self, settings: RouterSettings, registry: WorkerRegistry, policy: Policy,
                 tokenizer: TokenizerClient):
        self.settings = settings
        self.registry = registry
        self.policy = policy
        # A policy that must await (kv_index asks the kvstore) has pick_async(workers, input_ids, tenant); the
        # others keep their plain synchronous pick, called without a coroutine in between.
        self.pick_async = getattr(policy, "pick_async", None)
        self.tokenizer = tokenizer
        self.tenants = TenantResolver.from_settings(settings)
        registry.on_remove = self._worker_removed
        registry.on_lost = lambda w: self.calls.cancel(lambda url: url == w.url,
                                                       f"worker {w.url} stopped answering", retry=True)
        self._model_name = "default"
        self.metrics = None  # services.router.metrics.RouterMetrics when metrics are on
        # Open worker calls: a cancelled one's request fails with RouterError(503, reason), or, when the
        # cancel allows a retry and nothing was streamed yet, moves to another worker.
        self.calls = OpenCalls()

    def _worker_removed(self, url: str) -> None:
        self.policy.forget(url)
        self.calls.cancel(lambda u: u == url, f"worker {url} was removed", retry=True)

    def abort_all(self, reason: str) -> int:
        """Cancel every open worker call (the workers abort those requests); each request then fails with
        RouterError(503, reason), so its client gets an error, not a cut stream. Returns how many were open.
        The registry does the same for one worker that stops answering health probes (a hung process)."""
        return self.calls.cancel(lambda url: True, reason)

    @property
    def model_name(self) -> str:
        if self.settings.served_model_name:
            return self.settings.served_model_name
        info = self.registry.any_info()
        if info is not None:  # remembered: with every worker gone, requests get 503, not 404 for the model
            self._model_name = info.served_model_name
        return self._model_name

    async def tokenize(self, request: tokenizer_pb2.TokenizeRequest) -> tokenizer_pb2.TokenizeResponse:
        with tracing.span("tokenize", "client") as span:
            out = await _tokenizer_call(self.tokenizer.tokenize(request))
            if span is not None:
                span.set_attribute("radixmesh.prompt_tokens", len(out.input_ids))
            return out

    async def detokenize(self, ids: list[int]) -> str:
        with tracing.span("detokenize", "client", tokens=len(ids)):
            return await _tokenizer_call(self.tokenizer.detokenize(ids))

    async def pick(self, candidates: list, request: worker_pb2.GenerateRequest, role: str = "colocated"):
        """The policy's choice among `candidates` for `request`, inside the `route` span (with tracing on: the
        policy, the chosen worker and, where the policy knows it, the matched prefix in tokens)."""
        with tracing.span("route", policy=self.settings.policy, role=role, candidates=len(candidates),
                          prompt_tokens=len(request.input_ids)) as span:
            worker = (self.policy.pick(candidates, request.input_ids) if self.pick_async is None
                      else await self.pick_async(candidates, request.input_ids, request.tenant))
            if span is not None:
                span.set_attributes(tracing.attributes(worker=worker.url, matched_tokens=getattr(
                    self.policy, "last_matched_tokens", None), reason=getattr(self.policy, "last_reason", None)))
            return worker

    async def generate(self, request: worker_pb2.GenerateRequest) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """The worker's messages for one request. Close the iterator (contextlib.aclosing) to cancel the worker
        call, which aborts the request there and frees its KV pages."""
        if self.registry.disaggregated:
            async for msg in generate_pd(self, request):
                yield msg
            return
        tried: set[str] = set()
        attempts = 2 if self.settings.retry_on_unavailable else 1
        for attempt in range(attempts):
            candidates = [w for w in self.registry.healthy() if w.url not in tried]
            if not candidates:
                raise RouterError(503, "no healthy worker" + (" left to retry on" if tried else ""))
            worker = await self.pick(candidates, request)
            tried.add(worker.url)
            metrics, sent = self.metrics, time.monotonic()
            if metrics is not None:
                metrics.picked(worker.url)
            worker.in_flight += 1
            span = tracing.start_span("worker Generate", worker=worker.url, role="colocated", attempt=attempt)
            call = worker.stub.Generate(request, timeout=self.settings.request_timeout_s,
                                        metadata=tracing.metadata_for(span))
            self.calls.track(call, worker.url)
            streamed, error = False, None
            try:
                async for msg in call:
                    if metrics is not None and not streamed and request.stream:
                        metrics.first_message(worker.url, time.monotonic() - sent)
                    streamed = True
                    yield msg
                if metrics is not None:
                    metrics.worker_done(worker.url, time.monotonic() - sent)
                return
            except grpc.aio.AioRpcError as e:
                error = e
                code = e.code()
                if metrics is not None:
                    metrics.worker_failed(worker.url, code.name)
                if code != grpc.StatusCode.UNAVAILABLE:
                    raise RouterError(status_of(code), e.details() or code.name) from None
                self.registry.mark_failed(worker, e.details() or "unavailable")
                if streamed or attempt == attempts - 1:
                    raise RouterError(503, f"worker {worker.url} failed: {e.details()}") from None
                log.info("worker %s unavailable before streaming; retrying on another", worker.url)
                if metrics is not None:
                    metrics.retried(worker.url)
            except BaseException as e:
                error = e
                if not isinstance(e, asyncio.CancelledError):
                    raise
                task = asyncio.current_task()
                cancelled = self.calls.why_cancelled(call)
                if cancelled is None or (task is not None and task.cancelling()):
                    raise  # our caller was cancelled (e.g. its client went away)
                reason, retry = cancelled  # we cancelled the call: shutdown, a lost or a removed worker
                if metrics is not None:
                    metrics.worker_failed(worker.url, grpc.StatusCode.CANCELLED.name)
                if not retry or streamed or attempt == attempts - 1:
                    raise RouterError(503, reason) from None
                log.info("%s before streaming; retrying on another", reason)
                if metrics is not None:
                    metrics.retried(worker.url)
            finally:
                tracing.end_span(span, error)
                self.calls.forget(call)
                worker.in_flight -= 1
                call.cancel()
