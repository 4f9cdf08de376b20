"""Verification of drafted tokens (engine.speculative.verify) and n-gram drafts (engine.speculative.ngram).

The statistical tests draw many verifies of one position set and compare the tokens' frequencies with the target
distributions by a chi-square test: rejection sampling against a one-hot draft must give each output token the
distribution plain sampling would (filters and temperature included), whether the draft is likely or unlikely."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from radixmesh.engine.sampling.params import SamplingParams
from radixmesh.engine.sampling.sampler import SamplingBatch
from radixmesh.engine.speculative.ngram import NgramCorpus, NgramIndex
from radixmesh.engine.speculative.verify import VerifyLayout, verify

VOCAB = 6


def rows_for(params: SamplingParams, n_reqs: int, width: int, **extra) -> SamplingBatch:
    """A SamplingBatch of n_reqs identical requests, each `width` positions."""
    req = SimpleNamespace(sampling=params, output_ids=[], stop_ids=frozenset(), matcher=None, finished=False,
                          logprob=None, pool_idx=0, **extra)
    rows = [req] * (n_reqs * width)
    return SamplingBatch.build(rows, False, VOCAB, torch.device("cpu"), offsets=list(range(width)) * n_reqs)


def layout_logits(position_logits: list[list[float]], drafts: list[list[int]]) -> torch.Tensor:
    """The forward's logits rows (one per new token: each request's positions in order, requests in batch order)
    when every request of drafts of equal length has the same per-position logits."""
    return torch.tensor(position_logits).repeat(len(drafts), 1)


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Counts consistent with probs: the statistic below the 0.999 quantile (dof + 4.5 * sqrt(2 dof) bounds it for
    the few degrees of freedom here), categories of zero probability never drawn."""
    n = counts.sum()
    assert not bool(counts[probs == 0].any()), f"drew a token of probability 0: {counts.tolist()}"
    live = probs > 0
    expected = probs[live] * n
    stat = float(((counts[live] - expected) ** 2 / expected).sum())
    dof = int(live.sum()) - 1
    return stat < dof + 4.5 * math.sqrt(2 * dof) + 1


def test_greedy_keeps_the_drafts_the_argmax_agrees_with():
    logits = [[0, 5, 0, 0, 0, 0], [0, 0, 5, 0, 0, 0], [0, 0, 0, 5, 0, 0], [9, 0, 0, 0, 0, 0]]
    params = SamplingParams(temperature=0, max_new_tokens=10)
    for draft, want in [([1, 2, 3], [1, 2, 3, 0]), ([1, 4, 3], [1, 2]), ([5, 2, 3], [1])]:
        layout = VerifyLayout.build([draft], torch.device("cpu"))
        out = verify(layout_logits(logits, [draft]), layout, rows_for(params, 1, 4), None)
        got = out.tokens[0, :int(out.accepted[0]) + 1].tolist()
        assert got == want
        assert int(out.next_ids[0]) == want[-1]


def test_rows_of_different_draft_lengths_share_a_batch():
    """Padding positions (past a short draft) never count: a row without a draft samples its one token."""
    params = SamplingParams(temperature=0, max_new_tokens=10)
    drafts = [[2, 3], [], [4]]
    layout = VerifyLayout.build(drafts, torch.device("cpu"))
    # three rows per request (the widest): request 0's three positions, request 1's one and two padding rows,
    # request 2's two and one padding row
    logits = torch.full((9, VOCAB), 0.0)
    for row, best in [(0, 2), (1, 3), (2, 5), (3, 1), (6, 4), (7, 0)]:
        logits[row, best] = 5.0
    out = verify(logits, layout, rows_for(params, 3, layout.width), None)
    assert [out.tokens[i, :int(a) + 1].tolist() for i, a in enumerate(out.accepted)] == [[2, 3, 5], [1], [4, 0]]


