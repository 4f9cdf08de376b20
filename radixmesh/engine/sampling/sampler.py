"""Batched next-token selection on the device: one vectorized pass per step for the whole batch.

Order, as SGLang applies it: penalties (repetition, frequency, presence) and `min_new_tokens` (stop tokens masked)
and `logit_bias` on the raw logits; greedy rows take the argmax of those; the others divide by temperature, keep
top-k / top-p / min-p of the softmax, and draw by inverse CDF from one uniform number per row. A row with a
`sampling_seed` draws its uniform from a hash of (seed, tokens generated so far), so its output does not depend on
what else is in the batch. Logprobs are those of the raw distribution (log-softmax of the unmodified logits).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radixmesh.engine.request import Req
from radixmesh.engine.sampling.grammar import apply_bitmask
from radixmesh.engine.sampling.params import GREEDY_EPS
from radixmesh.engine.sampling.penalties import PenaltyState

_MASK = 0xFFFFFFFF


class SamplingBatch(NamedTuple):
    temperatures: torch.Tensor  # [batch] float32; greedy rows hold 1.0 (unused)
    greedy: torch.Tensor  # [batch] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [batch] int64, vocab size where disabled; None when no row filters
    top_p: torch.Tensor | None  # [batch] float32
    min_p: torch.Tensor | None  # [batch] float32
    penalty_rows: torch.Tensor | None  # [batch] int64 rows of the penalty state; None when no row is penalized
    penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # frequency, presence, repetition [batch]
    masked: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) forced to -inf (min_new_tokens)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values) added (logit_bias)
    seeds: torch.Tensor | None  # [batch] int64 seed, -1 where unseeded; None when no row is seeded
    steps: torch.Tensor | None  # [batch] int64 tokens generated so far (the seeded draw's counter)
    want_logprobs: bool
    top_logprobs_k: int  # the largest top_logprobs_num in the batch (0: none)
    logprob_token_ids: torch.Tensor | None  # [batch, longest token_ids_logprob] int64, zero-padded
    grammar: tuple[torch.Tensor, list[int]] | None  # (token bitmask [batch, words] int32, rows it applies to)
    # (rows, token ids) the penalties count on top of each row's state: a speculative verify's drafted tokens
    # before each position; None when there are none
    penalized_ahead: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, reqs: list[Req], want_logprobs: bool, vocab: int, device: torch.device,
              offsets: list[int] | None = None) -> "SamplingBatch":
        """`offsets`: per row, the tokens the row comes after beyond the request's output so far (a speculative
        verify step samples position j of a request's drafts as if j drafted tokens were already output: its
        min_new_tokens and seeded draws count them). With offsets the caller adds the grammar masks and the
        drafted tokens' penalty counts (`verify_extras`)."""
        params = [r.sampling for r in reqs]
        ahead = offsets or [0] * len(reqs)

        def t(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        greedy = [p.temperature < GREEDY_EPS for p in params]
        filtered = any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params)
        penalized = any(p.penalized for p in params)
        seeded = any(p.sampling_seed is not None for p in params)
        return cls(
            temperatures=t([1.0 if g else p.temperature for g, p in zip(greedy, params)], torch.float32),
            greedy=t(greedy, torch.bool),
            all_greedy=all(greedy),
            top_k=t([p.top_k if p.top_k > 0 else vocab for p in params], torch.int64) if filtered else None,
            top_p=t([p.top_p for p in params], torch.float32) if filtered else None,
            min_p=t([p.min_p for p in params], torch.float32) if filtered else None,
            # A request finished while its row rode in an overlapped step has no table row: any row will do,
            # its token is discarded.
            penalty_rows=t([r.pool_idx or 0 for r in reqs], torch.int64) if penalized else None,
            penalties=tuple(t([getattr(p, name) for p in params], torch.float32) for name in
                            ("frequency_penalty", "presence_penalty", "repetition_penalty")) if penalized else None,
            masked=_min_new_tokens_mask(reqs, ahead, t),
            bias=_bias(reqs, t),
            seeds=t([-1 if p.sampling_seed is None else p.sampling_seed for p in params], torch.int64)
            if seeded else None,
            steps=t([len(r.output_ids) + a for r, a in zip(reqs, ahead)], torch.int64) if seeded else None,
            want_logprobs=want_logprobs,
            top_logprobs_k=max((r.logprob.top_logprobs_num for r in reqs if r.logprob), default=0),
            logprob_token_ids=_logprob_token_ids(reqs, t),
            grammar=_grammar_bitmask(reqs, vocab) if offsets is None else None,
        )


