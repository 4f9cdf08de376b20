"""The scheduler's steps for prefill/decode disaggregation (a collaborator of `Scheduler`, engine.scheduler.scheduler;
the state lives in its `handoffs`, engine.scheduler.handoffs): pre-allocating a decode-role request's pages and telling
its caller, handing a prefill-role request's KV and first token to its caller, and starting a decode-role request
once its KV has landed."""

from __future__ import annotations

import logging

from radixmesh.engine.disaggregation.handoff import FirstToken
from radixmesh.engine.request import FinishKind, FinishReason, Req, ReqStatus

log = logging.getLogger(__name__)


class HandoffSteps:
    """A collaborator of one Scheduler (passed in): reads its handoffs, running and runner, sets its _changed, and
    calls its _finish, _emit, _drop_from_sets, _append_token and _continue. Runs on the scheduler's thread."""

    def __init__(self, scheduler):
        self.s = scheduler
        self.handoffs = scheduler.handoffs

    def preallocate(self) -> None:
        for req in self.handoffs.preallocate(self.s.running):
            self.s._changed = True
            pages, cached = self.handoffs.destination(req)
            try:
                req.handoff.on_allocated(pages, cached)
            except Exception as e:  # the caller is gone: nothing will fill these pages
                log.warning("request %s: pre-allocation callback failed: %r", req.rid, e)
                self.handoffs.receiving.pop(req.rid, None)
                self.s._finish(req, FinishReason(FinishKind.ABORT, message=f"KV handoff failed: {e}"))

    def hand_over(self, req: Req) -> None:
        """A prefill-role request has its KV and first token: pin the pages and give them to the caller."""
        self.s._drop_from_sets(req)
        pages = self.handoffs.hold(req)
        first = FirstToken(req.output_ids[-1], req.cached_tokens, input_logprobs=req.input_logprobs,
                           input_top_logprobs=req.input_top_logprobs,
                           input_token_ids_logprobs=req.input_token_ids_logprobs)
        if req.return_logprob:
            first.logprob, first.top_logprobs = req.output_logprobs[-1], req.output_top_logprobs[-1]
            first.token_ids_logprobs = req.output_token_ids_logprobs[-1]
        req.status = ReqStatus.FINISHED
        self.s._changed = True
        try:
            req.handoff.on_ready(pages, first)
        except Exception as e:
            log.warning("request %s: KV-ready callback failed, freeing its pages: %r", req.rid, e)
            self.handoffs.release(req.rid)
            req.finish_reason = FinishReason(FinishKind.ABORT, message=f"KV handoff failed: {e}")
        self.s._emit(req)

    def deliver_kv(self, rid: str, first: FirstToken) -> bool:
        """The KV of a receiving decode-role request has landed: it starts decoding after `first`.
        False when the request is no longer waiting (aborted meanwhile)."""
        req = self.handoffs.receiving.pop(rid, None)
        if req is None:
            return False
        self.s._changed = True
        req.kv_len = req.fill_len
        req.cached_tokens = first.cached_tokens
        if req.logprob is not None and req.logprob.start >= 0:
            req.input_logprobs, req.input_top_logprobs = first.input_logprobs, first.input_top_logprobs
            req.input_token_ids_logprobs = first.input_token_ids_logprobs
        if req.sampling.max_new_tokens == 0:
            self.s._finish(req, FinishReason(FinishKind.LENGTH, length=0))
            return True
        self.s._append_token(req, first.token_id, first.logprob, first.top_logprobs, first.token_ids_logprobs)
        if req.sampling.penalized:
            self.s.runner.penalties.reset_row(req.pool_idx, req.input_ids, req.output_ids)
        self.s._continue(req, newly_prefilled=True)
        return True

    def release_kv(self, rid: str) -> bool:
        return self.handoffs.release(rid)
