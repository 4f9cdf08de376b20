"""Per-step bookkeeping for a request that just received a token: stop conditions and the output it emits."""

from __future__ import annotations

import dataclasses

from radixmesh.engine.request import FinishKind, FinishReason, Req, StepOutput


class StopStrings:
    """Matches `stop` strings on the detokenized tail of a request's output, checked after every token, so a match
    always involves the newest token. A byte-level token holds at least one byte and a character at most four, so
    the last 4 * len(longest stop) + 1 tokens cover any string that could end at the newest token."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def match(self, req: Req) -> str | None:
        stops = req.sampling.stop
        if not stops or self.tokenizer is None:
            return None
        window = 4 * max(len(s) for s in stops) + 1
        tail = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=req.sampling.skip_special_tokens)
        found = [(tail.find(s), s) for s in stops if s in tail]
        return min(found)[1] if found else None


def check_finished(req: Req, context_len: int, stop_strings: StopStrings | None = None) -> FinishReason | None:
    """SGLang's order: the length limit first, then stop tokens (EOS unless ignore_eos, plus stop_token_ids), then
    stop strings."""
    if len(req.output_ids) >= req.sampling.max_new_tokens:
        return FinishReason(FinishKind.LENGTH, length=req.sampling.max_new_tokens)
    last = req.output_ids[-1]
    if last in req.stop_ids:
        return FinishReason(FinishKind.STOP, matched=last, stop_token=True)
    if req.matcher is not None and req.matcher.is_terminated():
        return FinishReason(FinishKind.STOP, matched=last)
    matched = stop_strings.match(req) if stop_strings is not None else None
    if matched is not None:
        return FinishReason(FinishKind.STOP, matched=matched)
    if req.fill_len >= context_len:
        return FinishReason(FinishKind.LENGTH, length=len(req.output_ids))
    return None


def step_output(req: Req) -> StepOutput:
    """The tokens produced since the last output (advances req.sent_len)."""
    start, req.sent_len = req.sent_len, len(req.output_ids)
    first = start == 0 and req.logprob is not None and req.logprob.start >= 0
    return StepOutput(
        rid=req.rid,
        new_token_ids=req.output_ids[start:],
        new_logprobs=req.output_logprobs[start:] if req.return_logprob else None,
        new_top_logprobs=req.output_top_logprobs[start:] if req.return_logprob else None,
        new_token_ids_logprobs=req.output_token_ids_logprobs[start:] if req.return_logprob else None,
        finished=req.finished,
        finish_reason=req.finish_reason,
        prompt_tokens=len(req.input_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
        input_logprobs=(req.input_logprobs, req.input_top_logprobs, req.input_token_ids_logprobs) if first else None,
        queue_time_s=req.queue_time_s,
        embedding=req.embedding,
        spec=dataclasses.replace(req.spec) if req.spec is not None else None,
    )