def _min_new_tokens_mask(reqs: list[Req], ahead: list[int], t):
    rows, cols = [], []
    for i, (r, a) in enumerate(zip(reqs, ahead)):
        if len(r.output_ids) + a < r.sampling.min_new_tokens and r.stop_ids:
            rows += [i] * len(r.stop_ids)
            cols += list(r.stop_ids)
    return (t(rows, torch.int64), t(cols, torch.int64)) if rows else None


def _grammar_bitmask(reqs: list[Req], vocab: int):
    rows = [i for i, r in enumerate(reqs) if r.matcher is not None and r.matcher.active and not r.finished]
    if not rows:
        return None
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(reqs), vocab)
    for i in rows:
        reqs[i].matcher.fill_next_token_bitmask(bitmask, i)
    return bitmask, rows


def verify_extras(batch: SamplingBatch, reqs: list[Req], drafts: list[list[int]], width: int, vocab: int,
                  device: torch.device) -> SamplingBatch:
    """A speculative verify's sampling rows (request i's position j at row i * width + j, built with offsets) with
    what depends on the drafted tokens before each position: the grammar's mask there (the matcher walked along
    the draft and rolled back) and the penalties' counts of those tokens."""
    rows, tokens = [], []
    for i, (r, draft) in enumerate(zip(reqs, drafts)):
        if r.sampling.penalized:
            for j in range(1, len(draft) + 1):
                rows += [i * width + j] * j
                tokens += draft[:j]
    ahead = (torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
             torch.tensor(tokens, dtype=torch.int64).to(device, non_blocking=True)) if rows else None
    grammar = None
    constrained = [i for i, r in enumerate(reqs) if r.matcher is not None and not r.finished]
    if constrained:
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(reqs) * width, vocab)
        masked = []
        for i in constrained:
            draft = drafts[i]
            masked += reqs[i].matcher.fill_masks_along(draft, bitmask, [i * width + j for j in range(len(draft) + 1)])
        grammar = (bitmask, masked) if masked else None
    return batch._replace(penalized_ahead=ahead, grammar=grammar)


def _logprob_token_ids(reqs: list[Req], t):
    lists = [list(r.logprob.token_ids_logprob) if r.logprob else [] for r in reqs]
    width = max(map(len, lists), default=0)
    return t([ids + [0] * (width - len(ids)) for ids in lists], torch.int64) if width else None


def _bias(reqs: list[Req], t):
    rows, cols, vals = [], [], []
    for i, r in enumerate(reqs):
        for tok, val in r.sampling.logit_bias:
            rows.append(i)
            cols.append(tok)
            vals.append(val)
    return (t(rows, torch.int64), t(cols, torch.int64), t(vals, torch.float32)) if rows else None


class SampleResult(NamedTuple):
    next_ids: torch.Tensor  # [batch] int64
    logprobs: torch.Tensor | None  # [batch] float32 log-probability of the chosen token under the raw model
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None  # values, token ids [batch, top_logprobs_k]
    token_ids_logprobs: torch.Tensor | None = None  # [batch, longest token_ids_logprob] float32
    prompt: "TokenLogprobs | None" = None  # logprobs of prompt tokens, when the batch asked for them


class TokenLogprobs(NamedTuple):
    chosen: torch.Tensor  # [n] float32 logprob of each target token
    top: tuple[torch.Tensor, torch.Tensor] | None  # values, token ids [n, k] best first
    by_id: torch.Tensor | None = None  # [n, width] logprobs of requested token ids


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, top_k: int,
                   token_ids: torch.Tensor | None = None) -> TokenLogprobs:
    """Raw-distribution logprobs of `targets` [n] under logits [n, vocab], plus the top-k of each row and the
    logprobs of `token_ids` [n, width]."""
    raw = torch.log_softmax(logits, dim=-1)
    top = tuple(raw.topk(top_k, dim=-1)) if top_k else None
    by_id = raw.gather(1, token_ids) if token_ids is not None else None
    return TokenLogprobs(raw.gather(1, targets[:, None]).squeeze(1), top, by_id)


