"""The router's request path shared by every front end (OpenAI, /generate, gRPC): tokenize through the tokenizer
service, pick a healthy worker with the policy, stream the worker's messages back. A worker that fails before it
streamed anything is marked unhealthy and the request is retried on another (services.router.resilience: attempts,
backoff, and the worker's circuit breaker, which hears of every call's outcome); failures map to HTTP statuses
(RouterError) so each front end can answer in its own error format."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from random import getrandbits
from typing import AsyncIterator

import grpc

from radixmesh.engine.request import cache_namespace
from radixmesh.v1 import tokenizer_pb2, worker_pb2
from radixmesh.services.common import tracing
from radixmesh.services.common.chat_render import template_sha256
from radixmesh.services.router.calls import OpenCalls
from radixmesh.services.router.errors import RouterError, status_of
from radixmesh.services.router.lora_directory import LoraDirectory
from radixmesh.services.router.merge import merged
from radixmesh.services.router.migration import Streamed
from radixmesh.services.router.pd import generate_pd
from radixmesh.services.router.policies import Policy, chat_routing_text
from radixmesh.services.router.resilience import attempts_of, backoff_of
from radixmesh.services.router.settings import RouterSettings
from radixmesh.services.router.tenants import TenantResolver
from radixmesh.services.router.tokenizer_client import TokenizerClient, TokenizerUnavailable
from radixmesh.services.router.workers import WorkerRegistry

log = logging.getLogger(__name__)

__all__ = ["Router", "RouterError", "new_request_id", "status_of"]
# Worker-call failures that speak against the worker (its circuit breaker counts them); others are the request's.
WORKER_FAULTS = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
                           grpc.StatusCode.UNKNOWN, grpc.StatusCode.RESOURCE_EXHAUSTED})

async def _tokenizer_call(pending):
    """Await a tokenizer-service call: rejected input -> RouterError 400, an unreachable service -> 503."""
    try:
        return await pending
    except ValueError as e:
        raise RouterError(400, str(e)) from None
    except TokenizerUnavailable as e:
        raise RouterError(503, str(e)) from None


def new_request_id() -> str:
    """32 random hex digits (as uuid4().hex has, at a fifteenth of its cost: no getrandom syscall, no UUID object).
    random's generator is seeded from the OS at start and again in a forked child, so processes never share ids."""
    return getrandbits(128).to_bytes(16, "little").hex()


