"""WorkerService over an in-process Engine: the colocated worker (--disaggregation-mode null).

Generate streams what the engine produces (it runs with stream_output, so each message carries only new tokens and
text); text is detokenized in this process's event loop, never on the scheduler thread. `generate` makes each
message where the engine hands over a step's outputs (Engine.generate_into): the event loop shares the GIL with the
scheduler thread, so no task wakes per token. A closed client stream (or a GenerateStream abort) cancels the
request's task, which aborts the request and frees its KV pages at once."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from typing import Callable

import grpc

from radixmesh.engine.cache.kv_events import EventKind, KvEvent
from radixmesh.engine.engine import Engine
from radixmesh.engine.outputs import RequestOutput
from radixmesh.engine.profiling import ProfileError
from radixmesh.engine.results import sample_rids
from radixmesh.v1 import worker_pb2, worker_pb2_grpc
from radixmesh.services.common import generate_mux, thinking, tracing
from radixmesh.services.common.errors import Exhausted
from radixmesh.services.common.metrics import ServiceMetrics
from radixmesh.services.worker import convert
from radixmesh.services.worker.lora import WorkerLora
from radixmesh.services.worker.metrics import WorkerMetrics
from radixmesh.services.worker.prompts import PromptTokenizer
from radixmesh.services.worker.settings import WorkerSettings
from radixmesh.services.worker.spans import trace_sample
from radixmesh.services.worker.stats import WorkerStats

log = logging.getLogger(__name__)
_CLEARED = KvEvent(0, EventKind.CLEARED)


class _SampleState:
    """What one sample (index) of a streamed request has produced so far."""

    __slots__ = ("ids", "text", "sent_input_logprobs", "last_chunk_at")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.text: list[str] = []
        self.sent_input_logprobs = False
        self.last_chunk_at = 0.0  # time.monotonic() of its last chunk with tokens (metrics only)


class _HandoffFailed(Exception):
    """The KV handoff of a decode worker's request failed (the reason is the message)."""


def _checked(room, emit: Callable, msg: worker_pb2.GenerateResponse) -> None:
    """A request whose KV handoff failed ends in ABORTED with the reason (before anything was streamed), so the
    router can retry it on another pair."""
    if room.error is not None:
        raise _HandoffFailed(room.error)
    emit(msg)


class _StreamOut:
    """A streamed request's messages, made from each delta the engine delivers: its chunk, and after a sample's
    last chunk the sample's complete message."""

    def __init__(self, servicer: "WorkerServicer", rid: str, started: float, timings: dict | None, emit: Callable):
        self.servicer, self.rid, self.started, self.timings, self.emit = servicer, rid, started, timings, emit
        self.samples: dict[int, _SampleState] = {}
        self.finished = 0

    def push(self, delta: RequestOutput) -> None:
        sv = self.servicer
        i = delta.index or 0
        state = self.samples.get(i)
        if state is None:
            state = self.samples[i] = _SampleState()
        ids = delta.output_ids
        if sv.metrics is not None and ids:
            sv._chunk_gap(state, len(ids))
        state.ids += ids
        state.text.append(delta.text)
        sv.stats.tokens_out(len(ids))
        piece = convert.chunk(delta, with_input_logprobs=not state.sent_input_logprobs)
        state.sent_input_logprobs = True
        done = delta.finish_reason is not None
        if done:  # counted before the caller may stop reading
            self.finished += 1
            sv._record_done(delta, 0)
            if self.timings is not None:
                sv._finished(i, delta, self.started, self.timings.get(i))
        self.emit(worker_pb2.GenerateResponse(request_id=self.rid, index=i, chunk=piece))
        if done:
            whole = convert.complete(state.ids, "".join(state.text), delta, with_logprobs=False)
            self.emit(worker_pb2.GenerateResponse(request_id=self.rid, index=i, complete=whole))


