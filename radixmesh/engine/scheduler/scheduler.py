"""The scheduler: a coordinator over the prefill planner, the requests by state, the cache manager and a Runner.

Runs on one thread (the engine's loop). Each step either prefills (new requests and the next chunk of a chunked
one; with `enable_mixed_chunk` the decoding requests ride along in the same forward) or decodes every running
request by one token, retracting requests to the waiting queue when KV pages run out. A step follows the contract of
engine.scheduler.step: `schedule()`, `runner.execute`, `runner.sample`, `process(result)`.
Other threads talk to it only through `submit`, `abort` and `call`, which go through a queue.

With overlap scheduling step N is processed once step N+1's forward is queued on the GPU, and step N+1 is sampled
once step N is processed (grammar masks, penalties and min_new_tokens need step N's tokens). So the host's view of a
request lags its device state by at most one token (`Req.pending`): a request that finished at step N may ride in
step N+1, whose token for it is dropped. Anything that needs the exact state (retraction, flush) processes first.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import radixmesh.engine.delivery as delivery
from radixmesh.engine.batch import ForwardMode
from radixmesh.engine.cache.manager import CacheManager
from radixmesh.engine.disaggregation.handoff import PrefillRole
from radixmesh.engine.distributed import GroupFailed
from radixmesh.engine.profiling import ProfileError, StepProfiler
from radixmesh.engine.request import FinishKind, FinishReason, Req, ReqState
from radixmesh.engine.scheduler.embedding import EmbeddingSteps
from radixmesh.engine.scheduler.finish import StopStrings, check_finished, step_output
from radixmesh.engine.scheduler.handoff_steps import HandoffSteps
from radixmesh.engine.scheduler.handoffs import Handoffs
from radixmesh.engine.scheduler.logprob_lists import store_prompt_logprobs
from radixmesh.engine.scheduler.prefill_planner import NewTokenRatio, PlannerLimits, PrefillPlanner
from radixmesh.engine.scheduler.requests import Requests
from radixmesh.engine.scheduler.spec_steps import SpecSteps
from radixmesh.engine.scheduler.step import Resolved, Runner, ScheduledBatch, StepResult

log = logging.getLogger(__name__)
QUEUE_SCAN = 256  # waiting requests whose cached prefix load() looks up


class Scheduler:
    def __init__(self, runner: Runner, cache: CacheManager, limits: PlannerLimits, conservativeness: float,
                 enable_mixed_chunk: bool, context_len: int, tokenizer=None, reserved_decode_tokens: int = 512,
                 overlap: bool = False, embedding: EmbeddingSteps | None = None, spec: SpecSteps | None = None):
        """`embedding`: an embedding engine's pooling steps (its forwards pool hidden states, nothing samples).
        `spec`: speculative decoding's steps (decode steps verify drafted tokens; needs overlap off)."""
        if spec is not None and overlap:
            raise ValueError("speculative decoding runs without the overlap scheduler: a draft needs the tokens of "
                             "the step before")
        self.runner = runner
        self.cache = cache
        self.ratio = NewTokenRatio(conservativeness)
        self.planner = PrefillPlanner(limits, cache, self.ratio)
        self.mixed = enable_mixed_chunk
        self.context_len = context_len
        self.stop_strings = StopStrings(tokenizer)
        self.requests = Requests()
        self.handoffs = Handoffs(cache, self.requests, reserved_decode_tokens, limits.max_adapters)
        self.handoff_steps = HandoffSteps(self)  # prefill/decode disaggregation's steps
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.overlap = overlap
        self.embedding = embedding
        self.spec = spec
        self.in_flight: StepResult | None = None  # sampled, not processed yet (overlap)
        self.stats = {"forward_extend": 0, "forward_decode": 0, "prefill_tokens": 0, "retractions": 0}
        self.prefill_tokens_per_s = 0.0  # measured over extend steps (EMA), for routers' time-to-first-token model
        self.queue_time_s = 0.0  # arrival to admission of new requests (EMA)
        self._stop = threading.Event()
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
        return self.handoffs.release(rid)

    # ---- loop -----------------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.requests.has_work() or self.in_flight is not None

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
                decode_role = self.handoffs.is_decode(item)
                self.requests.add(item, decode_role)
                if not decode_role and self.cache.hierarchy is not None:
                    self.cache.hierarchy.start_prefetch(item)
            elif kind == "abort":
                self._abort(*item)
            elif kind == "call":
                fn, fut = item
                # a caller that gave up before its turn (an awaiting task cancelled: asyncio.wrap_future cancels the
                # Future) is not run, as an executor skips a cancelled item; once running it can no longer be
                # cancelled, so its result is always taken
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    result = fn()
                except Exception as e:  # the caller gets the error; the loop keeps serving
                    fut.set_exception(e)
                else:
                    fut.set_result(result)

    def step(self) -> bool:
        """One forward: a prefill (possibly mixed with decodes) when one can be planned, otherwise a decode.
        Returns False when nothing ran and nothing changed (the loop then waits for the inbox instead of
        spinning); a step that only retracted, aborted or processed requests counts as a change."""
        self.requests.changed = False
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
        batch = self.schedule()
        result = self._execute(batch) if batch is not None else None
        self._process_in_flight()  # the previous step, now that this one is queued behind it
        if result is not None:
            self._sample(result)
            if not self.overlap or self.embedding is not None:
                self._process_in_flight()
        return result is not None or self.requests.changed

    # ---- schedule -------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """The next forward: which requests, their new tokens (`extend_len`) and KV slots. Pre-allocates
        decode-role requests' pages first. None when nothing can run."""
        self.cache.settle()  # pages slid behind a sliding window last time: no forward reads them any more
        if self.requests.prealloc:
            self.handoff_steps.preallocate()
        reqs = self.requests
        decode_reqs: list[Req] = []
        if self.mixed and reqs.running and (reqs.waiting or reqs.chunked):
            decode_reqs = self._prepare_decode()
        prefill = self._plan_prefill()
        if prefill or decode_reqs:
            return self._batch(prefill + decode_reqs, ForwardMode.EXTEND)
        if reqs.running:
            decode_reqs = self._prepare_decode()
            if decode_reqs:
                self.ratio.step()
                if self.spec is not None:
                    return self._verify_batch(decode_reqs)
                return self._batch(decode_reqs, ForwardMode.DECODE)
        return None

    def _verify_batch(self, reqs: list[Req]) -> ScheduledBatch | None:
        """A decode step under speculation: the requests' drafts verified in one forward of a fixed number of rows
        per request (a plain decode where the batch is too large for more than one row each)."""
        try:
            drafts, draft_probs, width = self.spec.draft(reqs)
            if width == 1:
                return self._batch(reqs, ForwardMode.DECODE)
            locs = self.cache.slots_of_new_tokens(reqs)
        except Exception as e:  # a draft model's forward failed: its requests fail, the engine serves on
            self._fail(reqs, e)
            return None
        return ScheduledBatch(reqs, ForwardMode.DECODE, locs, [True] * len(reqs), [False] * len(reqs),
                              self.in_flight, drafts=drafts, draft_probs=draft_probs, width=width,
                              trees=self.spec.trees)

    def _batch(self, reqs: list[Req], mode: ForwardMode) -> ScheduledBatch | None:
        decoding = {id(r) for r in self.requests.running}
        try:
            locs = self.cache.slots_of_new_tokens(reqs)
        except Exception as e:
            self._fail(reqs, e)
            return None
        return ScheduledBatch(reqs, mode, locs, [r.kv_len + r.extend_len == r.fill_len + r.pending for r in reqs],
                              [id(r) not in decoding for r in reqs], self.in_flight,
                              sum(r.extend_len for r in reqs) if mode is ForwardMode.EXTEND else 0)

    def _plan_prefill(self) -> list[Req]:
        reqs, used = self.requests, 0
        batch: list[Req] = []
        chunked = reqs.chunked
        if chunked is not None:
            if not self.planner.continue_chunked(chunked, reqs.running):
                return []
            batch, used = [chunked], chunked.extend_len
        busy = len(reqs.running) + (chunked is not None)
        admitted = self.planner.plan(reqs.waiting, reqs.running, busy, used, chunked) if reqs.waiting else []
        if admitted:
            now = time.monotonic()
            for r in admitted:
                if r.retractions == 0 and not r.output_ids:
                    wait = r.queue_time_s = now - r.arrival
                    self.queue_time_s = wait if not self.queue_time_s else 0.8 * self.queue_time_s + 0.2 * wait
            reqs.admit(admitted)
        reqs.chunked = None
        return batch + admitted

    def _prepare_decode(self) -> list[Req]:
        """Retract until every running request has a slot for its next token; allocate those slots. A request
        whose in-flight token reaches its length limit is left out: it finishes when that token is processed."""
        self.cache.slide(self.requests.running)  # free at the next schedule (engine.cache.swa)
        self._retract_for_decode()
        reqs = [r for r in self.requests.running if not self._ends_by_length(r)]
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
        need = sum(1 for r in self.requests.running if r.alloc_len % page == 0)
        return need > self.cache.available_tokens() // page

    def _retract_for_decode(self) -> None:
        if not self._decode_pages_short():
            return
        self._process_in_flight()  # choose victims on exact state: in-flight tokens land, finished ones free pages
        if not self._decode_pages_short():
            return
        page = self.cache.page
        running = self.requests.running
        need = sum(1 for r in running if r.alloc_len % page == 0)
        # Retract the requests that lose least: fewest generated tokens, then longest prompts.
        running.sort(key=lambda r: (len(r.output_ids), -len(r.input_ids)), reverse=True)
        while running and need > self.cache.available_tokens() // page:
            victim = running[-1]
            if len(running) == 1 and self.requests.chunked is None:
                # Alone with every other page evictable and still short: the pool cannot hold this request.
                self.finish(victim, FinishReason(FinishKind.ABORT, message="KV cache too small for this request"))
                return
            need -= victim.alloc_len % page == 0
            self.cache.release(victim)
            self._requeue(victim)

    def _requeue(self, req: Req) -> None:
        req.retractions += 1
        req.penalty_row = None  # its table row is gone; counted afresh on the row it gets next
        req.draft_len = 0  # and its slots: a draft model's KV is computed afresh too
        req.draft_features = None
        self.requests.move(req, ReqState.WAITING)
        self.stats["retractions"] += 1
        self.ratio.on_retract()
        log.info("retracted request %s after %d tokens (KV pages exhausted)", req.rid, len(req.output_ids))

    # ---- execute and sample ---------------------------------------------------------------------------------
    def _execute(self, batch: ScheduledBatch) -> StepResult | None:
        """Queue the batch's forward, then advance its requests' KV state: a request that completes its fill now
        starts decoding (or, for a partial chunk, stays the chunked request)."""
        reqs = batch.reqs
        try:
            if self.profiler is not None and self.profiler.active:
                extend = batch.mode is ForwardMode.EXTEND
                with self.profiler.forward(extend, len(reqs), sum(r.extend_len for r in reqs)):
                    result = self.runner.execute(batch)
            else:
                result = self.runner.execute(batch)
        except Exception as e:
            self._fail(reqs, e)
            return None
        finally:
            batch.after = None  # read by execute only: kept, every step would hold the one before it, and so on
        if result.hidden is not None and self.spec is not None:  # (before kv_len moves: rows start there)
            self.spec.forwarded(batch, result.hidden)
            result.hidden = None
        decode = batch.mode is ForwardMode.DECODE or batch.drafts is not None  # a verify is a decode step
        self.stats["forward_decode" if decode else "forward_extend"] += 1
        for r, samples, new in zip(reqs, batch.samples, batch.prefilling):
            if new:
                self.stats["prefill_tokens"] += r.extend_len
            r.kv_len += r.extend_len
            if not samples:  # a chunk of a longer prefill: no token yet
                self.requests.chunked = r
                self.cache.cache_unfinished(r)
            elif new and r.sampling.max_new_tokens > 0 and not isinstance(r.handoff, PrefillRole):
                self.requests.move(r, ReqState.RUNNING)  # decodes from the next step on; may end with its first token
                self.cache.cache_unfinished(r)
        return result

    def _sample(self, result: StepResult) -> None:
        """Sample the launched step (every earlier step is processed) and keep it in flight until processed."""
        try:
            self.runner.sample(result)
        except Exception as e:
            self._fail(result.batch.reqs, e)
            return
        if self.embedding is None:  # an embedding step samples nothing: no token is pending
            for r, samples in zip(result.batch.reqs, result.batch.samples):
                if samples:
                    r.pending += 1
        self.in_flight = result

    # ---- process --------------------------------------------------------------------------------------------
    def _process_in_flight(self) -> None:
        result, self.in_flight = self.in_flight, None
        if result is not None:
            self.process(result)

    def process(self, result: StepResult) -> None:
        """Read a sampled step's tokens on the host and act on them: append, finish, emit, hand over."""
        batch = result.batch
        try:
            resolved = result.wait()
            if result.prompt_plan is not None:
                store_prompt_logprobs(batch.reqs, result.prompt_plan, resolved.prompt)
            if batch.new_tokens:
                rate = batch.new_tokens / max(time.perf_counter() - result.launched, 1e-6)
                self.prefill_tokens_per_s = rate if not self.prefill_tokens_per_s else \
                    0.8 * self.prefill_tokens_per_s + 0.2 * rate
            if self.embedding is not None:
                self.embedding.resolve(result, self._finish_embedded)
                return
        except Exception as e:
            self._fail(batch.reqs, e)
            return
        with delivery.together():  # the step's outputs reach each caller's event loop in one wake-up
            try:
                for i, r in enumerate(batch.reqs):
                    if not batch.samples[i]:
                        continue
                    r.pending -= 1
                    if r.finished:  # aborted, or finished by its previous token: this one is past its end
                        continue
                    if self.spec is not None:
                        if batch.drafts is not None:  # first: the rejected drafts' KV must not reach the prefix cache
                            self.spec.verified(r, len(batch.drafts[i]), resolved.tokens[i])
                        elif batch.mode is ForwardMode.DECODE:
                            self.spec.count(r)
                    self._advance(r, i, resolved)
            finally:
                if self.spec is not None:
                    self.spec.flush()

    def _finish_embedded(self, req: Req) -> None:
        self.finish(req, FinishReason(FinishKind.LENGTH, length=0))

    def _advance(self, req: Req, row: int, resolved: Resolved) -> None:
        """Take row `row`'s tokens into `req`, one by one, until it finishes or hands over."""
        handing_over = isinstance(req.handoff, PrefillRole)
        if req.sampling.max_new_tokens == 0 and not handing_over:
            self.finish(req, FinishReason(FinishKind.LENGTH, length=0))
            return
        logprobs = resolved.logprobs[row] if req.return_logprob else None
        for k, token in enumerate(resolved.tokens[row]):
            if logprobs is not None:
                chosen, top, by_id = logprobs[k]
                ids = req.logprob.token_ids_logprob
                self.append_token(req, token, chosen, top[:req.logprob.top_logprobs_num] if top else [],
                                  list(zip(by_id, ids)) if ids else [])
            else:
                self.append_token(req, token)
            if handing_over:
                self.handoff_steps.hand_over(req)
                return
            if not self.after_token(req):
                return

    # ---- what a request's new token leads to (also used by the handoff steps) -------------------------------
    def append_token(self, req: Req, token: int, logprob: float | None = None, top=(), by_id=()) -> None:
        req.output_ids.append(token)
        if req.matcher is not None:
            req.matcher.accept_token(token)
        if req.return_logprob:
            req.output_logprobs.append(logprob)
            req.output_top_logprobs.append(list(top))
            req.output_token_ids_logprobs.append(list(by_id))

    def after_token(self, req: Req) -> bool:
        """After a request's newest token: finish it, or (starting it decoding if it is not yet) emit the token.
        Returns whether it goes on decoding."""
        reason = check_finished(req, self.context_len, self.stop_strings)
        if reason is not None:
            self.finish(req, reason)
            return False
        if req.state is not ReqState.RUNNING:  # a decode-role request whose KV just landed
            self.requests.move(req, ReqState.RUNNING)
            self.cache.cache_unfinished(req)
        if not self.emit(req):
            self.finish(req, FinishReason(FinishKind.ABORT, message="the client stopped listening"))
            return False
        return True

    def finish(self, req: Req, reason: FinishReason) -> None:
        """The request is done: its pages go back to the cache manager, its caller gets the final output."""
        self.requests.move(req, ReqState.FINISHED)
        self.cache.release(req)
        if self.spec is not None:
            self.spec.finished(req)
        req.finish_reason = reason
        self.emit(req)

    def emit(self, req: Req) -> bool:
        """Hand the request's new output to its caller. A failing sink (say, the caller's event loop is closed)
        must not take the scheduler down: it is logged and reported as False."""
        try:
            req.sink(step_output(req))
            return True
        except Exception as e:
            log.warning("request %s: dropping output, its consumer failed: %r", req.rid, e)
            return False

    def _fail(self, reqs: list[Req], e: Exception) -> None:
        """Abort the step's requests. A broken tensor-parallel group is fatal (raised on: the loop stops)."""
        log.exception("forward failed; aborting %d request(s): %s", len(reqs), [r.rid for r in reqs])
        for r in reqs:
            if not r.finished:
                self.finish(r, FinishReason(FinishKind.ABORT, message=f"internal error: {e}"))
        if isinstance(e, GroupFailed):
            raise e

    def _abort(self, rid: str, message: str | None = None) -> None:
        req = self.requests.find(rid)
        if req is None or req.finished:
            return
        reason = FinishReason(FinishKind.ABORT, message=message or "aborted by the client")
        if req.state is ReqState.RECEIVING and req.handoff.in_transfer:
            # a peer may still write its pages: pinned until release_kv, so no other request gets them meanwhile
            self.requests.move(req, ReqState.HELD)
            req.finish_reason = reason
            self.emit(req)
            return
        self.finish(req, reason)

    # ---- introspection (call through `call`) ----------------------------------------------------------------
    def flush_cache(self) -> bool:
        self._process_in_flight()  # a step launched after the last request finished holds no one's tokens
        if self.has_work() or self.requests.receiving or self.requests.held:
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
        reqs = self.requests
        tiers = self.cache.tier_stats()
        # prompt tokens still to prefill: the first QUEUE_SCAN waiting requests less what the cache holds for them
        queued = sum(r.fill_len - self.cache.match_len(r.fill_ids, r.tenant) for r in reqs.waiting[:QUEUE_SCAN])
        queued += reqs.chunked.fill_len - reqs.chunked.kv_len if reqs.chunked else 0
        return {"available_kv_tokens": self.cache.available_tokens(), "evicted_tokens": self.cache.evicted_tokens,
                "prefill_tokens_per_s": self.prefill_tokens_per_s, "queued_prefill_tokens": queued,
                "queue_time_s": max(self.queue_time_s, time.monotonic() - min(r.arrival for r in reqs.waiting))
                if reqs.waiting else 0.0,
                **reqs.counts(), **self.cache.hit_counts(), **tiers, **self.stats,
                **(self.spec.stats if self.spec is not None else {})}
