"""Logprob tensors of a sampled step, read back to the host once and shaped per request."""

from __future__ import annotations

from radixmesh.engine.request import Req


def to_host(chosen, top, by_id) -> tuple[list, list | None, list | None]:
    """Read logprob tensors back once: chosen [n], top as [(logprob, id)] rows best first, logprobs by id rows."""
    top_rows = None
    if top is not None:
        values, ids = (x.tolist() for x in top)
        top_rows = [list(zip(v, i)) for v, i in zip(values, ids)]
    return chosen.tolist(), top_rows, by_id.tolist() if by_id is not None else None


def token_logprob_rows(result) -> list[list[tuple]] | None:
    """Per row of a SampleResult, per token: (chosen logprob, [(logprob, id)] best first, [logprob per requested
    id]); None when the step computed no logprobs."""
    if result.logprobs is None:
        return None
    chosen, top, by_id = to_host(result.logprobs, result.top_logprobs, result.token_ids_logprobs)
    return [[(chosen[i], top[i] if top else None, by_id[i] if by_id else None)] for i in range(len(chosen))]


def store_prompt_logprobs(reqs: list[Req], plan, prompt: tuple) -> None:
    """Append each request's share of a step's prompt logprobs (plan.counts of them, in batch order); `prompt` is
    `to_host` of the step's TokenLogprobs."""
    chosen, top, by_id = prompt
    at = 0
    for r, n in zip(reqs, plan.counts):
        r.input_logprobs += chosen[at:at + n]
        k = r.logprob.top_logprobs_num if r.logprob else 0
        r.input_top_logprobs += [row[:k] for row in top[at:at + n]] if top else [[] for _ in range(n)]
        ids = r.logprob.token_ids_logprob if r.logprob else ()
        r.input_token_ids_logprobs += [list(zip(row, ids)) for row in by_id[at:at + n]] if by_id else \
            [[] for _ in range(n)]
        at += n
