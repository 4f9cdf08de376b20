"""Verification of drafted tokens: which of them the target model keeps, and the token it adds after them.

A verify forward computes, for each request, logits at its newest token and at each of its k drafted tokens (k + 1
positions; k may be 0). Position j's logits give the target's distribution p_j for the token after it, which the
draft guessed to be d_{j+1}. Draft tokens are accepted from the first on while the test passes:

- greedy rows: d_{j+1} == argmax p_j (the adjusted logits'), so the output is token for token what decoding one
  token at a time gives;
- sampled rows: d_{j+1} was drawn from a draft distribution q_j (a draft model's; one-hot for n-gram lookup,
  which proposes one token with certainty). It is kept with probability min(1, p_j(d_{j+1}) / q_j(d_{j+1})); at
  the first rejection the row's token is drawn from max(p_j - q_j, 0), renormalized (for a one-hot q: p_j with
  d_{j+1} taken out), and when every draft is kept the next token is drawn from p_k. Each token is then distributed
  exactly as p_j, the distribution plain sampling draws from (speculative sampling, Leviathan et al. 2023).

p_j is what plain sampling would use at that position: penalties, logit_bias, min_new_tokens (counting the j drafted
tokens before it), temperature, top-k, top-p and min-p (engine.sampling.sampler). Logprobs are those of the raw
logits at each position, as without speculation.

Tensors are laid out [batch, width] with width = 1 + the longest draft; a row's positions past its own draft are
padding, whose values are never read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radixmesh.engine.sampling.penalties import PenaltyState
from radixmesh.engine.sampling.sampler import SamplingBatch, adjust_logits, adjusts, draw, token_probs, uniforms

# Seeded rows draw two numbers per position: the acceptance test (the seed as given) and the resampling after a
# rejection (the seed xor this), so the two never coincide.
RESAMPLE_SALT = 0x5BD1E995


class VerifyLayout(NamedTuple):
    """Where each request's positions are among a verify forward's logits rows: `width` rows per request, its
    newest token, its drafts and padding, requests in batch order (batch_builder.build_verify)."""

    rows: torch.Tensor  # [batch, width] int64 logits row of position j of request i (padding: its last real row)
    drafts: torch.Tensor  # [batch, width] int64 the drafted token checked at position j (padding and j == k: 0)
    draft_lens: torch.Tensor  # [batch] int64 k of each request
    width: int

    @classmethod
    def build(cls, drafts: list[list[int]], device: torch.device, width: int | None = None) -> "VerifyLayout":
        """`width`: rows per request in the forward (default: 1 + the longest draft)."""
        batch = len(drafts)
        width = width or 1 + max(map(len, drafts), default=0)
        lens = torch.tensor([len(d) for d in drafts], dtype=torch.int64)
        rows = torch.arange(batch)[:, None] * width + torch.minimum(torch.arange(width)[None, :], lens[:, None])
        checked = torch.zeros((batch, width), dtype=torch.int64)
        for i, d in enumerate(drafts):
            if d:
                checked[i, :len(d)] = torch.tensor(d, dtype=torch.int64)

        def dev(t):
            return t.to(device, non_blocking=True)

        return cls(dev(rows), dev(checked), dev(lens), width)


class VerifyResult(NamedTuple):
    tokens: torch.Tensor  # [batch, width] int64 the row's output tokens, the first accepted + 1 of them real
    accepted: torch.Tensor  # [batch] int64 drafted tokens kept
    next_ids: torch.Tensor  # [batch] int64 the token after the accepted drafts (the next step's input)
    logprobs: torch.Tensor | None = None  # [batch, width] raw logprob of each output token
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None  # values, ids [batch, width, k]
    token_ids_logprobs: torch.Tensor | None = None  # [batch, width, n]


def verify(logits: torch.Tensor, layout: VerifyLayout, sampling: SamplingBatch, generator: torch.Generator | None,
           penalties: PenaltyState | None = None, draft_probs: torch.Tensor | None = None) -> VerifyResult:
    """`logits` [rows, vocab] float32 of a verify forward; `sampling` has one row per [batch, width] position in
    row-major order (SamplingBatch.build with each request repeated `width` times and offsets 0..width-1).
    `draft_probs` [batch, width, vocab]: q_j, the distribution each drafted token was drawn from (rows of greedy
    requests, padding and each row's last position: anything); None: one-hot drafts."""
    batch, width = layout.rows.shape
    flat = logits[layout.rows.reshape(-1)]  # [batch * width, vocab]
    adjusted = adjust_logits(flat, sampling, penalties) if adjusts(sampling) else flat
    best = adjusted.argmax(dim=-1)
    checked = layout.drafts.reshape(-1)
    if sampling.all_greedy:
        keep, final = best == checked, best
    else:
        probs = token_probs(adjusted, sampling)
        p_draft = probs.gather(1, checked[:, None]).squeeze(1)
        position = torch.arange(width, device=probs.device).repeat(batch)
        drafted = position < layout.draft_lens.repeat_interleave(width)
        u = uniforms(sampling, generator, probs.device)
        if draft_probs is None:
            keep_sampled = u < p_draft
            # after a rejection: p without the rejected token; at j == k (and in padding) nothing is taken out
            residual = probs.scatter(1, checked[:, None], torch.where(drafted[:, None], 0.0, p_draft[:, None]))
        else:
            q = draft_probs.reshape(batch * width, -1)
            keep_sampled = u * q.gather(1, checked[:, None]).squeeze(1) < p_draft
            residual = torch.where(drafted[:, None], (probs - q).clamp_(min=0.0), probs)
        empty = residual.sum(dim=-1) <= 0  # p was all where q is: it cannot have been rejected there
        residual = torch.where(empty[:, None], probs, residual)
        drawn = draw(residual, uniforms(sampling, generator, probs.device, RESAMPLE_SALT))
        keep = torch.where(sampling.greedy, best == checked, keep_sampled)
        final = torch.where(sampling.greedy, best, drawn)
    keep = keep.view(batch, width)
    final = final.view(batch, width)
    position = torch.arange(width, device=keep.device)[None, :]
    keep &= position < layout.draft_lens[:, None]
    accepted = keep.long().cumprod(dim=1).sum(dim=1)
    next_ids = final.gather(1, accepted[:, None]).squeeze(1)
    tokens = torch.where(position < accepted[:, None], layout.drafts, next_ids[:, None])
    if not sampling.want_logprobs:
        return VerifyResult(tokens, accepted, next_ids)
    return with_logprobs(VerifyResult(tokens, accepted, next_ids), torch.log_softmax(flat, dim=-1), sampling,
                         sampling.logprob_token_ids)


def with_logprobs(result: VerifyResult, raw: torch.Tensor, sampling: SamplingBatch,
                  token_ids: torch.Tensor | None) -> VerifyResult:
    """`result` with the raw logprobs of its tokens (and the top-k and the asked-for ids' when the batch wants them):
    `raw` [batch * width, vocab] log-softmax rows, row b * width + j the one output j of request b follows;
    `token_ids` the asked-for ids per such row (None: none asked)."""
    batch, width = result.tokens.shape
    chosen = raw.gather(1, result.tokens.reshape(-1, 1)).view(batch, width)
    top = None
    if sampling.top_logprobs_k:
        values, ids = raw.topk(sampling.top_logprobs_k, dim=-1)
        top = (values.view(batch, width, -1), ids.view(batch, width, -1))
    by_id = None if token_ids is None else raw.gather(1, token_ids).view(batch, width, -1)
    return result._replace(logprobs=chosen, top_logprobs=top, token_ids_logprobs=by_id)
