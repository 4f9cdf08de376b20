"""The batched sampler against plain, loop-per-row reference implementations on fixed logits."""

from __future__ import annotations

import math

import pytest
import torch

from radixmesh.engine.request import Req
from radixmesh.engine.sampling.params import SamplingParams
from radixmesh.engine.sampling.penalties import PenaltyState
from radixmesh.engine.sampling.sampler import SamplingBatch, adjust_logits, filtered_probs, hashed_uniform, sample

VOCAB = 12


def make_reqs(params: list[dict], outputs: list[list[int]] | None = None, prompts=None) -> list[Req]:
    reqs = []
    for i, p in enumerate(params):
        r = Req(rid=str(i), input_ids=(prompts or [[1, 2, 3]] * len(params))[i], sampling=SamplingParams.from_dict(p),
                stop_ids=frozenset({0, 5}), sink=lambda o: None)
        r.output_ids = list((outputs or [[]] * len(params))[i])
        r.pool_idx = i
        reqs.append(r)
    return reqs


def logits_fixture(batch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(batch, VOCAB, generator=gen) * 2


def reference_adjust(row: list[float], req: Req) -> list[float]:
    p = req.sampling
    out = list(row)
    counts = {t: req.output_ids.count(t) for t in set(req.output_ids)}
    seen = set(req.input_ids) | set(req.output_ids)
    for t in range(VOCAB):
        if t in seen:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        c = counts.get(t, 0)
        out[t] -= c * p.frequency_penalty + (1.0 if c > 0 else 0.0) * p.presence_penalty
    for t, b in p.logit_bias:
        out[t] += b
    if len(req.output_ids) < p.min_new_tokens:
        for t in req.stop_ids:
            out[t] = -math.inf
    return out


def test_penalties_bias_and_min_new_tokens_follow_the_formulas():
    params = [
        {"repetition_penalty": 1.7},
        {"frequency_penalty": 0.9, "presence_penalty": -0.4},
        {"frequency_penalty": -1.2, "repetition_penalty": 0.6, "logit_bias": {"3": 4.5, 7: -2.0}},
        {"min_new_tokens": 4, "max_new_tokens": 8},
        {},
    ]
    outputs = [[4, 4, 9], [4, 4, 9, 11], [2, 6, 6], [1], []]
    reqs = make_reqs(params, outputs, prompts=[[1, 2, 3], [8], [3, 3], [10], [2]])
    state = PenaltyState(len(reqs), VOCAB, torch.device("cpu"))
    for r in reqs:
        state.reset_row(r.pool_idx, r.input_ids, r.output_ids)
    logits = logits_fixture(len(reqs))
    batch = SamplingBatch.build(reqs, False, VOCAB, torch.device("cpu"))
    got = adjust_logits(logits, batch, state)
    want = torch.tensor([reference_adjust(logits[i].tolist(), r) for i, r in enumerate(reqs)])
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(logits, logits_fixture(len(reqs)))  # the raw logits are untouched (logprobs use them)


def test_penalty_state_record_matches_a_rebuild():
    reqs = make_reqs([{"frequency_penalty": 1.0}] * 2, [[1, 2], [3]])
    state = PenaltyState(2, VOCAB, torch.device("cpu"))
    for r in reqs:
        state.reset_row(r.pool_idx, r.input_ids, r.output_ids)
    state.record(torch.tensor([0, 1]), torch.tensor([2, 7]))
    fresh = PenaltyState(2, VOCAB, torch.device("cpu"))
    fresh.reset_row(0, reqs[0].input_ids, [1, 2, 2])
    fresh.reset_row(1, reqs[1].input_ids, [3, 7])
    assert torch.equal(state.counts, fresh.counts) and torch.equal(state.seen, fresh.seen)


def reference_kept(probs: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    kept, mass = set(), 0.0
    for rank, t in enumerate(order):
        if top_k > 0 and rank >= top_k:
            break
        if mass > top_p:
            break
        if probs[t] < min_p * probs[order[0]]:
            continue
        kept.add(t)
        mass += probs[t]
    return kept


@pytest.mark.parametrize("top_k, top_p, min_p, temperature", [
    (3, 1.0, 0.0, 1.0), (-1, 0.5, 0.0, 0.7), (-1, 1.0, 0.2, 1.3), (5, 0.8, 0.05, 0.9), (1, 1.0, 0.0, 2.0),
])
def test_top_k_top_p_min_p_keep_the_reference_set(top_k, top_p, min_p, temperature):
    p = {"top_k": top_k, "top_p": top_p, "min_p": min_p, "temperature": temperature}
    reqs = make_reqs([p, {"temperature": temperature}])
    logits = logits_fixture(2)
    probs, order = filtered_probs(logits, SamplingBatch.build(reqs, False, VOCAB, torch.device("cpu")))
    dense = torch.zeros_like(probs).scatter(1, order, probs)
    raw = torch.softmax(logits / temperature, dim=-1)
    kept = reference_kept(raw[0].tolist(), top_k, top_p, min_p)
    assert {t for t in range(VOCAB) if dense[0, t] > 0} == kept
    assert torch.allclose(dense[0, sorted(kept)], raw[0, sorted(kept)] / raw[0, sorted(kept)].sum(), atol=1e-6)
    assert torch.allclose(dense[1], raw[1], atol=1e-6)  # the unfiltered row is the plain softmax


def test_inverse_cdf_draws_follow_the_distribution():
    reqs = make_reqs([{"temperature": 0.8, "top_k": 6}] * 4000)
    logits = logits_fixture(1).expand(4000, -1).contiguous()
    batch = SamplingBatch.build(reqs, False, VOCAB, torch.device("cpu"))
    ids = sample(logits, batch, torch.Generator().manual_seed(0)).next_ids
    first = batch._replace(top_k=batch.top_k[:1], top_p=batch.top_p[:1], min_p=batch.min_p[:1],
                           temperatures=batch.temperatures[:1])
    probs, order = filtered_probs(logits[:1], first)
    expected = torch.zeros(VOCAB).scatter(0, order[0], probs[0])
    freq = torch.bincount(ids, minlength=VOCAB).float() / 4000
    assert torch.allclose(freq, expected, atol=0.03)
    assert set(ids.tolist()) <= set(torch.nonzero(expected).flatten().tolist())


def test_hashed_uniform_is_deterministic_and_spread():
    seeds = torch.tensor([7] * 1000, dtype=torch.int64)
    steps = torch.arange(1000)
    u = hashed_uniform(seeds, steps)
    assert torch.equal(u, hashed_uniform(seeds, steps))
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean().item() - 0.5) < 0.05
    assert not torch.equal(u, hashed_uniform(seeds + 1, steps))


@pytest.mark.parametrize("params, field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"), ({"top_k": -2}, "top_k"), ({"n": 0}, "n"), ({"repetition_penalty": 0.0},
    "repetition_penalty"), ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
    ({"stop": 5}, "stop"), ({"stop": ["ok", 3]}, "stop"), ({"min_p": 1.5}, "min_p"),
    ({"frequency_penalty": 3}, "frequency_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"stop_token_ids": "5"}, "stop_token_ids"), ({"sampling_seed": -3}, "sampling_seed"),
    ({"sampling_seed": 2**63}, "sampling_seed"), ({"sampling_seed": 2**63 - 2, "n": 3}, "sampling_seed"),
    ({"json_schema": 5}, "json_schema"), ({"regex": "a+", "ebnf": "root ::= \"a\""}, "at most one of"),
])
def test_bad_sampling_params_name_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(params)
