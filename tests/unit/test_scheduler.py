"""The scheduler with a fake model runner: batching limits, chunking, ordering, retraction and finishing, checked
against what each request would produce alone. The fake's next token is a function of the last token and its
position, so any mix-up of tokens, positions or requests inside a batch changes the outputs."""

from __future__ import annotations

import random

import pytest
import torch

from radixmesh.engine.batch import ForwardMode
from radixmesh.engine.cache.kv_pool import KVPool
from radixmesh.engine.cache.manager import CacheManager
from radixmesh.engine.cache.radix_tree import RadixTree
from radixmesh.engine.cache.req_to_token import ReqToTokenPool
from radixmesh.engine.request import FinishKind, Req
from radixmesh.engine.sampling.params import SamplingParams
from radixmesh.engine.sampling.sampler import SampleResult
from radixmesh.engine.scheduler import Scheduler
from radixmesh.engine.scheduler.prefill_planner import PlannerLimits
from radixmesh.engine.step_runner import StepRunner

VOCAB = 97
EOS = 0


def next_token(last: int, pos: int) -> int:
    return (last * 31 + pos * 7 + 3) % VOCAB


class FakeModel:
    """Stands in for the ModelRunner under the real StepRunner: its "logits" are the next token itself."""

    device = torch.device("cpu")
    model_config = type("Cfg", (), {"vocab_size": VOCAB})
    penalties = None

    def __init__(self):
        self.batches = []

    def forward(self, batch):
        self.batches.append((batch.mode, list(batch.extend_lens_host)))
        batch.fill_pending()
        last = batch.input_ids[batch.logits_indices]
        pos = batch.positions[batch.logits_indices]
        return (last * 31 + pos * 7 + 3) % VOCAB

    def sample(self, logits, batch_size, sampling, prompt=None):
        return SampleResult(logits[:batch_size], None)

    def heartbeat(self):
        pass


def alone(ids: list[int], max_new: int) -> list[int]:
    out, seq = [], list(ids)
    while len(out) < max_new:
        tok = next_token(seq[-1], len(seq) - 1)
        out.append(tok)
        seq.append(tok)
        if tok == EOS:
            break
    return out


def make(page=1, pages=512, chunk=16, max_prefill=64, max_running=4, policy="fcfs", mixed=False, tree=True,
         conservativeness=1.0):
    kv = KVPool(pages, page, 1, 1, 2, torch.float32, torch.device("cpu"))
    cache = CacheManager(kv, ReqToTokenPool(max_running, 256, torch.device("cpu")), RadixTree(page) if tree else None)
    runner = FakeModel()
    sched = Scheduler(StepRunner(runner), cache, PlannerLimits(max_prefill, chunk, max_running, page, policy), conservativeness,
                      mixed, context_len=250)
    return sched, runner


def submit(sched, prompts, max_new=12):
    outs = {}
    reqs = []
    for i, p in enumerate(prompts):
        params = SamplingParams(max_new_tokens=max_new, temperature=0)
        r = Req(rid=str(i), input_ids=p, sampling=params, stop_ids=frozenset({EOS}),
                sink=lambda o, i=i: outs.setdefault(i, []).append(o), arrival=float(i))
        sched.requests.add(r, decode_role=False)
        reqs.append(r)
    return reqs, outs


def run_all(sched, limit=10_000):
    for _ in range(limit):
        if not sched.has_work():
            return
        sched.step()
    raise AssertionError("scheduler did not finish")


def prompts_for(seed, n=10, shared=True):
    rng = random.Random(seed)
    base = [rng.randrange(1, VOCAB) for _ in range(40)]
    out = []
    for i in range(n):
        head = base[: rng.randrange(0, 40)] if shared and i % 2 else []
        out.append(head + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 60))])
    return out


