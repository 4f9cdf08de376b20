"""The offline Engine API, shaped like SGLang's `sgl.Engine`.

    llm = Engine(model_path="...", page_size=16, chunked_prefill_size=512)
    out = llm.generate("Hello", {"max_new_tokens": 16, "temperature": 0})
    llm.shutdown()

The scheduler runs on its own thread, so concurrent callers (threads or asyncio tasks) share batches. Input is
validated in the caller's thread before anything is queued: bad input raises ValueError and the engine keeps serving.
Detokenization also happens on the caller's side.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Iterator

import radixmesh.engine.shared_memory as shared_memory
from radixmesh.engine.cache.build import build_cache
from radixmesh.engine.config import EngineArgs, resolve_args, torch_dtype
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.device_memory import return_to_device
from radixmesh.engine.distributed import GroupFailed, forget_group
from radixmesh.engine.delivery import (async_deltas_until_done, coalesce, deltas_until_done, mailbox_for, next_output,
                                       raise_if_stopped)
from radixmesh.engine.early_aborts import EarlyAborts
from radixmesh.engine.embeddings import EmbeddingCollector, split_inputs
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.engine.pooling import check_dimensions, pooling_of
from radixmesh.engine.outputs import RequestOutput
from radixmesh.engine.request import Req, SpecCounts, StepOutput, cache_namespace
from radixmesh.engine.results import BatchCollector, RequestSpec, normalize_batch, resume_req, resumed
from radixmesh.engine.sampling.grammar import GrammarCompilerCache
from radixmesh.engine.tokenizer_loader import load_tokenizer
from radixmesh.engine.tp_worker import rank_args, start_leader
from radixmesh.engine.scheduler.scheduler import Scheduler
from radixmesh.engine.scheduler.embedding import EmbeddingSteps
from radixmesh.engine.speculative.setup import (capture_layers, draft_config, draft_runner, refuse_head_as_model,
                                                spec_steps)
from radixmesh.engine.lora.config import parse_lora_paths
from radixmesh.engine.step_runner import StepRunner
from radixmesh.engine.scheduler.prefill_planner import PlannerLimits

log = logging.getLogger(__name__)

# How long API calls that need the scheduler thread (flush_cache, get_server_info) wait for it.
CONTROL_TIMEOUT_S = 60.0
PROFILE_WRITE_TIMEOUT_S = 600.0  # stop_profile writes the window's trace on the scheduler thread: long windows are big


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any):
        if model_path is None:
            raise TypeError("Engine needs model_path")
        logging.basicConfig(level=kwargs.get("log_level", "info").upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.model_config = ModelConfig.from_path(model_path, kwargs.get("revision"))
        refuse_head_as_model(self.model_config)
        self.args = resolve_args(EngineArgs.from_kwargs(model_path, **kwargs), self.model_config)
        # an embedding engine's pooling (engine.pooling); None: a generation engine
        self.pooling = pooling_of(self.model_config.path) if self.args.is_embedding else None
        self.tokenizer = None if self.args.skip_tokenizer_init else load_tokenizer(self.args.tokenizer_path,
                                                                                   revision=self.args.revision)
        # tensor parallelism: this node's other ranks run in processes of their own (engine.tp_worker)
        tp, self._followers = start_leader(self.args)
        self._crash: BaseException | None = None
        if self._followers is not None:
            self._followers.watch(self._rank_exited)
        self.runner = self.draft_runner = None
        made = shared_memory.created()
        try:
            draft = draft_config(self.args, self.model_config)
            draft_kv = draft[1].kv_bytes_per_token(torch_dtype(draft[0].kv_cache_dtype)) if draft else 0
            self.runner = ModelRunner(rank_args(self.args, 0) if self._followers else self.args, self.model_config, tp,
                                      extra_kv_bytes_per_token=draft_kv, capture_layers=capture_layers(self.args, draft, self.model_config))
            if draft is not None:
                self.draft_runner = draft_runner(self.args.speculative_algorithm, draft, self.runner)
            for name, path in parse_lora_paths(self.args.lora_paths):
                self.runner.lora.load(name, path)
            self.cache = build_cache(self.args, self.model_config, self.runner)
            if self.cache.hierarchy is not None and self._followers is not None:
                from radixmesh.engine.cache.journaled_mover import JournaledMover

                hierarchy = self.cache.hierarchy
                hierarchy.mover = JournaledMover(hierarchy.mover, self.runner.journal, self.runner.sync_followers)
                if hierarchy.io is not None:  # the store reads and frees every rank's host pages
                    hierarchy.sync_host = hierarchy.mover.sync
                self.runner.publish_setup(hierarchy.host)
            self.runner.kv_loads = self.cache.issue_loads
        except BaseException:
            shared_memory.unlink(shared_memory.created() - made)  # no file of a failed start left in /dev/shm
            self._stop_followers(graceful=self.runner is not None)
            if self.draft_runner is not None:
                self.draft_runner.close()
            if self.runner is not None:
                self.runner.close()
                if self.runner.device.type == "cuda":
                    return_to_device()
            raise
        limits = PlannerLimits(self.args.max_prefill_tokens, self.args.chunked_prefill_size,
                               self.runner.max_running_requests, self.args.page_size, self.args.schedule_policy,
                               self.args.max_loras_per_batch if self.args.enable_lora else 0)
        self.scheduler = Scheduler(StepRunner(self.runner, self.pooling), self.cache, limits,
                                   self.args.schedule_conservativeness,
                                   self.args.enable_mixed_chunk, self.args.context_length,
                                   # its own copy: a fast tokenizer must not be used by two threads at once
                                   load_tokenizer(self.args.tokenizer_path, revision=self.args.revision)
                                   if self.tokenizer else None,
                                   self.args.num_reserved_decode_tokens,
                                   overlap=not self.args.disable_overlap_schedule,
                                   embedding=EmbeddingSteps(self.pooling) if self.pooling is not None else None,
                                   spec=spec_steps(self.args, self.cache, self.runner, self.draft_runner))
        if self.runner.lora is not None:  # a finished request lets go of its adapter (unload waits for none)
            lora = self.runner.lora
            reqs = self.scheduler.requests
            reqs.on_finished = lambda r: lora.release(r.lora_slot) if r.lora is not None else None
            # a device slot is freed for another adapter only where no admitted request uses it
            lora.admitted = lambda: [r.lora_slot for group in (reqs.running, reqs.prefilling) for r in group]
        if self.cache.hierarchy is not None:
            self.cache.hierarchy.prefill_tokens_per_s = lambda: self.scheduler.prefill_tokens_per_s
        self._grammars: GrammarCompilerCache | None = None
        # Async callers validate, tokenize and compile grammars here, keeping their event loop free.
        self._prep = ThreadPoolExecutor(max_workers=4, thread_name_prefix="radixmesh-prep")
        self._grammar_lock = threading.Lock()
        self._early_aborts = EarlyAborts()
        self._thread = threading.Thread(target=self._loop, name="radixmesh-scheduler", daemon=True)
        self._thread.start()

    def _rank_exited(self, reason: str) -> None:
        """A follower process of this node died: the group is broken, so the engine is (callers get `reason`)."""
        if self._crash is None:
            log.error("%s: the engine stops", reason)
            self._crash = GroupFailed(reason)

    def _loop(self) -> None:
        try:
            self.scheduler.run_forever()
        except BaseException as e:  # surfaced to every caller instead of hanging them
            log.exception("scheduler loop crashed")
            self._crash = e

    # ---- LoRA adapters ----------------------------------------------------------------------------------------
    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Load the peft adapter at `lora_path` as `lora_name` (ValueError, nothing loaded, when it cannot be),
        between two steps of the scheduler."""
        self._lora_manager()  # refused at once without enable_lora
        self.scheduler.call(lambda: self._lora_manager().load(lora_name, lora_path)).result()

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Unload adapter `lora_name` (ValueError while unfinished requests use it)."""
        self.scheduler.call(lambda: self._lora_manager().unload(lora_name)).result()

    def lora_adapters(self) -> list[str]:
        """The names of the loaded adapters."""
        return self.runner.lora.names() if self.runner.lora is not None else []

    def _lora_manager(self):
        if self.runner.lora is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora (SGLang's --enable-lora)")
        return self.runner.lora

    # ---- request construction -------------------------------------------------------------------------------
    def _make_req(self, spec: RequestSpec, sink: Callable[[StepOutput], None], handoff=None, tenant: str = "") -> Req:
        stop = set(spec.params.stop_token_ids)
        if not spec.params.ignore_eos:
            stop |= self.model_config.eos_token_ids
        matcher = self._grammars.matcher(spec.grammar, spec.params) if spec.grammar is not None else None
        namespace = cache_namespace(tenant, spec.lora)  # an adapter's KV is its own
        params = spec.params
        if self.args.enable_deterministic_inference and params.sampling_seed is None:
            # an unseeded sample draws as if seeded with random_seed (+ its index among the prompt's n): the engine's
            # generator would hand it the draws of whatever batch order it lands in
            params = dataclasses.replace(params, sampling_seed=self.args.random_seed + spec.sample_index)
        req = Req(rid=spec.rid, input_ids=spec.input_ids, sampling=params, stop_ids=frozenset(stop),
                  sink=sink, logprob=spec.logprob, matcher=matcher, arrival=time.monotonic(), handoff=handoff,
                  tenant=namespace, spec=SpecCounts() if self.args.speculative_algorithm else None, lora=spec.lora)
        if spec.resume_ids:
            resume_req(req, spec.resume_ids)
        if spec.lora is not None:  # last: held from here until the request finishes (Requests.on_finished)
            req.lora_slot = self.runner.lora.acquire(spec.lora)
        return req

    def _compile_grammar(self, params):
        """Compile (or fetch from the cache) a structured-output constraint, in the caller's thread."""
        with self._grammar_lock:
            if self._grammars is None:  # built on first use: the vocabulary scan takes a moment
                self._grammars = GrammarCompilerCache(self.tokenizer, self.model_config.vocab_size,
                                                      sorted(self.model_config.eos_token_ids))
        return self._grammars.compile(params)

    def _specs(self, prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num,
               token_ids_logprob, return_text_in_logprobs, rid=None, lora_path=None) -> tuple[list[RequestSpec], bool]:
        self._check_alive()
        if self.pooling is not None:
            raise ValueError("this engine serves an embedding model (is_embedding / --is-embedding): it computes "
                             "embeddings with encode, it does not generate text")
        specs, is_batch = normalize_batch(prompt, sampling_params, input_ids, return_logprob,
                               logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                               token_ids_logprob=token_ids_logprob, return_text_in_logprobs=return_text_in_logprobs,
                               tokenizer=self.tokenizer, compile_grammar=self._compile_grammar
                               if self.tokenizer is not None and self.args.grammar_backend == "xgrammar" else None,
                               vocab_size=self.model_config.vocab_size, context_len=self.args.context_length,
                               max_total_tokens=self.runner.max_total_tokens, rid=rid,
                               sampling_defaults=self.model_config.generation_defaults
                               if self.args.sampling_defaults == "model" else None)
        return self._with_lora(specs, lora_path), is_batch

    def _with_lora(self, specs: list[RequestSpec], lora_path) -> list[RequestSpec]:
        """Each spec's adapter name from `lora_path` (one for all, or one per prompt: a prompt's n samples share
        it), checked against the loaded adapters."""
        if lora_path is None or (not isinstance(lora_path, str) and all(n is None for n in lora_path)):
            return specs
        if self.runner.lora is None:
            raise ValueError("lora_path needs an engine started with enable_lora (SGLang's --enable-lora)")
        prompts = sum(s.sample_index == 0 for s in specs)
        names = [lora_path] * prompts if isinstance(lora_path, str) else list(lora_path)
        if len(names) != prompts:
            raise ValueError(f"lora_path lists {len(names)} adapters for {prompts} prompts")
        for name in set(names) - {None}:
            self.runner.lora.slot(name)  # ValueError for an adapter not loaded
        out, at = [], -1
        for spec in specs:
            at += spec.sample_index == 0
            out.append(dataclasses.replace(spec, lora=names[at]))
        return out

    def _shared_prefills(self, specs: list[RequestSpec]) -> list[RequestSpec]:
        """Prompts with n > 1 are prefilled once, by a request without output tokens that leaves the prompt in the
        prefix cache; the n samples then start from the cached prompt. Without the cache each sample prefills."""
        if self.cache.tree is None:
            return []
        return [s for s in specs if s.params.n > 1 and s.sample_index == 0]

    @property
    def alive(self) -> bool:
        """False once the scheduler thread has crashed or stopped."""
        return self._crash is None and self._thread.is_alive()

    def _check_alive(self) -> None:
        if self._crash is not None:
            raise RuntimeError(f"engine scheduler crashed: {self._crash!r}")
        if not self._thread.is_alive():
            raise RuntimeError("engine is shut down")

    def _next_output(self, inbox: queue.SimpleQueue):
        return next_output(inbox, lambda: self.alive, self._check_alive)

    async def _raise_if_stopped(self, pending: Callable[[], bool]) -> None:
        await raise_if_stopped(lambda: self.alive, self._check_alive, pending)

    # ---- synchronous API ------------------------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool | list[bool] = False,
                 logprob_start_len: int | list[int] | None = None, top_logprobs_num: int | list[int] | None = None,
                 token_ids_logprob: list[int] | list[list[int]] | None = None, return_text_in_logprobs: bool = False,
                 stream: bool = False, rid: str | list[str] | None = None, tenant: str = "",
                 lora_path: str | list[str | None] | None = None):
        """One request or a list. Returns a dict (or list of dicts) with `text`, `output_ids`, `meta_info`; with
        stream=True an iterator of dicts as the output grows: cumulative, or only what is new when the engine runs
        with stream_output=True (SGLang's --stream-output); `index` says which request of a list it belongs to.
        `rid` names the request(s) for abort_request (n > 1 samples get `<rid>-<index>`). `tenant` is the prefix
        cache namespace: cached KV is only reused between requests of the same tenant (default: one shared).
        `lora_path`: the LoRA adapter (its name; one for all, or one per prompt, None for the base model) of an
        engine started with enable_lora."""
        _check_tenant(tenant)
        specs, is_batch = self._specs(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                      top_logprobs_num, token_ids_logprob, return_text_in_logprobs, rid, lora_path)
        warm = self._shared_prefills(specs)
        if warm:
            self.generate(input_ids=[s.input_ids for s in warm], sampling_params=[{"max_new_tokens": 0}] * len(warm),
                          tenant=tenant, lora_path=[s.lora for s in warm])
        collector = BatchCollector(specs, self.tokenizer, stream, is_batch, self.args.stream_output,
                                   interval=self.args.stream_interval)
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._submit(specs, lambda i: (lambda out: inbox.put((i, out))), None, tenant)
        deltas = self._receive_sync(collector, inbox)
        if stream:
            return deltas_until_done(deltas, self._abort_all(specs))
        try:
            for _ in deltas:
                pass
        finally:  # interrupted (KeyboardInterrupt, an error in this thread): free what is still running
            if not collector.done:
                self._abort_all(specs)()
        return collector.results if is_batch else collector.results[0]

    def _submit(self, specs: list[RequestSpec], make_sink, handoff=None, tenant: str = "") -> None:
        if handoff is not None and len(specs) != 1:
            raise ValueError("a disaggregated (prefill/decode) request must be one prompt with n = 1")
        if handoff is not None and self.cache.hybrid is not None:
            raise ValueError("this engine keeps its sliding-window layers' KV in a pool of their own (hybrid SWA "
                             "memory, engine.cache.swa_pool), which prefill/decode transfers do not carry yet: start "
                             "the prefill and decode workers with --disable-hybrid-swa-memory")
        if handoff is not None and self.args.tp_size > 1 and self.runner.kv_channel is None:
            raise ValueError("with tp_size > 1 a disaggregated request's KV moves through every rank's mirror: "
                             "create them with Engine.kv_mirror() first")
        for i, spec in enumerate(specs):
            self.scheduler.submit(self._make_req(spec, make_sink(i), handoff, tenant))
        for rid, message in self._early_aborts.take([s.rid for s in specs]):
            self.scheduler.abort(rid, message)

    def _abort_all(self, specs: list[RequestSpec]) -> Callable[[], None]:
        return lambda: [self.scheduler.abort(s.rid) for s in specs]

    def _receive_sync(self, collector: BatchCollector, inbox: queue.SimpleQueue) -> Iterator[RequestOutput | None]:
        while not collector.done:
            got = self._next_output(inbox)
            if got is not None:
                yield collector.record(*got)

    # ---- asynchronous API -----------------------------------------------------------------------------------
    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                             logprob_start_len=None, top_logprobs_num=None, token_ids_logprob=None,
                             return_text_in_logprobs: bool = False, stream: bool = False, rid=None, handoff=None,
                             tenant: str = "", on_finish=None, resume_ids=None, resume_text_chars=None,
                             lora_path=None):
        """As `generate`; with stream=True returns an async iterator of incremental dicts. `handoff` (one prompt,
        n = 1) makes it one side of a prefill/decode pair: see engine.disaggregation.handoff. `on_finish(index,
        engine.results.RequestTiming)` is called in the caller's event loop as each request of the call finishes
        (for latency metrics; it must be quick and not raise)."""
        collector, deltas, abort = await self._start_async(
            stream, prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num,
            token_ids_logprob, return_text_in_logprobs, rid, handoff, tenant, on_finish, resume_ids, resume_text_chars,
            lora_path)
        if stream:
            return async_deltas_until_done(deltas, abort)
        await _drain(deltas, collector, abort)
        return collector.results if collector.is_batch else collector.results[0]

    async def async_generate_outputs(self, **kwargs) -> list[RequestOutput]:
        """As `async_generate(stream=False)`, with its keyword arguments but `stream`: every request's final output,
        typed (engine.outputs.RequestOutput) and always in a list, for servers that make their own messages of them."""
        collector, deltas, abort = await self._start_async(False, **kwargs)
        await _drain(deltas, collector, abort)
        return collector.outputs

    async def _start_async(self, stream: bool, prompt=None, sampling_params=None, input_ids=None,
                           return_logprob=False, logprob_start_len=None, top_logprobs_num=None,
                           token_ids_logprob=None, return_text_in_logprobs: bool = False, rid=None, handoff=None,
                           tenant: str = "", on_finish=None, resume_ids=None, resume_text_chars=None,
                           lora_path=None):
        """Validates and submits an async call. Returns its collector, its outputs as they are recorded (an async
        iterator) and the function that aborts its requests."""
        with self._early_aborts.preparing(rid):  # an abort before the submit is not lost
            specs, is_batch = await self._prepare(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                                  top_logprobs_num, token_ids_logprob, return_text_in_logprobs, rid,
                                                  handoff, tenant, resume_ids, resume_text_chars, lora_path)
            collector = BatchCollector(specs, self.tokenizer, stream, is_batch, self.args.stream_output, on_finish,
                                       self.args.stream_interval)
            inbox: asyncio.Queue = asyncio.Queue()
            mailbox = mailbox_for(asyncio.get_running_loop())
            self._submit(specs, lambda i: (lambda out: mailbox.put(inbox.put_nowait, (i, out))), handoff, tenant)
        # If the loop closes first, the mailbox raises in the scheduler thread, which then aborts the request.
        return collector, self._receive_async(collector, inbox), self._abort_all(specs)

    async def generate_into(self, on_delta: Callable[[RequestOutput], None], prompt=None, sampling_params=None,
                            input_ids=None, return_logprob=False, logprob_start_len=None, top_logprobs_num=None,
                            token_ids_logprob=None, return_text_in_logprobs: bool = False, rid=None, handoff=None,
                            tenant: str = "", on_finish=None, resume_ids=None, resume_text_chars=None,
                            lora_path=None) -> None:
        """As `async_generate(stream=True)`, but each delta, typed (engine.outputs.RequestOutput, its `index` set in
        a batch), is handed to `on_delta(delta)` where the event loop receives the scheduler's outputs: no task wakes
        up per token, which is what a server streaming many requests at once spends most of its event loop on.
        Returns when every request of the call has finished. An exception from `on_delta` ends the call (its
        requests are aborted) and is raised here; so is a cancellation. `on_delta` is never called after this
        returns or raises."""
        with self._early_aborts.preparing(rid):  # an abort before the submit is not lost
            specs, is_batch = await self._prepare(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                                  top_logprobs_num, token_ids_logprob, return_text_in_logprobs, rid,
                                                  handoff, tenant, resume_ids, resume_text_chars, lora_path)
            collector = BatchCollector(specs, self.tokenizer, True, is_batch, self.args.stream_output, on_finish,
                                       self.args.stream_interval)
            loop = asyncio.get_running_loop()
            done: asyncio.Future = loop.create_future()

            def deliver(item: tuple[int, StepOutput]) -> None:
                if done.done():  # ended (an error, a cancellation): outputs still on their way are dropped
                    return
                try:
                    delta = collector.record(*item)
                    if delta is not None:
                        on_delta(delta)
                except BaseException as e:  # noqa: BLE001 - ends this call, raised in its task
                    done.set_exception(e)
                    return
                if collector.done:
                    done.set_result(None)

            mailbox = mailbox_for(loop)
            self._submit(specs, lambda i: (lambda out: mailbox.put(deliver, (i, out))), handoff, tenant)
        try:
            while not done.done():
                try:  # one timer a second per call, not one per token as a queue read with a timeout would be
                    async with asyncio.timeout(1.0):
                        await asyncio.shield(done)
                except TimeoutError:
                    await self._raise_if_stopped(done.done)
            done.result()
        finally:
            if not done.done():  # cancelled, or the scheduler died: nothing more is delivered
                done.cancel()
            if not collector.done:
                self._abort_all(specs)()

    async def _prepare(self, prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num,
                       token_ids_logprob, return_text_in_logprobs, rid, handoff, tenant: str, resume_ids=None,
                       resume_text_chars=None, lora_path=None) -> tuple[list[RequestSpec], bool]:
        """Validation, tokenization and grammars on the prep threads; n > 1 prompts prefilled once first.
        `resume_ids`: a migrated request's tokens so far, of whose text the client has `resume_text_chars`
        characters (engine.results.resumed)."""
        _check_tenant(tenant)
        loop = asyncio.get_running_loop()
        specs, is_batch = await loop.run_in_executor(self._prep, functools.partial(
            self._specs, prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num,
            token_ids_logprob, return_text_in_logprobs, rid, lora_path))
        if resume_ids:
            specs = resumed(specs, resume_ids, self.model_config.vocab_size, resume_text_chars)
        warm = self._shared_prefills(specs) if handoff is None else []
        if warm:
            await self.async_generate(input_ids=[s.input_ids for s in warm],
                                      sampling_params=[{"max_new_tokens": 0}] * len(warm), tenant=tenant,
                                      lora_path=[s.lora for s in warm])
        return specs, is_batch

    async def _receive_async(self, collector: BatchCollector, inbox: asyncio.Queue
                             ) -> AsyncIterator[RequestOutput | None]:
        while not collector.done:
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 a nested wait_for can swallow the caller's cancel.
                async with asyncio.timeout(1.0):
                    i, out = await inbox.get()
            except TimeoutError:
                await self._raise_if_stopped(lambda: not inbox.empty())
                continue
            arrived = [(i, out)]
            while not inbox.empty():
                arrived.append(inbox.get_nowait())
            for i, out in coalesce(arrived):
                yield collector.record(i, out)

    # ---- embeddings (is_embedding engines) -------------------------------------------------------------------
    def _embed_specs(self, prompt, input_ids, dimensions, rid) -> tuple[list[RequestSpec], bool, int | None]:
        self._check_alive()
        if self.pooling is None:
            raise ValueError("this engine generates text: start it with is_embedding=True (--is-embedding) to "
                             "compute embeddings")
        dimensions = check_dimensions(dimensions, self.model_config)
        prompt, input_ids = split_inputs(prompt, input_ids)
        specs, is_batch = normalize_batch(prompt, {"max_new_tokens": 0}, input_ids, False, tokenizer=self.tokenizer,
                                          vocab_size=self.model_config.vocab_size,
                                          context_len=self.args.context_length,
                                          max_total_tokens=self.runner.max_total_tokens, rid=rid)
        return specs, is_batch, dimensions

    def encode(self, prompt: str | list[str] | list[int] | list[list[int]] | None = None,
               input_ids: list[int] | list[list[int]] | None = None, dimensions: int | None = None,
               rid: str | list[str] | None = None, tenant: str = ""):
        """SGLang's Engine.encode: text or token ids (one prompt, or a list) -> {"embedding": [float, ...],
        "meta_info": {"id", "prompt_tokens", "cached_tokens"}} (a list of them for a list of prompts). Each vector is
        the model's pooled final hidden states, L2-normalised (engine.pooling); `dimensions` keeps its first values,
        normalised again (Matryoshka models only). Bad input raises ValueError before anything is queued."""
        _check_tenant(tenant)
        specs, is_batch, dimensions = self._embed_specs(prompt, input_ids, dimensions, rid)
        collector = EmbeddingCollector(specs, dimensions)
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._submit(specs, lambda i: (lambda out: inbox.put((i, out))), None, tenant)
        try:
            while not collector.done:
                got = self._next_output(inbox)
                if got is not None:
                    collector.record(*got)
        finally:  # interrupted: free what is still running
            if not collector.done:
                self._abort_all(specs)()
        results = collector.results()
        return results if is_batch else results[0]

    async def async_encode(self, prompt=None, input_ids=None, dimensions: int | None = None, rid=None,
                           tenant: str = ""):
        """As `encode`, from an event loop (validation and tokenization on the prep threads)."""
        _check_tenant(tenant)
        loop = asyncio.get_running_loop()
        specs, is_batch, dimensions = await loop.run_in_executor(self._prep, functools.partial(
            self._embed_specs, prompt, input_ids, dimensions, rid))
        collector = EmbeddingCollector(specs, dimensions)
        inbox: asyncio.Queue = asyncio.Queue()
        mailbox = mailbox_for(loop)
        self._submit(specs, lambda i: (lambda out: mailbox.put(inbox.put_nowait, (i, out))), None, tenant)
        try:
            while not collector.done:
                try:
                    async with asyncio.timeout(1.0):
                        collector.record(*await inbox.get())
                except TimeoutError:
                    await self._raise_if_stopped(lambda: not inbox.empty())
        finally:  # cancelled (a timeout, a dropped client): free what is still running
            if not collector.done:
                self._abort_all(specs)()
        results = collector.results()
        return results if is_batch else results[0]

    # ---- control --------------------------------------------------------------------------------------------
    def _control(self, fn: Callable[[], Any], timeout_s: float = CONTROL_TIMEOUT_S) -> Any:
        self._check_alive()
        return self.scheduler.call(fn).result(timeout=timeout_s)

    def kv_mirror(self, staged: bool | None = None, shared: bool = False):
        """The host memory a prefill/decode transfer moves this engine's KV pages through, with its staging copies
        (engine.disaggregation.mirror); under tensor parallelism, every rank's. Made once per engine. `shared`: in
        shared-memory files another process of this host maps (the shm transfer backend; one rank only)."""
        return self._control(lambda: self.runner.kv_mirror(staged, shared))

    def flush_cache(self) -> bool:
        """Drop the prefix cache. Returns False (and keeps it) while requests are in flight."""
        return self._control(self.scheduler.flush_cache)

    def start_profile(self, output_dir: str | None = None, num_steps: int | None = None,
                      activities: list[str] | None = None, with_stack: bool = False,
                      record_shapes: bool = False) -> str:
        """SGLang's start_profile: torch.profiler over the scheduler's next steps (CPU and GPU activity by default),
        for `num_steps` steps or until `stop_profile`. The Chrome trace goes to `output_dir` (default:
        $SGLANG_TORCH_PROFILER_DIR, else /tmp) as `<unix time>-<pid>-TP-0.trace.json.gz`; returns that path.
        engine.profiling.ProfileError (a ValueError) when a window is already open or an option is bad."""
        return self._control(lambda: self.scheduler.start_profile(
            output_dir=output_dir, num_steps=num_steps, activities=activities, with_stack=with_stack,
            record_shapes=record_shapes))

    def stop_profile(self) -> list[str]:
        """Close the window `start_profile` opened and write it; returns the files written (the trace, and a table
        of time by kernel beside it). engine.profiling.ProfileError when none is open."""
        return self._control(self.scheduler.stop_profile, PROFILE_WRITE_TIMEOUT_S)

    def get_server_info(self) -> dict:
        load = self._control(self.scheduler.load)
        info = dataclasses.asdict(self.args)
        info.update(max_total_num_tokens=self.runner.max_total_tokens,
                    max_running_requests=self.runner.max_running_requests,
                    available_kv_tokens=load["available_kv_tokens"], internal_states=[load])
        if self.runner.expert_counts is not None:
            info["expert_distribution"] = self.expert_distribution()
        return info

    def expert_distribution(self, timeout_s: float = CONTROL_TIMEOUT_S) -> dict:
        """With enable_expert_distribution_metrics: {"layers": [index of each mixture-of-experts layer],
        "tokens": [[tokens routed to each expert] per layer]} since the engine started (a token counts once per
        expert of its top-k, in every forward it takes part in)."""
        counts = self.runner.expert_counts
        if counts is None:
            raise ValueError("start the engine with enable_expert_distribution_metrics=True "
                             "(--enable-expert-distribution-metrics) to count the tokens routed to each expert")
        self._check_alive()
        tokens = self.scheduler.call(lambda: [c.tolist() for c in counts.values()]).result(timeout=timeout_s)
        return {"layers": list(counts), "tokens": tokens}

    def get_load(self, timeout_s: float = CONTROL_TIMEOUT_S) -> dict:
        """The scheduler's gauges (waiting, running, available_kv_tokens, ...), its monotonic counters
        (prefill_tokens, forward_extend, evicted_tokens, lookup_tokens, device_hit_tokens, ...) and the pool size.
        Waits up to `timeout_s` for the scheduler thread (TimeoutError past it)."""
        self._check_alive()
        load = self.scheduler.call(self.scheduler.load).result(timeout=timeout_s)
        load["max_total_num_tokens"] = self.runner.max_total_tokens
        return load

    @property
    def kv_events(self):
        """The engine's KV event log (engine.cache.kv_events.KvEventLog), or None without --kv-events-config."""
        return self.cache.events

    def kv_snapshot(self) -> tuple[int, list]:
        """The whole prefix cache as STORED KV events, and the event sequence they are current at."""
        return self._control(self.cache.kv_snapshot)

    def abort_request(self, rid: str, message: str | None = None) -> None:
        """Abort a request; `message` is what its caller is told. See Scheduler.abort for pinned pages."""
        self._early_aborts.note(rid, message)
        self.scheduler.abort(rid, message)

    # ---- prefill/decode disaggregation (engine.disaggregation.handoff) ------------------------------------------
    def deliver_kv(self, rid: str, first) -> Future:
        """A decode-role request's pages are filled: decode on from `first` (a FirstToken). Future of whether the
        request was still waiting for them."""
        self._check_alive()
        return self.scheduler.call(lambda: self.scheduler.deliver_kv(rid, first))

    def release_kv(self, rid: str) -> Future:
        """Unpin the pages of a request handed over (prefill role) or aborted while in transfer (decode role)."""
        return self.scheduler.call(lambda: self.scheduler.release_kv(rid))

    def shutdown(self) -> None:
        """Stop the scheduler and this node's tensor-parallel ranks, and give the device memory back (the KV pool,
        the weights, CUDA graphs and workspaces), so another Engine in this process has the whole device."""
        if self._thread.is_alive():
            self.scheduler.stop()
            # a broken group's scheduler may be waiting out a collective's timeout: it is not waited for
            self._thread.join(timeout=30 if self._crash is None else 1)
        self._stop_followers(graceful=self._crash is None and not self._thread.is_alive())
        self._prep.shutdown(wait=False)
        if self.cache.hierarchy is not None:
            self.cache.hierarchy.close()
        if self._thread.is_alive():
            log.warning("the scheduler thread did not stop within 30 s: its device memory stays in use")
            return
        if self._crash is not None:  # its traceback's frames would keep the step's tensors alive
            self._crash = self._crash.with_traceback(None)
        if self.draft_runner is not None:
            self.draft_runner.close()
        self.runner.close()
        if self.runner.device.type == "cuda":
            return_to_device()

    def _stop_followers(self, graceful: bool) -> None:
        """This node's other tensor-parallel ranks: told to stop when the group still works, killed otherwise."""
        if self._followers is None:
            return
        self._followers.stopping = True  # their exit from here on is asked for
        if graceful:
            try:
                self.runner.stop_followers()
            except Exception as e:  # noqa: BLE001 - a broken group: the followers are killed below
                log.warning("could not tell the tensor parallel ranks to stop: %r", e)
        self._followers.join(timeout=30 if graceful else 1)
        if self.runner is not None:
            self.runner.tp.close()
        else:  # the runner failed to build: the group it may have formed goes too (a later engine forms its own)
            forget_group()
        self._followers = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


async def _drain(deltas: AsyncIterator[RequestOutput | None], collector: BatchCollector,
                 abort: Callable[[], None]) -> None:
    """Records a call's outputs until its requests finish; cancelled (a timeout, a dropped client), frees what is
    still running."""
    try:
        async for _ in deltas:
            pass
    finally:
        if not collector.done:
            abort()


def _check_tenant(tenant: str) -> None:
    if not isinstance(tenant, str) or len(tenant) > 64:
        raise ValueError(f"tenant must be a string of at most 64 characters, got {tenant!r}")
