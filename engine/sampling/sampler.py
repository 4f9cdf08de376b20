"""Batched next-token selection on the device: greedy rows take the argmax, the others sample from
softmax(logits / temperature). One pass for the whole batch; per-request parameters are tensors."""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.sampling.params import GREEDY_EPS, SamplingParams


class SamplingBatch(NamedTuple):
    temperatures: torch.Tensor  # [batch] float32; greedy rows hold 1.0 (unused)
    greedy: torch.Tensor  # [batch] bool
    all_greedy: bool
    want_logprobs: bool

    @classmethod
    def build(cls, params: list[SamplingParams], want_logprobs: bool, device: torch.device) -> "SamplingBatch":
        temps = [p.temperature for p in params]
        greedy = [t < GREEDY_EPS for t in temps]
        temps_t = torch.tensor([1.0 if g else t for g, t in zip(greedy, temps)], dtype=torch.float32)
        return cls(temps_t.to(device), torch.tensor(greedy).to(device), all(greedy), want_logprobs)


class SampleResult(NamedTuple):
    next_ids: torch.Tensor  # [batch] int64
    logprobs: torch.Tensor | None  # [batch] float32 log-probability of the chosen token under the model


def sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None) -> SampleResult:
    """logits [batch, vocab] float32 -> chosen token ids (and their logprobs under the raw distribution)."""
    argmax = logits.argmax(dim=-1)
    if batch.all_greedy:
        next_ids = argmax
    else:
        probs = torch.softmax(logits / batch.temperatures[:, None], dim=-1)
        sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        next_ids = torch.where(batch.greedy, argmax, sampled)
    logprobs = None
    if batch.want_logprobs:
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, next_ids[:, None]).squeeze(1)
    return SampleResult(next_ids, logprobs)