def hashed_uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """A uniform number in [0, 1) per row from (seed, step), by integer mixing kept within 32 bits (every product
    stays below 2**63, so int64 never overflows); identical on every device and for every batch composition."""
    x = ((seeds ^ (seeds >> 32)) & _MASK) ^ ((steps * 0x2C1B3C6D + 0x297A2D39) & _MASK)
    for _ in range(3):
        x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK
    x = (x >> 16) ^ x
    return x.double().div(2.0**32).float()


def uniforms(batch: SamplingBatch, generator: torch.Generator | None, device: torch.device,
             salt: int = 0) -> torch.Tensor:
    """One uniform number in [0, 1) per row: from `generator`, or for a seeded row from (seed, step), where `salt`
    tells apart several draws of one row and step (a speculative verify's acceptance test and its resampling)."""
    u = torch.rand(batch.greedy.shape[0], generator=generator, device=device)
    if batch.seeds is not None:
        seeds = batch.seeds ^ salt if salt else batch.seeds
        u = torch.where(batch.seeds >= 0, hashed_uniform(seeds, batch.steps), u)
    return u


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids [rows] drawn from probs [rows, vocab] (any non-negative weights) by inverse CDF at u [rows]."""
    cdf = probs.cumsum(dim=-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=probs.shape[1] - 1).squeeze(1)


def adjust_logits(logits: torch.Tensor, batch: SamplingBatch, penalties: PenaltyState | None) -> torch.Tensor:
    """Penalties, min_new_tokens masking and logit_bias, applied to a copy of logits [batch, vocab]."""
    if batch.penalties is not None:
        logits = penalties.apply(logits, batch.penalty_rows, *batch.penalties, batch.penalized_ahead)
    else:
        logits = logits.clone()
    if batch.bias is not None:
        rows, cols, vals = batch.bias
        logits.index_put_((rows, cols), vals, accumulate=True)
    if batch.masked is not None:
        logits[batch.masked] = float("-inf")
    if batch.grammar is not None:
        apply_bitmask(logits, *batch.grammar)
    return logits


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softmax(logits / T) with top-k, top-p and min-p applied and renormalized. When filters apply the result is in
    descending-probability order and the second value maps those positions back to token ids."""
    probs = torch.softmax(logits / batch.temperatures[:, None], dim=-1)
    if batch.top_k is None:
        return probs, None
    probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[1], device=probs.device)[None, :]
    drop = rank >= batch.top_k[:, None]
    drop |= (probs.cumsum(dim=-1) - probs) > batch.top_p[:, None]  # keep the smallest prefix reaching top_p
    drop |= probs < batch.min_p[:, None] * probs[:, :1]
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True), order


def token_probs(adjusted: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution each row draws from, in token order: filtered_probs of the adjusted logits."""
    probs, order = filtered_probs(adjusted, batch)
    if order is None:
        return probs
    # Back to token order: a row's draw must not depend on whether another row of the batch filters (which is
    # what puts the whole batch in sorted order).
    return torch.zeros_like(probs).scatter_(1, order, probs)


def sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None,
           penalties: PenaltyState | None = None) -> SampleResult:
    """logits [batch, vocab] float32 -> chosen token ids (and their logprobs under the raw distribution)."""
    adjusted = adjust_logits(logits, batch, penalties) if adjusts(batch) else logits
    argmax = adjusted.argmax(dim=-1)
    if batch.all_greedy:
        next_ids = argmax
    else:
        probs = token_probs(adjusted, batch)
        next_ids = torch.where(batch.greedy, argmax, draw(probs, uniforms(batch, generator, probs.device)))
    if not batch.want_logprobs:
        return SampleResult(next_ids, None)
    raw = torch.log_softmax(logits, dim=-1)
    top = tuple(raw.topk(batch.top_logprobs_k, dim=-1)) if batch.top_logprobs_k else None
    by_id = raw.gather(1, batch.logprob_token_ids) if batch.logprob_token_ids is not None else None
    return SampleResult(next_ids, raw.gather(1, next_ids[:, None]).squeeze(1), top, by_id)


def adjusts(batch: SamplingBatch) -> bool:
    return (batch.penalties is not None or batch.bias is not None or batch.masked is not None
            or batch.grammar is not None)
