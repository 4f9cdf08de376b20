"""Per-step bookkeeping for a request that just received a token: stop conditions and the output it emits."""

from __future__ import annotations

from engine.request import FinishKind, FinishReason, Req, StepOutput


def check_finished(req: Req, context_len: int) -> FinishReason | None:
    """SGLang's order: the length limit first, then stop tokens (EOS unless ignore_eos, plus stop_token_ids)."""
    if len(req.output_ids) >= req.sampling.max_new_tokens:
        return FinishReason(FinishKind.LENGTH, length=req.sampling.max_new_tokens)
    last = req.output_ids[-1]
    if last in req.stop_ids:
        return FinishReason(FinishKind.STOP, matched=last)
    if req.fill_len >= context_len:
        return FinishReason(FinishKind.LENGTH, length=len(req.output_ids))
    return None


def step_output(req: Req) -> StepOutput:
    """The tokens produced since the last output (advances req.sent_len)."""
    start, req.sent_len = req.sent_len, len(req.output_ids)
    return StepOutput(
        rid=req.rid,
        new_token_ids=req.output_ids[start:],
        new_logprobs=req.output_logprobs[start:] if req.return_logprob else None,
        finished=req.finished,
        finish_reason=req.finish_reason,
        prompt_tokens=len(req.input_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
    )
