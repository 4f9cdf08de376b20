"""The scheduler's steps for prefill/decode disaggregation (engine.disaggregation.handoff has the roles): telling a
decode-role request's caller where its pages are, handing a prefill-role request's KV and first token to its caller,
and starting a decode-role request once its KV has landed. State moves go through the scheduler's `requests`
(engine.scheduler.requests); the page bookkeeping is `Handoffs`' (engine.scheduler.handoffs)."""

from __future__ import annotations

import logging

from radixmesh.engine.disaggregation.handoff import FirstToken
from radixmesh.engine.request import FinishKind, FinishReason, Req

log = logging.getLogger(__name__)


class HandoffSteps:
    """A collaborator of one Scheduler, on its thread: uses its public `requests`, `handoffs`, `finish`, `emit`,
    `append_token` and `after_token`."""

    def __init__(self, scheduler):
        self.s = scheduler

    def _drafter(self):
        """The speculative draft model (engine.speculative.draft_model.DraftModel), if the engine has one."""
        spec = self.s.spec
        return spec.model if spec is not None else None

    def preallocate(self) -> None:
        """Destination pages for the decode-role requests that fit; each one's caller is told where they are."""
        handoffs = self.s.handoffs
        drafter = self._drafter()
        for req in handoffs.preallocate():
            pages, cached = handoffs.destination(req)
            if drafter is not None:  # (what an EAGLE head lacks of the prompt: engine.disaggregation.draft_state)
                req.handoff.draft_wanted = drafter.wanted(req)
            try:
                req.handoff.on_allocated(pages, cached)
            except Exception as e:  # the caller is gone: nothing will fill these pages
                log.warning("request %s: pre-allocation callback failed: %r", req.rid, e)
                self.s.finish(req, FinishReason(FinishKind.ABORT, message=f"KV handoff failed: {e}"))

    def hand_over(self, req: Req) -> None:
        """A prefill-role request has its KV and first token: pin the pages (HELD) and give them to the caller."""
        pages = self.s.handoffs.hold(req)
        first = FirstToken(req.output_ids[-1], req.cached_tokens, input_logprobs=req.input_logprobs,
                           input_top_logprobs=req.input_top_logprobs,
                           input_token_ids_logprobs=req.input_token_ids_logprobs)
        if req.return_logprob:
            first.logprob, first.top_logprobs = req.output_logprobs[-1], req.output_top_logprobs[-1]
            first.token_ids_logprobs = req.output_token_ids_logprobs[-1]
        drafter = self._drafter()
        if drafter is not None:  # (an EAGLE head catches up over the prompt, for the decode side)
            try:
                first.draft = drafter.handed_over(req)
            except Exception:  # the decode side's head then drafts from zeros: slower, never wrong
                log.exception("request %s: the draft head's catch-up over the prompt failed", req.rid)
        try:
            req.handoff.on_ready(pages, first)
        except Exception as e:
            log.warning("request %s: KV-ready callback failed, freeing its pages: %r", req.rid, e)
            self.s.handoffs.release(req.rid)
            req.finish_reason = FinishReason(FinishKind.ABORT, message=f"KV handoff failed: {e}")
        self.s.emit(req)

    def deliver_kv(self, rid: str, first: FirstToken) -> bool:
        """The KV of a receiving decode-role request has landed: it starts decoding after `first`.
        False when the request is no longer waiting (aborted meanwhile)."""
        req = self.s.requests.receiving.get(rid)
        if req is None:
            return False
        drafter = self._drafter()
        if drafter is not None:  # (first: it refuses a draft state that does not fit before anything changed)
            drafter.received(req, first.draft)
        req.kv_len = req.fill_len
        req.cached_tokens = first.cached_tokens
        if req.logprob is not None and req.logprob.start >= 0:
            req.input_logprobs, req.input_top_logprobs = first.input_logprobs, first.input_top_logprobs
            req.input_token_ids_logprobs = first.input_token_ids_logprobs
        if req.sampling.max_new_tokens == 0:
            self.s.finish(req, FinishReason(FinishKind.LENGTH, length=0))
            return True
        self.s.append_token(req, first.token_id, first.logprob, first.top_logprobs, first.token_ids_logprobs)
        self.s.after_token(req)  # RECEIVING -> RUNNING, or FINISHED by its first token
        return True