class _FirstTells:
    """An emit that puts where the chat's rendering leaves the thinking (a PromptThinking) on the request's first
    message, before handing each message on."""

    __slots__ = ("emit", "state")

    def __init__(self, emit: Callable, state: int) -> None:
        self.emit, self.state = emit, state

    def __call__(self, msg: worker_pb2.GenerateResponse) -> None:
        if self.state:
            msg.prompt_thinking, self.state = self.state, thinking.UNSPECIFIED
        self.emit(msg)


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, engine: Engine, settings: WorkerSettings, prefill_rooms=None, decode_rooms=None,
                 metrics: ServiceMetrics | None = None):
        self.engine = engine
        self.settings = settings
        self.draining: asyncio.Event | None = None  # GrpcService.draining: GenerateStream ends once idle
        self.prefill_rooms = prefill_rooms  # services.prefill.bootstrap.PrefillRooms in prefill mode
        self.decode_rooms = decode_rooms  # services.worker.receive.DecodeRooms in decode mode
        self.stats = WorkerStats()
        # None when metrics are off: then no timing is taken
        self.active: dict[str, list[str]] = {}  # request id -> the engine ids of its samples, while running
        self.metrics = WorkerMetrics(metrics, engine, self.stats, prefill_rooms or decode_rooms,
                                     lambda: len(self.active)) if metrics is not None else None
        self.started = time.time()
        self.lora = WorkerLora(engine)
        # text-only and chat requests; None without a tokenizer
        self.prompts = PromptTokenizer.for_engine(engine, settings.chat_template)

    async def _blocking(self, fn, *args):
        """Engine control calls wait for the scheduler thread; keep them off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # ---- generation -----------------------------------------------------------------------------------------
    async def Generate(self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        """A call per request: what `generate` emits, yielded as it comes (the caller leaving cancels it: the
        engine aborts the request and frees its KV pages)."""
        async for msg in generate_mux.messages(self.generate, request, context):
            yield msg

    async def GenerateStream(self, requests, context: grpc.aio.ServicerContext):
        """Many requests over one stream (the router's per-worker link): each runs through `generate`; the outputs
        that are ready together, usually one scheduler step's for every request of the stream, go as one message."""
        async for batch in generate_mux.serve(requests, context, self.generate, self.draining):
            yield batch

    async def generate(self, request: worker_pb2.GenerateRequest, context, emit: Callable) -> None:
        """Runs one request, handing each response message to `emit` (synchronously, in order) as it is made:
        streamed chunks straight from the engine's delivery of a step's outputs, with no task switch per token.
        Bad input raises ValueError; a failed PD handoff aborts the call with ABORTED and the reason."""
        started = time.monotonic()
        mode = self.settings.disaggregation_mode
        if self.engine.pooling is not None:
            raise ValueError("this worker serves an embedding model (--is-embedding): use Embed (/v1/embeddings, "
                             "/encode), not Generate")
        if not request.request_id:
            raise ValueError("request_id is required")
        paired = request.HasField("disaggregated_params")
        if paired != (mode != "null"):
            raise ValueError(f"this is a {mode} worker: disaggregated_params must be " +
                             ("absent" if mode == "null" else "given (the router pairs prefill and decode workers)"))
        if not request.input_ids:  # every path below (prefill, decode, colocated) reads the ids from the request
            request.input_ids[:], state = await self._prompt_ids(request)
            if state:  # a chat with reasoning_tags: the router learns where the rendering leaves the thinking
                thinking.regate(request.sampling_params, state, request.reasoning_tags.starts_inside)
                emit = _FirstTells(emit, state)
        if request.request_id in self.active:
            raise ValueError(f"request_id {request.request_id!r} is already running on this worker")
        tracing.set_attributes(request_id=request.request_id, prompt_tokens=len(request.input_ids))
        kwargs = convert.generate_kwargs(request)
        n = request.sampling_params.n if request.sampling_params.HasField("n") else 1
        if paired and n != 1:
            raise ValueError("n > 1 is not supported with prefill/decode disaggregation")
        self.active[request.request_id] = sample_rids(kwargs["rid"], n)
        try:
            if mode == "prefill":
                done = await self._prefill(request, context, started)
                done.request_id = request.request_id  # not the engine's id (the room is part of that)
                emit(done)
                return
            room = self._open_room(request) if mode == "decode" else None
            if room is not None:
                kwargs["handoff"] = room.role
                emit = functools.partial(_checked, room, emit)
            try:
                timings = self._timings(kwargs)
                if request.stream:
                    await self._stream(request.request_id, kwargs, started, timings, emit)
                else:
                    for msg in await self._whole(request.request_id, kwargs, started, timings):
                        emit(msg)
            except _HandoffFailed as e:  # before anything was streamed: the router may retry on another pair
                await context.abort(grpc.StatusCode.ABORTED, str(e))
            finally:
                if room is not None:
                    await room.close()
        finally:
            self.active.pop(request.request_id, None)

    async def _prompt_ids(self, request: worker_pb2.GenerateRequest) -> tuple[list[int], int]:
        """The prompt ids of a request without them: its chat messages rendered and tokenized, or its text
        tokenized (services.worker.prompts), off the event loop; with them, for a chat with reasoning_tags, where
        the rendering leaves the thinking (else PROMPT_THINKING_UNSPECIFIED)."""
        chat = request.chat if request.HasField("chat") else None
        if self.prompts is None:
            raise ValueError("this worker has no tokenizer (--skip-tokenizer-init): send input_ids, not "
                             + ("chat messages" if chat is not None else "text"))
        if chat is not None:
            tags = request.reasoning_tags if request.HasField("reasoning_tags") else None
            if tags is not None and not (tags.start and tags.end):
                raise ValueError("reasoning_tags needs both its start and end tags")
            with tracing.span("tokenize", chat_messages=len(chat.messages)) as span:
                ids, text = await self.prompts.chat_prompt(chat)
                if span is not None:
                    tracing.set_attribute("prompt_tokens", len(ids))
            return ids, thinking.UNSPECIFIED if tags is None else thinking.prompt_thinking(text, tags.start, tags.end)
        text = request.text
        with tracing.span("tokenize", prompt_bytes=len(text.encode("utf-8", "surrogatepass"))) as span:
            ids = await self.prompts.ids(text)
            if span is not None:
                tracing.set_attribute("prompt_tokens", len(ids))
            return ids, thinking.UNSPECIFIED

    # ---- embeddings ------------------------------------------------------------------------------------------
    async def Embed(self, request: worker_pb2.EmbedRequest, context: grpc.aio.ServicerContext):
        """Every input's pooled, normalised vector (the engine batches them); bad input is INVALID_ARGUMENT. Any
        worker of an embedding model serves it, whatever its disaggregation mode (there is no decode phase to
        hand over: in a PD mesh the router sends embeddings to prefill workers)."""
        if self.engine.pooling is None:
            raise ValueError("this worker generates text (it was not started with --is-embedding): use Generate; "
                             "embeddings need an embedding model served with --is-embedding")
        if not request.request_id:
            raise ValueError("request_id is required")
        tracing.set_attributes(request_id=request.request_id, inputs=len(request.inputs))
        results = await self.engine.async_encode(**convert.embed_kwargs(request))
        for r in results:
            self.stats.request_done(r["meta_info"]["prompt_tokens"], r["meta_info"]["cached_tokens"])
        return convert.embed_response(results)

    # ---- prefill/decode disaggregation ----------------------------------------------------------------------
    async def _prefill(self, request, context, started: float) -> worker_pb2.GenerateResponse:
        from radixmesh.services.prefill.bootstrap import HandoffFailed

        timings: dict = {}
        try:
            out = await self.prefill_rooms.generate(request, timings)
        except HandoffFailed as e:
            if self.metrics is not None:
                self.metrics.prefilled(len(request.input_ids), 0, started, ok=False, timing=timings.get(0))
            await context.abort(grpc.StatusCode.ABORTED, str(e))
        if self.metrics is not None:
            usage = out.complete.usage
            self.metrics.prefilled(usage.prompt_tokens, usage.cached_tokens, started, ok=True, timing=timings.get(0))
        return out

    def _open_room(self, request):
        from radixmesh.services.worker.receive import Overloaded

        try:
            return self.decode_rooms.start(request)
        except Overloaded as e:
            raise Exhausted(str(e)) from None

    def _timings(self, kwargs: dict) -> dict | None:
        """With metrics or tracing on: a dict the engine fills with each sample's RequestTiming (index -> timing)
        as it finishes (kwargs gets the callback)."""
        if self.metrics is None and not tracing.enabled():
            return None
        timings: dict = {}
        kwargs["on_finish"] = timings.__setitem__
        return timings

    async def _whole(self, rid: str, kwargs: dict, started: float,
                     timings: dict | None) -> list[worker_pb2.GenerateResponse]:
        try:
            results = await self.engine.async_generate_outputs(**kwargs)
        except asyncio.CancelledError:
            if self.metrics is not None:  # the caller left: its samples count as aborted
                for _ in range(kwargs["sampling_params"].get("n", 1)):
                    self.metrics.left(len(kwargs["input_ids"]), started)
            raise
        out = []
        for i, res in enumerate(results):
            self._record_done(res, len(res.output_ids))
            if timings is not None:
                self._finished(i, res, started, timings.get(i))
            done = convert.complete(res.output_ids, res.text, res, with_logprobs=True)
            out.append(worker_pb2.GenerateResponse(request_id=rid, index=i, complete=done))
        return out

    async def _stream(self, rid: str, kwargs: dict, started: float, timings: dict | None, emit: Callable) -> None:
        out = _StreamOut(self, rid, started, timings, emit)
        try:
            await self.engine.generate_into(out.push, **kwargs)
        finally:
            if self.metrics is not None:  # samples the caller left before they finished count as aborted
                for _ in range(kwargs["sampling_params"].get("n", 1) - out.finished):
                    self.metrics.left(len(kwargs["input_ids"]), started)

    def _finished(self, index: int, out: RequestOutput, started: float, timing) -> None:
        """A sample finished: metrics, and with tracing on its queue, prefill and decode spans."""
        if self.metrics is not None:
            self.metrics.finished(out, started, timing)
        if timing is not None and tracing.enabled():
            trace_sample(self.settings.disaggregation_mode, index, out.meta_info(), timing)

    def _chunk_gap(self, state: _SampleState, tokens: int) -> None:
        now = time.monotonic()
        if state.last_chunk_at:
            self.metrics.chunk_gap(now - state.last_chunk_at, tokens)
        state.last_chunk_at = now

    def _record_done(self, out: RequestOutput, new_tokens: int) -> None:
        self.stats.request_done(out.prompt_tokens, out.cached_tokens)
        self.stats.tokens_out(new_tokens)

    async def Abort(self, request, context):
        rids = self.active.get(request.request_id)
        if rids is None:
            return worker_pb2.AbortResponse(found=False)
        log.info("abort requested: %s", request.reason or "no reason given")
        for rid in rids:
            self.engine.abort_request(rid)
        return worker_pb2.AbortResponse(found=True)

    # ---- health, load, info ---------------------------------------------------------------------------------
    async def HealthCheck(self, request, context):
        timeout = request.timeout_s or self.settings.health_check_timeout_s
        if self.settings.disaggregation_mode == "prefill":
            try:
                async with asyncio.timeout(timeout):
                    load = await self._blocking(self.engine.get_load)
            except (TimeoutError, RuntimeError) as e:
                return worker_pb2.HealthCheckResponse(healthy=False, message=f"scheduler not answering: {e!r}")
            return worker_pb2.HealthCheckResponse(healthy=True, message=f"prefill worker, {load['running']} running")
        try:
            async with asyncio.timeout(timeout):
                if self.engine.pooling is not None:
                    await self.engine.async_encode(input_ids=[1])
                    return worker_pb2.HealthCheckResponse(healthy=True, message="computed one embedding")
                await self.engine.async_generate(input_ids=[1], sampling_params={"max_new_tokens": 1,
                                                                                 "temperature": 0.0})
        except TimeoutError:
            return worker_pb2.HealthCheckResponse(healthy=False, message=f"no token within {timeout:.1f} s")
        except RuntimeError as e:
            return worker_pb2.HealthCheckResponse(healthy=False, message=str(e))
        return worker_pb2.HealthCheckResponse(healthy=True, message="generated one token")

    async def GetLoads(self, request, context):
        load = await self._blocking(self.engine.get_load)
        total = load["max_total_num_tokens"]
        out = worker_pb2.GetLoadsResponse(
            num_running_requests=load["running"], num_waiting_requests=load["waiting"],
            used_kv_tokens=total - load["available_kv_tokens"], total_kv_tokens=total,
            cache_hit_rate=self.stats.cache_hit_rate, gen_throughput=self.stats.gen_throughput,
            prefill_tokens_per_s=load.get("prefill_tokens_per_s", 0.0),
            host_load_tokens_per_s=load.get("host_load_tokens_per_s", 0.0),
            storage_load_tokens_per_s=load.get("storage_load_tokens_per_s", 0.0),
            queued_prefill_tokens=load.get("queued_prefill_tokens", 0), queue_time_s=load.get("queue_time_s", 0.0))
        rooms = self.decode_rooms or self.prefill_rooms
        if self.decode_rooms is not None:
            c = self.decode_rooms.counts()
            out.num_prealloc_waiting, out.num_prealloc_rooms = c["waiting"], c["preallocated"]
            out.num_transfer_rooms = c["transferring"]
        elif self.prefill_rooms is not None:
            c = self.prefill_rooms.counts()
            out.num_prealloc_rooms, out.num_transfer_rooms = c["rooms"] - c["transferring"], c["transferring"]
        if rooms is not None:
            out.kv_transfer_gbps, out.kv_transfer_latency_ms = rooms.transfer.gbps, rooms.transfer.latency_ms
        return out

    async def _model_info(self) -> worker_pb2.GetModelInfoResponse:
        e = self.engine
        tokenizes = self.prompts is not None and e.pooling is None
        return worker_pb2.GetModelInfoResponse(
            model_path=e.args.model_path, tokenizer_path=e.args.tokenizer_path or e.args.model_path,
            is_generation=e.pooling is None, served_model_name=self.settings.served_model_name or e.args.model_path,
            max_context_length=e.args.context_length, vocab_size=e.model_config.vocab_size,
            model_type=e.model_config.architecture, eos_token_ids=sorted(e.model_config.eos_token_ids),
            preferred_sampling_params=json.dumps(e.model_config.generation_defaults or {}),
            max_total_num_tokens=e.runner.max_total_tokens,
            disaggregation_mode=self.settings.disaggregation_mode,
            bootstrap_port=self.prefill_rooms.bootstrap_port if self.prefill_rooms is not None else 0,
            tokenizes_text=tokenizes,
            chat_template_sha256=await self.prompts.template_sha256() if tokenizes else "",
            reports_prompt_thinking=tokenizes)

    async def GetModelInfo(self, request, context):
        return await self._model_info()

    async def GetServerInfo(self, request, context):
        info = await self._blocking(self.engine.get_server_info)
        info.update(disaggregation_mode=self.settings.disaggregation_mode,
                    served_model_name=self.settings.served_model_name or self.engine.args.model_path,
                    uptime_s=time.time() - self.started, cache_hit_rate=self.stats.cache_hit_rate)
        return worker_pb2.GetServerInfoResponse(server_info_json=json.dumps(info, default=str))

    async def FlushCache(self, request, context):
        ok = await self._blocking(self.engine.flush_cache)
        return worker_pb2.FlushCacheResponse(success=ok, message="" if ok else "requests are in flight; not flushed")

    async def StartProfile(self, request, context):
        try:
            trace = await self._blocking(lambda: self.engine.start_profile(
                output_dir=request.output_dir or None, num_steps=request.num_steps or None,
                activities=list(request.activities) or None, with_stack=request.with_stack,
                record_shapes=request.record_shapes))
        except ProfileError as e:
            await context.abort(_profile_status(e), str(e))
        return worker_pb2.StartProfileResponse(files=[trace])

    async def StopProfile(self, request, context):
        try:
            files = await self._blocking(self.engine.stop_profile)
        except ProfileError as e:
            await context.abort(_profile_status(e), str(e))
        return worker_pb2.StopProfileResponse(files=files)

    async def LoadLoraAdapter(self, request, context):
        return await self.lora.load(request, context)

    async def UnloadLoraAdapter(self, request, context):
        return await self.lora.unload(request, context)

    async def ListLoraAdapters(self, request, context):
        return self.lora.listing()

    async def SubscribeKvEvents(self, request, context):
        """A snapshot of the prefix cache (after a `cleared`) unless the caller is resuming within the kept events,
        then every event as it happens. A subscriber too far behind gets a fresh snapshot."""
        events = self.engine.kv_events
        if events is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this worker publishes no KV events: start it with --kv-events-config or --kvstore-url")
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        stop = events.listen(lambda: loop.call_soon_threadsafe(wake.set))
        try:
            cursor = request.after_sequence
            resume = cursor > 0
            while True:
                wake.clear()
                batch = events.since(cursor) if resume else None
                resume = True
                if batch is None:  # start (or restart) from a snapshot
                    cursor, snapshot = await self._blocking(self.engine.kv_snapshot)
                    yield convert.kv_event(_CLEARED, cursor)
                    for event in snapshot:
                        yield convert.kv_event(event, cursor)
                    continue
                for event in batch:
                    yield convert.kv_event(event)
                    cursor = event.sequence
                if not batch:
                    await wake.wait()
        finally:
            stop()


def _profile_status(e: ProfileError) -> grpc.StatusCode:
    """A profiling request refused for the worker's state (already on, not on) or for its options."""
    return grpc.StatusCode.FAILED_PRECONDITION if e.state else grpc.StatusCode.INVALID_ARGUMENT
