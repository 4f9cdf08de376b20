"""The scheduler: a coordinator over the prefill planner, the decoding set and the cache manager.

Runs on one thread (the engine's loop). Each step either prefills (new requests and the next chunk of a chunked
one; with `enable_mixed_chunk` the decoding requests ride along in the same forward) or decodes every running
request by one token, retracting requests to the waiting queue when KV pages run out.
Other threads talk to it only through `submit`, `abort` and `call`, which go through a queue.

A step is launched, then sampled, then resolved (its tokens read on the host and acted on). With overlap
scheduling the resolve of step N waits until step N+1's forward is queued on the GPU, and step N+1's sampling waits
until step N is resolved (grammar masks, penalties and min_new_tokens need step N's tokens). So the host's view of
a request lags its device state by at most one token (`Req.pending`): a request that finished at step N may ride in
step N+1, whose token for it is dropped. Anything that needs the exact state (retraction, flush) resolves first.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import torch

from radixmesh.engine import delivery
from radixmesh.engine.distributed import GroupFailed
from radixmesh.engine.profiling import ProfileError, StepProfiler
from radixmesh.engine.cache.manager import CacheManager
from radixmesh.engine.disaggregation.handoff import PrefillRole
from radixmesh.engine.request import FinishKind, FinishReason, Req, ReqStatus
from radixmesh.engine.scheduler.batch_builder import build_decode, build_extend
from radixmesh.engine.scheduler.embedding import EmbeddingSteps
from radixmesh.engine.scheduler.finish import StopStrings, check_finished, step_output
from radixmesh.engine.scheduler.handoffs import Handoffs
from radixmesh.engine.scheduler.handoff_steps import HandoffSteps
from radixmesh.engine.scheduler.in_flight import HostCopy, InFlight
from radixmesh.engine.scheduler.logprob_lists import logprob_lists, store_prompt_logprobs
from radixmesh.engine.sampling.sampler import SamplingBatch
from radixmesh.engine.scheduler.prefill_planner import NewTokenRatio, PlannerLimits, PrefillPlanner

log = logging.getLogger(__name__)
QUEUE_SCAN = 256  # waiting requests whose cached prefix load() looks up


class Scheduler:
    def __init__(self, runner, cache: CacheManager, limits: PlannerLimits, conservativeness: float,
                 enable_mixed_chunk: bool, context_len: int, tokenizer=None, reserved_decode_tokens: int = 512,
                 overlap: bool = False, pooling=None):
        self.runner = runner
        self.cache = cache
        self.ratio = NewTokenRatio(conservativeness)
        self.planner = PrefillPlanner(limits, cache, self.ratio)
        self.mixed = enable_mixed_chunk
        self.context_len = context_len
        self.stop_strings = StopStrings(tokenizer)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.handoffs = Handoffs(cache, reserved_decode_tokens)
        self.handoff_steps = HandoffSteps(self)  # prefill/decode disaggregation's steps over `handoffs`
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.overlap = overlap
        # an embedding engine (pooling: engine.pooling.Pooling): forwards pool hidden states, nothing is sampled
        self.embedding = EmbeddingSteps(pooling) if pooling is not None else None
        self.in_flight: InFlight | None = None
        self.stats = {"forward_extend": 0, "forward_decode": 0, "prefill_tokens": 0, "retractions": 0}
        self.prefill_tokens_per_s = 0.0  # measured over extend steps (EMA), for routers' time-to-first-token model
        self.queue_time_s = 0.0  # arrival to admission of new requests (EMA)
        self._stop = threading.Event()
        self._changed = False
        self.profiler = StepProfiler.from_env()  # RADIXMESH_TORCH_PROFILE: kernel timelines of chosen steps

    # ---- thread-safe entry points ---------------------------------------------------------------------------
    def submit(self, req: Req) -> None:
        self.inbox.put(("add", req))

    def abort(self, rid: str, message: str | None = None) -> None:
        """Finish `rid` with an abort (`message` tells the caller why). A decode-role request whose pages a peer
        may still write (`DecodeRole.in_transfer`) keeps them pinned until `release_kv`."""
        self.inbox.put(("abort", (rid, message)))

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run fn on the scheduler thread between steps; returns a Future of its result."""
        fut: Future = Future()
        self.inbox.put(("call", (fn, fut)))
        return fut

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(("wake", None))

    # ---- prefill/decode disaggregation (on the scheduler thread: through `call`) -----------------------------
    def deliver_kv(self, rid: str, first) -> bool:
        """A receiving decode-role request's KV has landed: it decodes after `first` (False: it left meanwhile)."""
        return self.handoff_steps.deliver_kv(rid, first)

    def release_kv(self, rid: str) -> bool:
        """Free the pages kept pinned for `rid` (handed over, or aborted while a peer may still write them); False when
        none are."""
        return self.handoff_steps.release_kv(rid)

    # ---- loop -----------------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.handoffs.has_work()
                    or self.in_flight is not None)

    def run_forever(self) -> None:
        idle = True
        while not self._stop.is_set():
            self._drain_inbox(block=idle)
            self.cache.poll()
            self.runner.heartbeat()
            idle = self._stop.is_set() or not self.has_work() or not self.step()
        if self.profiler is not None:
            self.profiler.close()  # a window still open when the engine stops

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                # copies or storage jobs in flight: come back soon to finish them
                wait = 0.002 if self.cache.hierarchy is not None and self.cache.hierarchy.busy() else 0.5
                kind, item = self.inbox.get(timeout=wait) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if kind == "add":
                if self.handoffs.is_decode(item):
                    self.handoffs.queue.append(item)
                else:
                    self.waiting.append(item)
                    if self.cache.hierarchy is not None:
                        self.cache.hierarchy.start_prefetch(item)
            elif kind == "abort":
                self._abort(*item)
            elif kind == "call":
                fn, fut = item
                try:
                    fut.set_result(fn())
                except Exception as e:  # the caller gets the error; the loop keeps serving
                    fut.set_exception(e)

    def step(self) -> bool:
        """One forward: a prefill (possibly mixed with decodes) when one can be planned, otherwise a decode.
        Returns False when nothing ran and nothing changed (the loop then waits for the inbox instead of
        spinning); a step that only retracted, aborted or resolved requests counts as a change."""
        self._changed = False
        if self.profiler is None:
            return self._step()
        profiler = self.profiler
        with profiler.step(self.stats["forward_extend"]):
            launched = self._step()
        profiler.after_step()
        if profiler.idle and self.profiler is profiler:
            self.profiler = None  # a window of num_steps ended: back to one attribute test per step
        return launched

    def _step(self) -> bool:
        if self.handoffs.queue:
            self.handoff_steps.preallocate()
        launched = self._plan_and_launch()
        self._resolve()  # the previous step, now that this one is queued behind it
        if launched is not None:
            self._sample(launched)
            if not self.overlap:
                self._resolve()
        return launched is not None or self._changed

    def _plan_and_launch(self) -> InFlight | None:
        decode_reqs: list[Req] = []
        if self.mixed and self.running and (self.waiting or self.chunked):
            decode_reqs = self._prepare_decode()
        prefill = self._plan_prefill()
        if prefill or decode_reqs:
            return self._launch(prefill + decode_reqs, extend=True)
        if self.running:
            reqs = self._prepare_decode()
            if reqs:
                self.ratio.step()
                return self._launch(reqs, extend=False)
        return None

    def _plan_prefill(self) -> list[Req]:
        reqs, used = [], 0
        if self.chunked is not None:
            if not self.planner.continue_chunked(self.chunked, self.running):
                return []
            reqs, used = [self.chunked], self.chunked.extend_len
        busy = len(self.running) + (self.chunked is not None)
        admitted = self.planner.plan(self.waiting, self.running, busy, used) if self.waiting else []
        if admitted:
            now = time.monotonic()
            for r in admitted:
                if r.retractions == 0 and not r.output_ids:
                    wait = r.queue_time_s = now - r.arrival
                    self.queue_time_s = wait if not self.queue_time_s else 0.8 * self.queue_time_s + 0.2 * wait
            taken = {id(r) for r in admitted}
            self.waiting = [r for r in self.waiting if id(r) not in taken]
        self.chunked = None
        return reqs + admitted

    def _prepare_decode(self) -> list[Req]:
        """Retract until every running request has a slot for its next token; allocate those slots. A request
        whose in-flight token reaches its length limit is left out: it finishes when that token is resolved."""
        self._retract_for_decode()
        reqs = [r for r in self.running if not self._ends_by_length(r)]
        if reqs and self.cache.alloc_decode(reqs) is None:
            raise RuntimeError("decode slot allocation failed after the memory check")
        for r in reqs:
            r.extend_len = 1
        return reqs

    def _ends_by_length(self, req: Req) -> bool:
        n_out = len(req.output_ids) + req.pending
        return bool(req.pending) and (n_out >= req.sampling.max_new_tokens
                                      or req.fill_len + req.pending >= self.context_len)

    def _decode_pages_short(self) -> bool:
        page = self.cache.page
        need = sum(1 for r in self.running if r.alloc_len % page == 0)
        return need > self.cache.available_tokens() // page

    def _retract_for_decode(self) -> None:
        if not self._decode_pages_short():
            return
        self._resolve()  # choose victims on exact state: in-flight tokens land, finished requests free pages
        if not self._decode_pages_short():
            return
        page = self.cache.page
        need = sum(1 for r in self.running if r.alloc_len % page == 0)
        # Retract the requests that lose least: fewest generated tokens, then longest prompts.
        self.running.sort(key=lambda r: (len(r.output_ids), -len(r.input_ids)), reverse=True)
        while self.running and need > self.cache.available_tokens() // page:
            victim = self.running.pop()
            if not self.running and self.chunked is None:
                # Alone with every other page evictable and still short: the pool cannot hold this request.
                self._finish(victim, FinishReason(FinishKind.ABORT, message="KV cache too small for this request"))
                return
            need -= victim.alloc_len % page == 0
            self.cache.release(victim)
            self._requeue(victim)

    def _requeue(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        req.retractions += 1
        self._changed = True
        self.stats["retractions"] += 1
        self.ratio.on_retract()
        self.waiting.append(req)
        log.info("retracted request %s after %d tokens (KV pages exhausted)", req.rid, len(req.output_ids))

    # ---- forward and results --------------------------------------------------------------------------------
    def _launch(self, reqs: list[Req], extend: bool) -> InFlight | None:
        """Queue the forward of `reqs` and advance their KV state; requests that complete their fill now join the
        running set (or, for a partial chunk, stay the chunked request)."""
        decoding = {id(r) for r in self.running}
        prev = self.in_flight
        try:
            locs = self.cache.slots_of_new_tokens(reqs)
            batch, plan = build_extend(reqs, locs, self.runner.device, prev) if extend else \
                (build_decode(reqs, locs, self.runner.device, prev), None)
            if self.profiler is not None and self.profiler.active:
                with self.profiler.forward(extend, len(reqs), sum(r.extend_len for r in reqs)):
                    logits = self._forward(batch)
            else:
                logits = self._forward(batch)
        except Exception as e:
            self._fail(reqs, e)
            return None
        flight = InFlight(reqs, [r.kv_len + r.extend_len == r.fill_len + r.pending for r in reqs],
                          [id(r) not in decoding for r in reqs], extend, plan, logits, launched=time.perf_counter(),
                          new_tokens=sum(r.extend_len for r in reqs) if extend else 0)
        self.stats["forward_extend" if extend else "forward_decode"] += 1
        for r, samples, new in zip(reqs, flight.samples, flight.prefilling):
            r.kv_len += r.extend_len
            if new:
                self.stats["prefill_tokens"] += r.extend_len
            if not samples:  # a chunk of a longer prefill: no token yet
                self.chunked = r
                self.cache.cache_unfinished(r)
            elif new and r.sampling.max_new_tokens > 0 and not isinstance(r.handoff, PrefillRole):
                self.running.append(r)  # decodes from the next step on; leaves again if its first token ends it
                self.cache.cache_unfinished(r)
        return flight

    def _forward(self, batch):
        return self.runner.forward(batch) if self.embedding is None else \
            self.runner.forward_pooled(batch, self.embedding.pooling)

    def _sample(self, flight: InFlight) -> None:
        """Sample the launched step on the device (after the previous step is resolved) and start copying the
        results to the host."""
        reqs = flight.reqs
        if self.embedding is not None:
            try:
                self.embedding.resolve(flight, lambda r: self._finish(r, FinishReason(FinishKind.LENGTH, length=0)))
            except Exception as e:
                self._fail(reqs, e)
            return
        try:
            for r, samples, new in zip(reqs, flight.samples, flight.prefilling):
                if samples and new and r.sampling.penalized and not r.finished:
                    self.runner.penalties.reset_row(r.pool_idx, r.input_ids, r.output_ids)
            sampling = SamplingBatch.build(reqs, any(r.return_logprob for r in reqs),
                                           self.runner.model_config.vocab_size, self.runner.device)
            result = self.runner.sample(flight.logits, len(reqs), sampling, flight.plan)
            self._record_penalties(reqs, flight.samples, result.next_ids)
            flight.host = HostCopy(result, self.runner.device)
        except Exception as e:
            self._fail(reqs, e)
            return
        flight.logits, flight.result = None, result
        for i, (r, samples) in enumerate(zip(reqs, flight.samples)):
            if samples:
                r.pending += 1
                flight.rows[id(r)] = i
        self.in_flight = flight

    def _resolve(self) -> None:
        """Read the in-flight step's tokens on the host and act on them (append, finish, emit, hand over)."""
        flight, self.in_flight = self.in_flight, None
        if flight is None:
            return
        try:
            result = flight.host.wait()
            next_ids = result.next_ids.tolist()
            extras = logprob_lists(result)
            if flight.plan is not None:
                store_prompt_logprobs(flight.reqs, flight.plan, result.prompt)
            if flight.new_tokens:
                rate = flight.new_tokens / max(time.perf_counter() - flight.launched, 1e-6)
                self.prefill_tokens_per_s = rate if not self.prefill_tokens_per_s else \
                    0.8 * self.prefill_tokens_per_s + 0.2 * rate
        except Exception as e:
            self._fail(flight.reqs, e)
            return
        with delivery.together():  # the step's outputs reach each caller's event loop in one wake-up
            for i, r in enumerate(flight.reqs):
                if not flight.samples[i]:
                    continue
                r.pending -= 1
                if r.finished:  # aborted, or finished by its previous token: this one is past its end
                    continue
                self._advance(r, next_ids[i], extras[i] if extras else None)

    def _fail(self, reqs: list[Req], e: Exception) -> None:
        """Abort the step's requests. A broken tensor-parallel group is fatal (raised on: the loop stops)."""
        log.exception("forward failed; aborting %d request(s): %s", len(reqs), [r.rid for r in reqs])
        for r in reqs:
            if r.finished:
                continue
            self._drop_from_sets(r)
            self._finish(r, FinishReason(FinishKind.ABORT, message=f"internal error: {e}"))
        if isinstance(e, GroupFailed):
            raise e

    def _record_penalties(self, reqs: list[Req], samples: list[bool], next_ids: torch.Tensor) -> None:
        """Count this step's token for every penalized request that samples now."""
        idx = [i for i, r in enumerate(reqs) if samples[i] and r.sampling.penalized and not r.finished
               and r.sampling.max_new_tokens > 0]
        if idx:
            dev = next_ids.device
            rows = torch.tensor([reqs[i].pool_idx for i in idx], dtype=torch.int64).to(dev, non_blocking=True)
            self.runner.penalties.record(rows, next_ids[torch.tensor(idx).to(dev, non_blocking=True)])

    def _advance(self, req: Req, token: int, logprobs: tuple | None) -> None:
        handing_over = isinstance(req.handoff, PrefillRole)
        if req.sampling.max_new_tokens == 0 and not handing_over:
            self._finish(req, FinishReason(FinishKind.LENGTH, length=0))
            return
        if req.return_logprob:
            chosen, top, by_id = logprobs
            self._append_token(req, token, chosen, top[:req.logprob.top_logprobs_num] if top else [],
                               list(zip(by_id, req.logprob.token_ids_logprob)) if req.logprob.token_ids_logprob
                               else [])
        else:
            self._append_token(req, token)
        if handing_over:
            self.handoff_steps.hand_over(req)
            return
        self._continue(req, newly_prefilled=False)

    def _append_token(self, req: Req, token: int, logprob: float | None = None, top=(), by_id=()) -> None:
        req.output_ids.append(token)
        if req.matcher is not None:
            req.matcher.accept_token(token)
        if req.return_logprob:
            req.output_logprobs.append(logprob)
            req.output_top_logprobs.append(list(top))
            req.output_token_ids_logprobs.append(list(by_id))

    def _continue(self, req: Req, newly_prefilled: bool) -> None:
        """After a request's newest token: finish it, or keep it decoding and emit the token."""
        reason = check_finished(req, self.context_len, self.stop_strings)
        if reason is not None:
            self._drop_from_sets(req)
            self._finish(req, reason)
            return
        if newly_prefilled:
            self.running.append(req)
            self.cache.cache_unfinished(req)
        if not self._emit(req):
            self._drop_from_sets(req)
            self._finish(req, FinishReason(FinishKind.ABORT, message="the client stopped listening"))

    def _drop_from_sets(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None

    def _finish(self, req: Req, reason: FinishReason) -> None:
        self.cache.release(req)
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        self._changed = True
        self._emit(req)

    def _emit(self, req: Req) -> bool:
        """Hand the request's new output to its caller. A failing sink (say, the caller's event loop is closed)
        must not take the scheduler down: it is logged and reported as False."""
        try:
            req.sink(step_output(req))
            return True
        except Exception as e:
            log.warning("request %s: dropping output, its consumer failed: %r", req.rid, e)
            return False

    # ---- prefill/decode disaggregation ----------------------------------------------------------------------
    def _abort(self, rid: str, message: str | None = None) -> None:
        reason = FinishReason(FinishKind.ABORT, message=message or "aborted by the client")
        taken = self.handoffs.take(rid)
        if taken is not None:
            where, req = taken
            if where == "receiving" and req.handoff.in_transfer:
                self.handoffs.held[rid] = req
                req.status, req.finish_reason = ReqStatus.FINISHED, reason
                self._changed = True
                self._emit(req)
            else:
                self._finish(req, reason)
            return
        # A step in flight holds requests that are in no set until it resolves (a prefill-role request's last
        # chunk: it hands over then instead of joining `running`); missed, such a request would hand over after
        # its caller's abort and release, and keep its pages pinned for good.
        in_flight = self.in_flight.reqs if self.in_flight is not None else []
        for group in (self.waiting, self.running, [self.chunked] if self.chunked else [], in_flight):
            for r in group:
                if r.rid == rid and not r.finished:
                    if r in self.waiting:
                        self.waiting.remove(r)
                    self._drop_from_sets(r)
                    self._finish(r, reason)
                    return

    # ---- introspection (call through `call`) ----------------------------------------------------------------
    def flush_cache(self) -> bool:
        self._resolve()  # a step launched after the last request finished holds no one's tokens
        if self.has_work() or self.handoffs.receiving or self.handoffs.held:
            return False
        return self.cache.flush()

    def start_profile(self, **options) -> str:
        """Open a torch.profiler window over the next steps (engine.profiling.StepProfiler.start takes `options`);
        returns the trace file it will write. ProfileError when one is open or an option is bad."""
        profiler = self.profiler or StepProfiler()
        trace = profiler.start(**options)
        self.profiler = profiler
        return trace

    def stop_profile(self) -> list[str]:
        """Close the open window; returns the files written. ProfileError when none is open."""
        if self.profiler is None:
            raise ProfileError("profiling is not on (/start_profile starts it)", state=True)
        files = self.profiler.stop()
        if self.profiler.idle:
            self.profiler = None  # back to one attribute test per step
        return files

    def load(self) -> dict:
        tiers = self.cache.tier_stats()
        # prompt tokens still to prefill: the first QUEUE_SCAN waiting requests less what the cache holds for them
        queued = sum(r.fill_len - self.cache.match_len(r.fill_ids, r.tenant) for r in self.waiting[:QUEUE_SCAN])
        queued += self.chunked.fill_len - self.chunked.kv_len if self.chunked else 0
        return {"waiting": len(self.waiting), "running": len(self.running) + (self.chunked is not None),
                "available_kv_tokens": self.cache.available_tokens(), "evicted_tokens": self.cache.evicted_tokens,
                "prefill_tokens_per_s": self.prefill_tokens_per_s, "queued_prefill_tokens": queued,
                "queue_time_s": max(self.queue_time_s, time.monotonic() - min(r.arrival for r in self.waiting))
                if self.waiting else 0.0,
                **self.cache.hit_counts(), **tiers, **self.handoffs.counts(), **self.stats}