@pytest.mark.parametrize("temperature,top_k,draft_token", [(1.0, 0, 2), (0.7, 4, 0), (1.3, 0, 5)])
def test_rejection_sampling_keeps_the_target_distribution(temperature, top_k, draft_token):
    """Position 0's token follows p0 whether the draft is its likeliest token or a rare one; when the draft is kept,
    the token after it follows p1."""
    torch.manual_seed(0)
    n = 60000
    logits = [[2.0, 0.5, 1.5, -1.0, 0.0, -2.0], [0.3, -0.5, 1.0, 2.0, -1.0, 0.0]]
    params = SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=10)
    drafts = [[draft_token]] * n
    layout = VerifyLayout.build(drafts, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    out = verify(layout_logits(logits, drafts), layout, rows_for(params, n, 2), gen)

    def target(row):
        t = torch.tensor(row) / temperature
        if top_k:
            t[t < t.topk(top_k).values[-1]] = float("-inf")
        return torch.softmax(t, dim=-1)

    p0, p1 = target(logits[0]), target(logits[1])
    first = out.tokens[:, 0]
    assert chi_square_ok(torch.bincount(first, minlength=VOCAB).double(), p0.double())
    kept = out.accepted == 1
    assert torch.equal(kept, first == draft_token)  # a rejected draft is never drawn again
    if int(kept.sum()) > 2000:
        second = out.tokens[kept, 1]
        assert chi_square_ok(torch.bincount(second, minlength=VOCAB).double(), p1.double())


def test_seeded_rows_draw_the_same_tokens_in_any_batch():
    params = SamplingParams(temperature=1.0, max_new_tokens=10, sampling_seed=11)
    logits = [[1.0, 0.5, 0.2, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 1.0, 0.0, 0.0]]
    one = verify(layout_logits(logits, [[0]]), VerifyLayout.build([[0]], torch.device("cpu")),
                 rows_for(params, 1, 2), torch.Generator().manual_seed(1))
    many = verify(layout_logits(logits, [[0]] * 5), VerifyLayout.build([[0]] * 5, torch.device("cpu")),
                  rows_for(params, 5, 2), torch.Generator().manual_seed(2))
    assert all(torch.equal(many.tokens[i], one.tokens[0]) for i in range(5))


def test_ngram_drafts_follow_the_longest_latest_match():
    index = NgramIndex(1, 4)
    seq = [5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6, 7]
    # suffix (5, 6, 7) matched at positions 0-2 (length 3) beats (5, 6) at 5-6: the draft continues with 8, 1
    assert index.propose(seq, 2) == [8, 1]
    assert index.propose(seq + [8], 3) == [1, 5, 6]
    assert index.propose([1, 2, 3], 4) == []  # nothing repeats
    assert index.propose([4], 2) == []


def test_ngram_drafts_continue_a_short_period():
    index = NgramIndex(1, 12)
    assert index.propose([3, 1, 2, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]


def test_ngram_min_window_refuses_short_matches():
    assert NgramIndex(3, 5).propose([1, 2, 9, 9, 1, 2], 3) == []
    assert NgramIndex(2, 5).propose([1, 2, 9, 9, 1, 2], 3) == [9, 9, 1]


def test_rejection_sampling_with_a_draft_distribution_keeps_the_target_distribution():
    """A draft model's tokens are drawn from its own q: kept with probability min(1, p/q), resampled from
    max(p - q, 0) on rejection. Position 0's token follows p0 whatever q is (here one far from p)."""
    n = 60000
    gen = torch.Generator().manual_seed(3)
    logits = [[2.0, 0.5, 1.5, -1.0, 0.0, -2.0], [0.3, -0.5, 1.0, 2.0, -1.0, 0.0]]
    q0 = torch.tensor([0.05, 0.4, 0.05, 0.3, 0.1, 0.1])
    drafts_t = torch.multinomial(q0, n, replacement=True, generator=gen)
    drafts = [[int(t)] for t in drafts_t]
    layout = VerifyLayout.build(drafts, torch.device("cpu"))
    q = torch.zeros((n, 2, VOCAB))
    q[:, 0] = q0
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    out = verify(layout_logits(logits, drafts), layout, rows_for(params, n, 2), gen, draft_probs=q)
    p0 = torch.softmax(torch.tensor(logits[0]), dim=-1)
    assert chi_square_ok(torch.bincount(out.tokens[:, 0], minlength=VOCAB).double(), p0.double())
    # drafts are kept at speculative sampling's rate, the overlap sum_x min(p(x), q(x))
    rate = float((out.accepted == 1).double().mean())
    assert abs(rate - float(torch.minimum(p0, q0).sum())) < 0.015, rate


def test_the_corpus_drafts_what_followed_in_earlier_requests():
    corpus = NgramCorpus(capacity=1000)
    corpus.add([10, 11, 12, 13, 14, 15])
    corpus.add([20, 11, 12, 30, 31])
    # the suffix (11, 12) occurs in both; the later one wins a tie of length; (10, 11, 12) is longer
    assert NgramIndex(1, 4, corpus).propose([7, 11, 12], 3) == [30, 31]
    assert NgramIndex(1, 4, corpus).propose([10, 11, 12], 5) == [13, 14, 15]  # never past a sequence's end
    assert NgramIndex(1, 4, corpus).propose([7, 15], 3) == []  # the last token of a sequence has no continuation
    # the request's own sequence wins a tie with the corpus
    assert NgramIndex(1, 4, corpus).propose([11, 12, 99, 7, 11, 12], 2) == [99, 7]
    assert NgramIndex(3, 4, corpus).propose([7, 11, 12], 3) == []  # below the min window


def test_the_corpus_keeps_at_most_its_capacity():
    corpus = NgramCorpus(capacity=20)
    for base in range(0, 400, 8):
        corpus.add(list(range(base, base + 8)))
    assert corpus.size <= 20 + 4  # two generations of at most half each, separators included
    assert NgramIndex(1, 4, corpus).propose([392, 393], 2) == [394, 395]  # the newest is kept
    assert NgramIndex(1, 4, corpus).propose([0, 1], 2) == []  # the oldest is gone


def test_drafts_that_fit_alone_but_not_together_never_evict_the_prefix_cache():
    """Two requests whose drafts each fit the free pages, but not both: the step allocates request by request, the
    second draft is cut to what is left, and the cached prefix of a finished request stays."""
    from radixmesh.engine.scheduler.spec_steps import SpecSteps
    from tests.unit.test_cache_manager import assert_no_leak, make, new_req, prefill

    cm = make(page=4, num_pages=9)
    done = new_req(range(50, 58), rid="done")
    prefill(cm, done)
    cm.release(done)  # its 8 tokens stay cached (evictable)
    cached = cm.evictable_tokens()
    assert cached == 8
    reqs = [new_req(range(1 + 10 * i, 9 + 10 * i), rid=f"r{i}") for i in range(2)]
    for r in reqs:
        prefill(cm, r)  # 8 tokens each: two whole pages, the newest token included
        r.kv_len = r.fill_len - 1
    free = cm.pages.num_free
    assert free == 3

    class Fixed:
        def propose(self, tokens, k):
            return [7] * k

    spec = SpecSteps(cm, 8, lambda req: Fixed(), context_len=64)  # (the requests may make 128 new tokens)
    drafts, _, width = spec.draft(reqs)
    assert width == 9 and len(drafts[0]) == 8  # two fresh pages for the first
    assert len(drafts[1]) == 4  # the one page left for the second
    assert cm.pages.num_free == 0 and cm.evictable_tokens() == cached
    for r, d in zip(reqs, drafts):
        assert r.extend_len == 1 + len(d) and r.alloc_len == r.fill_len + len(d)
    for r, d in zip(reqs, drafts):
        r.kv_len += r.extend_len  # the verify ran
        spec.verified(r, len(d), [7])  # nothing kept
        assert r.kv_len == r.alloc_len == r.fill_len
    spec.flush()
    assert cm.pages.num_free == free
    for r in reqs:
        cm.release(r)
    assert_no_leak(cm)