def check_done(sched, reqs, prompts, max_new=12):
    for r, p in zip(reqs, prompts):
        assert r.finished and r.output_ids == alone(p, max_new), r.rid
        expected = FinishKind.STOP if r.output_ids[-1] == EOS and len(r.output_ids) < max_new else FinishKind.LENGTH
        assert r.finish_reason.kind is expected
    assert sched.flush_cache()
    assert sched.cache.pages.num_free == sched.cache.pages.num_pages
    held = sched.requests
    assert not (held.waiting or held.prefilling or held.running or held.chunked or held.held), "a request stayed"


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("tree", [False, True])
def test_outputs_equal_running_alone(page, mixed, tree):
    sched, runner = make(page=page, mixed=mixed, tree=tree)
    prompts = prompts_for(page)
    reqs, outs = submit(sched, prompts)
    run_all(sched)
    check_done(sched, reqs, prompts)
    for mode, extend in runner.batches:
        assert sum(1 for e in extend if e > 1 or mode is ForwardMode.EXTEND) <= 4  # max_running_requests
        prefill_tokens = sum(e for e in extend if mode is ForwardMode.EXTEND)
        assert prefill_tokens <= 16 + (4 if mixed else 0)  # chunked_prefill_size (+ one token per mixed decode)
    if mixed:
        assert any(m is ForwardMode.EXTEND and 1 in e and max(e) > 1 for m, e in runner.batches)
    # Streaming outputs add up to the final output, and the last one is marked finished.
    for i, r in enumerate(reqs):
        assert sum((o.new_token_ids for o in outs[i]), []) == r.output_ids
        assert outs[i][-1].finished and not any(o.finished for o in outs[i][:-1])


def test_tiny_pool_retracts_and_still_finishes():
    sched, _ = make(page=2, pages=48, chunk=16, max_running=6, conservativeness=0.01)  # the longest fits alone
    prompts = prompts_for(3, n=8)
    reqs, _ = submit(sched, prompts, max_new=20)
    run_all(sched)
    check_done(sched, reqs, prompts, max_new=20)
    assert sched.stats["retractions"] > 0


def test_lpm_admits_longest_cached_prefix_first():
    sched, runner = make(max_running=1, chunk=-1, policy="lpm")
    base = list(range(1, 33))
    warm, _ = submit(sched, [base + [50]], max_new=1)
    run_all(sched)
    reqs, _ = submit(sched, [[60, 61, 62], base + [70, 71], base[:8] + [80]], max_new=2)
    sched.step()
    first = next(r for r in reqs if r.state.value != "waiting")
    assert first.input_ids == base + [70, 71] and first.cached_tokens == 32


def test_abort_frees_everything():
    sched, _ = make()
    reqs, outs = submit(sched, prompts_for(5, n=4), max_new=50)
    sched.step()
    sched.step()
    for r in reqs:
        sched._abort(r.rid)
    assert not sched.has_work()
    assert all(r.finish_reason.kind is FinishKind.ABORT for r in reqs)
    assert sched.flush_cache() and sched.cache.pages.num_free == sched.cache.pages.num_pages


def test_request_that_outgrows_the_whole_pool_is_aborted_and_others_finish():
    sched, _ = make(page=2, pages=40, chunk=16, max_running=6)  # 80 tokens
    big, small = [5] * 70, [7] * 10
    reqs, _ = submit(sched, [big, small], max_new=20)
    run_all(sched)
    assert reqs[0].finish_reason.kind is FinishKind.ABORT and "too small" in reqs[0].finish_reason.message
    assert reqs[1].output_ids == alone(small, 20)
    assert sched.flush_cache() and sched.cache.pages.num_free == sched.cache.pages.num_pages


def test_max_prefill_tokens_bounds_a_batch_of_several():
    sched, runner = make(chunk=-1, max_prefill=64, max_running=8)
    prompts = [[i + 1] * n for i, n in enumerate([40, 20, 30, 90, 10])]
    reqs, _ = submit(sched, prompts, max_new=4)
    run_all(sched)
    check_done(sched, reqs, prompts, max_new=4)
    prefills = [extend for mode, extend in runner.batches if mode is ForwardMode.EXTEND]
    assert all(sum(e) <= 64 or len(e) == 1 for e in prefills), prefills
    assert [90] in prefills  # a lone prompt larger than the budget still runs


def test_steps_do_not_keep_earlier_steps_alive():
    """A step reads the step in flight for its pending inputs; kept past execute, every step would hold the one
    before it and the whole history would stay in memory (device tensors, pinned copies, a slower collector)."""
    import gc

    from radixmesh.engine.scheduler.step import StepResult

    def alive() -> int:
        gc.collect()
        return sum(type(o) is StepResult for o in gc.get_objects())

    sched, runner = make(page=4, mixed=True)
    sched.overlap = True
    prompts = prompts_for(3)
    reqs, _ = submit(sched, prompts)
    before = alive()
    for _ in range(40):
        sched.step()
    assert sched.stats["forward_decode"] + sched.stats["forward_extend"] == 40 and alive() - before <= 1
    run_all(sched)
    check_done(sched, reqs, prompts)