class Router:
    def __init__(self, settings: RouterSettings, registry: WorkerRegistry, policy: Policy,
                 tokenizer: TokenizerClient, role_policies: dict[str, Policy] | None = None):
        """`role_policies`: PD mode's --prefill-policy / --decode-policy, by role (default: `policy` picks prefill
        workers; decode workers go to the least loaded)."""
        self.settings = settings
        self.registry = registry
        self.policy = policy
        self.role_policies = {"colocated": policy, "prefill": policy, **(role_policies or {})}
        self._policy_names = {"colocated": settings.policy, "prefill": settings.prefill_policy or settings.policy,
                              "decode": settings.decode_policy or settings.policy}
        self.tokenizer = tokenizer
        self._chat_template: tuple = (None, "")  # (the tokenizer info it is of, its chat template's SHA-256)
        self.tenants = TenantResolver.from_settings(settings)
        self._single_tokens: dict[str, int | None] = {}
        registry.on_remove = self._worker_removed
        registry.on_lost = lambda w: self.calls.cancel(lambda url: url == w.url,
                                                       f"worker {w.url} stopped answering", retry=True)
        self._model_name = ""  # the workers' served model name, once one said it
        self.metrics = None  # services.router.metrics.RouterMetrics when metrics are on
        # Open worker calls: a cancelled one's request fails with RouterError(503, reason), or, when the
        # cancel allows a retry and nothing was streamed yet, moves to another worker.
        self.calls = OpenCalls()
        self.backoff = backoff_of(settings)
        self.lora = LoraDirectory(registry, settings.health_check_timeout_secs)  # which worker has which adapter

    def _worker_removed(self, url: str) -> None:
        for policy in {id(p): p for p in self.role_policies.values()}.values():
            policy.forget(url)
        self.calls.cancel(lambda u: u == url, f"worker {url} was removed", retry=True)

    def abort_all(self, reason: str) -> int:
        """Cancel every open worker call (the workers abort those requests); each request then fails with
        RouterError(503, reason), so its client gets an error, not a cut stream. Returns how many were open.
        The registry does the same for one worker that stops answering health probes (a hung process)."""
        return self.calls.cancel(lambda url: True, reason)

    @property
    def served_models(self) -> tuple[str, ...]:
        """The model names a request may ask for: --served-model-name, else the one the workers serve; none before
        any worker answered (a request then gets 503 "no model is being served yet", not a 404 that names a
        placeholder: one of several router processes may start before it has heard of the workers)."""
        if self.settings.served_model_name:
            return (self.settings.served_model_name,)
        info = self.registry.any_info()
        if info is not None:  # remembered: with every worker gone, requests get 503, not 404 for the model
            self._model_name = info.served_model_name
        return (self._model_name,) if self._model_name else ()

    @property
    def model_name(self) -> str:
        """The served model's name for responses and labels ("default" before any worker answered)."""
        names = self.served_models
        return names[0] if names else "default"

    def require_model(self, name: str) -> None:
        """For a request that names its model ("" names none, and passes): RouterError 503 before any worker said
        what it serves, 404 for a name other than the served one."""
        if not name:
            return
        names = self.served_models
        if not names:
            raise RouterError(503, f"model {name!r}: no model is being served yet (no worker has answered)")
        if name not in names:
            raise RouterError(404, f"model {name!r} is not served here; serving {names[0]!r}")

    async def tokenize(self, request: tokenizer_pb2.TokenizeRequest) -> tokenizer_pb2.TokenizeResponse:
        # no client span of the router's own: the request carries the current span's context (the HTTP request's),
        # and the tokenizer's server span under it times the call (tracing.put_context)
        return await _tokenizer_call(self.tokenizer.tokenize(request))

    async def single_token(self, text: str) -> int | None:
        """The token id of `text` when the tokenizer has it as one token, else None (asked once per text)."""
        if text not in self._single_tokens:
            out = await self.tokenize(tokenizer_pb2.TokenizeRequest(text=text, add_special_tokens=False))
            self._single_tokens[text] = out.input_ids[0] if len(out.input_ids) == 1 else None
        return self._single_tokens[text]

    async def detokenize(self, ids: list[int], skip_special_tokens: bool | None = None) -> str:
        with tracing.span("detokenize", "client", tokens=len(ids)):
            return await _tokenizer_call(self.tokenizer.detokenize(ids, skip_special_tokens))

    def routes_text(self) -> bool:
        """Whether a text prompt goes to its worker as text, for the worker to tokenize (as SGLang's router leaves
        tokenization to its workers): when every worker is colocated and tokenizes, and the policy needs no token
        ids (cache_aware then matches the text's characters). Otherwise the tokenizer service tokenizes it here:
        kv_index matches token pages in the kvstore, and a PD pair is sent the ids."""
        return getattr(self.policy, "routes_text", False) and self.registry.tokenize_text

    def routes_chat(self, thinking: bool = False) -> bool:
        """Whether a chat prompt goes to its worker as messages, for the worker to render and tokenize (as SGLang's
        router leaves chat templates to its workers): when text prompts do (routes_text) and every worker renders
        with the tokenizer service's chat template (GetModelInfo's chat_template_sha256 is the service's).
        `thinking`: the router needs to know where the rendering leaves the thinking (--reasoning-parser), which
        every worker must then report (GetModelInfo's reports_prompt_thinking)."""
        if not self.routes_text():
            return False
        info = getattr(self.tokenizer, "info", None)
        if info is None:  # the tokenizer service has not answered yet: its template is not known
            return False
        if self._chat_template[0] is not info:
            self._chat_template = (info, template_sha256(info.chat_template))
        return self.registry.renders_chat(self._chat_template[1], thinking)

    def policy_name(self, role: str = "colocated") -> str:
        return self._policy_names.get(role) or self.settings.policy

    async def pick(self, candidates: list, request: worker_pb2.GenerateRequest, role: str = "colocated"):
        """The policy's choice among `candidates` for `request`, inside the `route` span (with tracing on: the
        policy, the chosen worker and, where the policy knows it, the matched prefix in tokens)."""
        policy = self.role_policies[role]
        # a policy that must await (kv_index asks the kvstore) has pick_async(workers, input_ids, tenant), under a
        # route span made current (its kvstore call is a span under it); the others keep their plain synchronous
        # pick, called without a coroutine in between, and their route span is a leaf (tracing.leaf)
        pick_async = getattr(policy, "pick_async", None)
        if pick_async is None:
            start = tracing.clock()
            # the ids, else (a text-only request: routes_text) the text; one wrapper of the repeated field for the
            # policy and the span (each costs)
            prompt = request.input_ids or request.text
            if not prompt and request.HasField("chat"):  # a chat prompt the worker renders (routes_chat)
                prompt = chat_routing_text(request.chat)
            try:
                worker = policy.pick(candidates, prompt, _namespace(request))
            except Exception as e:
                if start:
                    tracing.leaf("route", tracing.INTERNAL, start, _ROUTE[:5],
                                 (self.policy_name(role), role, len(candidates), *_in_units(prompt, _size(prompt))), e)
                raise
            if start:
                tracing.leaf("route", tracing.INTERNAL, start, _ROUTE, (
                    self.policy_name(role), role, len(candidates), *_in_units(prompt, _size(prompt)), worker.url,
                    getattr(policy, "last_reason", None),
                    *_in_units(prompt, getattr(policy, "last_matched_tokens", None))))
            return worker
        with tracing.span("route", policy=self.policy_name(role), role=role, candidates=len(candidates),
                          prompt_tokens=len(request.input_ids)) as span:
            worker = await pick_async(candidates, request.input_ids, _namespace(request))
            if span is not None:
                _route_attributes(policy, worker)
            return worker

    async def generate(self, request: worker_pb2.GenerateRequest, migrations: int = 0, broke: str = ""
                       ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """The worker's messages for one request. Close the iterator (contextlib.aclosing) to cancel the worker
        call, which aborts the request there and frees its KV pages. A worker that fails before anything was
        streamed is retried elsewhere (--retry-max-retries attempts, exponential backoff with jitter between); one
        that fails mid-stream is migrated (services/router/migration.py). `migrations`, `broke`: of a continuation,
        how many migrations it took so far and why the last was needed."""
        if self.registry.disaggregated:
            async for msg in generate_pd(self, request):
                yield msg
            return
        tried: set[str] = set()
        attempts, attempt = attempts_of(self.settings), 0
        stream = Streamed(request)
        while True:
            if attempt:
                await asyncio.sleep(self.backoff.delay_s(attempt))
            try:
                worker = await self.choose(request, tried)
            except RouterError as e:
                if not migrations:
                    raise
                # the stream broke and there is nowhere to continue it: say why it broke
                raise RouterError(e.status, f"{broke} ({e.message} to continue on)") from None
            outcome = _Attempt()
            async for msg in self._call(worker, request, attempt, outcome):
                stream.saw(msg)
                yield msg
            if outcome.error is None:
                return
            if outcome.streamed and stream.finished:  # the worker failed after the last token: nothing to redo
                log.warning("%s after request %s's last token; ending it with what was streamed",
                            outcome.error.message, request.request_id)
                for msg in stream.completes():
                    yield msg
                return
            if outcome.streamed:  # mid-stream: continue on another worker after the tokens the client has
                why_not = stream.why_not_migrate(migrations, self.settings.max_migrations)
                if why_not:
                    raise RouterError(outcome.error.status, f"{outcome.error.message} ({why_not})")
                migrations += 1
                broke = outcome.error.message
                if self.metrics is not None:
                    self.metrics.migrated(worker.url)
                if stream.n > 1:  # each unfinished sample continues as a request of its own
                    log.warning("%s mid-stream; migrating samples %s of request %s (migration %d)", broke,
                                stream.unfinished(), request.request_id, migrations)
                    async for msg in self._continue_samples(stream, migrations, broke):
                        yield msg
                    return
                request = stream.continuation()
                tried = {worker.url}
                log.warning("%s mid-stream; migrating request %s after %d streamed tokens (migration %d)",
                            broke, request.request_id, len(request.resume_output_ids), migrations)
                continue
            attempt += 1
            if not outcome.retry or attempt == attempts:
                raise outcome.error
            log.info("%s before streaming; retrying on another worker", outcome.error.message)
            if self.metrics is not None:
                self.metrics.retried(worker.url)

    async def _continue_samples(self, stream: Streamed, migrations: int, broke: str
                                ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """The unfinished samples of a broken n > 1 request, each resumed as a request of its own (migrated again
        if need be), their messages merged and labelled as the request's, sample by sample."""
        js = stream.unfinished()
        samples = [self.generate(stream.sample_continuation(j), migrations, broke) for j in js]
        async with contextlib.aclosing(merged(samples)) as messages:
            async for k, msg in messages:
                msg.index = js[k]
                msg.request_id = stream.request.request_id
                yield msg

    async def choose(self, request, tried: set[str], role: str = "colocated"):
        """The policy's pick among healthy workers of `role` (colocated or prefill) that have the request's LoRA
        adapter loaded, not tried yet for this request (all of them when every one was), taking the pick's
        circuit-breaker permission; RouterError(503) when there is none (400 for an adapter no worker has)."""
        lora = getattr(request, "lora_path", "")  # embedding requests have none
        while True:
            healthy = self.registry.healthy("null" if role == "colocated" else role)
            if lora and healthy:
                healthy = await self.lora.serving(healthy, lora, role)
            candidates = [w for w in healthy if w.url not in tried] or healthy
            if not candidates:
                raise RouterError(503, "no healthy worker" + (" left to retry on" if tried else ""))
            worker = await self.pick(candidates, request, role)
            tried.add(worker.url)
            if worker.breaker.allow():  # a half-open breaker lets one trial through at a time
                return worker

    async def _call(self, worker, request, attempt: int, outcome: "_Attempt"):
        """One attempt on `worker`: its messages; `outcome` says how it ended (error None: done). Errors after the
        first message, and errors retrying cannot help, are raised."""
        metrics, sent = self.metrics, time.monotonic()
        if metrics is not None:
            metrics.picked(worker.url)
        worker.in_flight += 1
        start = tracing.clock()
        streamed, error, verdict, call = False, None, worker.breaker.release, None
        began = worker.breaker.clock()  # a failure counts from the call's start
        try:
            call = await self._open_call(worker, request)
            self.calls.track(call, worker.url)
            async for msg in call:
                if metrics is not None and not streamed and request.stream:
                    metrics.first_message(worker.url, time.monotonic() - sent)
                streamed = True
                yield msg
            verdict = worker.breaker.success
            if metrics is not None:
                metrics.worker_done(worker.url, time.monotonic() - sent)
        except grpc.aio.AioRpcError as e:
            error = e
            code = e.code()
            if metrics is not None:
                metrics.worker_failed(worker.url, code.name)
            if code not in WORKER_FAULTS:  # the request's fault (bad input, ...): the worker is fine
                verdict = worker.breaker.success
                raise RouterError(status_of(code), e.details() or code.name) from None
            verdict = functools.partial(worker.breaker.failure, began)
            if code != grpc.StatusCode.UNAVAILABLE:
                raise RouterError(status_of(code), e.details() or code.name) from None
            self.registry.mark_failed(worker, e.details() or "unavailable")
            outcome.fail(RouterError(503, f"worker {worker.url} failed: {e.details()}"), not streamed, streamed)
        except BaseException as e:
            error = e
            if not isinstance(e, asyncio.CancelledError):
                raise
            task = asyncio.current_task()
            cancelled = self.calls.why_cancelled(call)
            if cancelled is None or (task is not None and task.cancelling()):
                raise  # our caller was cancelled (e.g. its client went away)
            reason, retry = cancelled  # we cancelled the call: shutdown, a lost or a removed worker
            verdict = functools.partial(worker.breaker.failure, began)
            if metrics is not None:
                metrics.worker_failed(worker.url, grpc.StatusCode.CANCELLED.name)
            outcome.fail(RouterError(503, reason), retry and not streamed, streamed and retry)
            if streamed and not retry:
                raise outcome.error from None
        finally:
            verdict()
            if error is not None and start:  # a failed call's own span (a call that worked: the worker's span)
                tracing.leaf("worker Generate", tracing.CLIENT, start, _WORKER_CALL,
                             (worker.url, "colocated", attempt), error)
            worker.in_flight -= 1
            if call is not None:
                self.calls.forget(call)
                call.cancel()

    async def _open_call(self, worker, request: worker_pb2.GenerateRequest):
        """The request on the worker's GenerateStream (services/router/mux.py) when the worker has one; otherwise a
        Generate call of its own. The current span's context (the HTTP request's) goes with it: the worker's server
        span is its child, and the router records no client span for a call that works (see _call)."""
        mux = worker.mux
        span = tracing.current_span()
        if mux is not None and not self.settings.disable_generate_stream and await mux.open():
            tracing.put_context(request, span)
            return mux.start(request, self.settings.request_timeout_s)
        return worker.stub.Generate(request, timeout=self.settings.request_timeout_s,
                                    metadata=tracing.metadata_for(span))


def _namespace(request) -> str:
    """The prefix-cache namespace a request's KV lives in on a worker: its tenant's, and its LoRA adapter's (an
    embedding request's route key names no adapter)."""
    return cache_namespace(request.tenant, getattr(request, "lora_path", ""))


# attribute names of the router's spans recorded as tuples (tracing.leaf)
# (a text-only request's prompt and matched prefix are counted in UTF-8 bytes, a tokenized one's in tokens)
_ROUTE = ("policy", "role", "candidates", "prompt_tokens", "prompt_bytes", "worker", "reason", "matched_tokens",
          "matched_bytes")
_WORKER_CALL = ("worker", "role", "attempt")


def _size(prompt) -> int:
    """A prompt's length: tokens of ids, UTF-8 bytes of a text."""
    return len(prompt.encode("utf-8", "surrogatepass")) if isinstance(prompt, str) else len(prompt)


def _in_units(prompt, n) -> tuple:
    """(n, None) for a tokenized prompt, (None, n) for a text one: the tokens and bytes attributes."""
    return (None, n) if isinstance(prompt, str) else (n, None)


def _route_attributes(policy, worker) -> None:
    """The outcome on the route span (the current one): the chosen worker, why, and the prefix it holds."""
    tracing.set_attributes(worker=worker.url, reason=getattr(policy, "last_reason", None),
                           matched_tokens=getattr(policy, "last_matched_tokens", None))


class _Attempt:
    """How one worker call ended: `error` None (it completed) or the RouterError to answer with, and whether
    another worker may be tried from the start (`retry`) or after what was streamed (`streamed`: the worker died or
    hung mid-stream)."""

    def __init__(self) -> None:
        self.error: RouterError | None = None
        self.retry = self.streamed = False

    def fail(self, error: RouterError, retry: bool, streamed: bool = False) -> None:
        self.error, self.retry, self.streamed = error, retry, streamed
