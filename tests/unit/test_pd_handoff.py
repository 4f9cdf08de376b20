"""The engine's side of prefill/decode disaggregation, with two engines in one process and the fake transfer
backend: a prefill-role request pins its KV and hands over its first token; a decode-role request pre-allocates,
receives the pages and decodes on, token-identical (with logprobs) to a colocated engine; a decode-side cached
prefix is not transferred again; aborts and failed handoffs free every page."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from radixmesh.engine.disaggregation.fake_backend import Faults
from radixmesh.engine.disaggregation.handoff import DecodeRole, PrefillRole
from radixmesh.engine.disaggregation.kv_pages import kv_writes, layout_of, page_checksum, register_pool
from radixmesh.engine.disaggregation.registry import make_backend
from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine

OPTS = {"page_size": 16, "chunked_prefill_size": 64, "max_total_tokens": 4096}
_rids = itertools.count()


class Pair:
    """A prefill engine and a decode engine joined by fake transfer backends, doing what the services do."""

    def __init__(self, prefill, decode, faults: Faults | None = None):
        self.p, self.d = prefill, decode
        self.bp, self.bd = make_backend("fake", faults=faults), make_backend("fake")
        register_pool(self.bp, prefill.runner.kv_pool)
        register_pool(self.bd, decode.runner.kv_pool)
        self.transferred_pages: list[int] = []

    async def generate(self, ids: list[int], params: dict, verify: bool = False, **lp) -> dict:
        loop = asyncio.get_running_loop()
        ready, allocated = loop.create_future(), loop.create_future()
        rid = f"pd-{next(_rids)}"
        prole = PrefillRole(lambda pages, first: loop.call_soon_threadsafe(ready.set_result, (pages, first)))
        drole = DecodeRole(lambda pages, cached: loop.call_soon_threadsafe(allocated.set_result, (pages, cached)))
        decoding = asyncio.create_task(self.d.async_generate(input_ids=ids, sampling_params=params, rid=rid,
                                                             handoff=drole, **lp))
        prefilling = asyncio.create_task(self.p.async_generate(input_ids=ids, sampling_params=params, rid=rid,
                                                               handoff=prole, **lp))
        (src, first), (dst, cached) = await ready, await allocated
        src = src[cached // self.p.args.page_size:]
        drole.in_transfer = True  # as the decode service does once the destination is sent
        self.transferred_pages.append(len(dst))
        try:
            self.bp.write(self.bd.session_id, kv_writes(layout_of(self.p.runner.kv_pool),
                                                        layout_of(self.d.runner.kv_pool), src, dst))
            if verify and page_checksum(self.p.runner.kv_pool, src) != page_checksum(self.d.runner.kv_pool, dst):
                raise RuntimeError("KV checksum mismatch")
        except Exception as e:
            self.d.abort_request(rid, f"KV transfer failed: {e}")  # pinned: in_transfer
            self.d.release_kv(rid).result(timeout=10)
        else:
            drole.in_transfer = False
            assert self.d.deliver_kv(rid, first).result(timeout=10) is True
        finally:
            self.p.release_kv(rid).result(timeout=10)
        await prefilling
        return await decoding


@pytest.fixture(scope="module")
def engines():
    path = model_path("tiny-llama")
    with running_engine(path, **OPTS) as p, running_engine(path, **OPTS) as d, running_engine(path, **OPTS) as c:
        yield p, d, c


LP = {"return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0}


def _flat(x) -> list:
    """Nested logprob lists as one flat list of numbers (None kept) to compare with a tolerance."""
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flat(item)]
    return [x]


def _same(a: dict, b: dict) -> None:
    assert a["output_ids"] == b["output_ids"]
    for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs"):
        got, want = _flat(a["meta_info"][key]), _flat(b["meta_info"][key])
        assert [v is None for v in got] == [v is None for v in want], key
        assert [v for v in got if v is not None] == pytest.approx([v for v in want if v is not None], abs=1e-5)
    assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]


def test_pd_matches_colocated_and_reuses_the_decode_cache(engines):
    p, d, c = engines
    pair = Pair(p, d)
    prompts = parity_prompts(model_path("tiny-llama"))
    params = [{"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}, {"max_new_tokens": 1},
              {"max_new_tokens": 0}, {"max_new_tokens": 9, "temperature": 0.0, "frequency_penalty": 0.5}]

    async def run():
        for rnd in range(2):  # the second round finds every prompt cached on both sides
            for i, ids in enumerate(prompts):
                sp = params[i % len(params)]
                want = await c.async_generate(input_ids=ids, sampling_params=sp, **LP)
                got = await pair.generate(ids, sp, verify=True, **LP)
                _same(got, want)
                assert got["meta_info"]["cached_tokens"] == want["meta_info"]["cached_tokens"] or rnd == 0
    asyncio.run(run())
    n = len(prompts)
    first, second = pair.transferred_pages[:n], pair.transferred_pages[n:]
    assert sum(second) < sum(first) / 4, (first, second)  # cached prefixes were not sent again


def test_a_migrated_request_resumes_on_a_pair(engines):
    """A stream migrated onto a PD pair (resume_ids): the prefill side prefills the prompt and the tokens so far and
    samples the next (its seeded step and penalties count them), the decode side receives all those pages and
    decodes on: the output equals the colocated engine's, and the pages come back."""
    p, d, c = engines
    ids = parity_prompts(model_path("tiny-llama"), seed=5)[2]
    for sp in ({"max_new_tokens": 14, "temperature": 0.0, "ignore_eos": True},
               {"max_new_tokens": 14, "temperature": 0.8, "sampling_seed": 9, "frequency_penalty": 0.6,
                "ignore_eos": True}):
        full = c.generate(input_ids=ids, sampling_params=sp)["output_ids"]
        for k in (1, 7):
            got = asyncio.run(Pair(p, d).generate(ids, sp, resume_ids=full[:k]))
            assert got["output_ids"] == full, (sp, k)
    for engine in (p, d):
        load = engine.get_load()
        assert load["prealloc_rooms"] == 0 and load["held_rooms"] == 0


def test_many_concurrent_handoffs_under_memory_pressure():
    path = model_path("tiny-llama")
    small = {**OPTS, "max_total_tokens": 512, "num_reserved_decode_tokens": 64}
    with running_engine(path, **OPTS) as p, running_engine(path, **small) as d, \
            running_engine(path, **OPTS) as c:
        pair = Pair(p, d)
        prompts = parity_prompts(path, seed=3)
        sp = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}

        async def run():
            got = await asyncio.gather(*(pair.generate(ids, sp) for ids in prompts * 3))
            want = await asyncio.gather(*(c.async_generate(input_ids=ids, sampling_params=sp) for ids in prompts))
            assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want] * 3
        asyncio.run(run())
        assert d.get_load()["prealloc_waiting"] == 0


def test_failed_and_corrupted_transfers_free_every_page(engines):
    p, d, _ = engines
    ids = parity_prompts(model_path("tiny-llama"), seed=7)[7]
    sp = {"max_new_tokens": 5, "temperature": 0.0}
    for faults, message in ((Faults(drop=True), "injected drop"), (Faults(corrupt=True), "checksum mismatch")):
        pair = Pair(p, d, faults)
        d.flush_cache()
        out = asyncio.run(pair.generate(ids, sp, verify=True))
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and message in reason["message"], reason
        assert out["output_ids"] == []  # no token of a request whose KV is suspect
        load = d.get_load()
        assert load["held_rooms"] == load["prealloc_rooms"] == 0
        assert load["available_kv_tokens"] == load["max_total_num_tokens"] - d.cache.evictable_tokens()


def test_aborting_a_queued_or_receiving_request_frees_its_pages(engines):
    _, d, _ = engines
    ids = parity_prompts(model_path("tiny-llama"), seed=9)[6]

    async def run():
        loop = asyncio.get_running_loop()
        allocated = loop.create_future()
        role = DecodeRole(lambda pages, cached: loop.call_soon_threadsafe(allocated.set_result, pages))
        task = asyncio.create_task(d.async_generate(input_ids=ids, sampling_params={"max_new_tokens": 4},
                                                    rid="waits-forever", handoff=role))
        assert len(await allocated) == -(-len(ids) // 16)
        assert d.get_load()["prealloc_rooms"] == 1
        d.abort_request("waits-forever", "the prefill worker went away")
        out = await task
        assert out["meta_info"]["finish_reason"]["message"] == "the prefill worker went away"
    asyncio.run(run())
    assert d.deliver_kv("waits-forever", None).result(timeout=10) is False  # too late: nothing to deliver to
    load = d.get_load()
    assert load["prealloc_rooms"] == 0 and load["available_kv_tokens"] == load["max_total_num_tokens"]


@pytest.mark.parametrize("src,dst", [([3, 4, 9], [20, 7, 8]),  # a few runs
                                     ([30, 2, 17, 5, 11, 8, 25, 14, 3, 21, 9], list(range(40, 29, -1)))])  # scattered
def test_staged_transfer_through_host_mirrors_moves_the_pages(engines, src, dst):
    """The GPU path (pool -> pinned mirror -> backend -> peer mirror -> pool), forced on CPU pools: the pages land
    in one run of the receiver's mirror, whatever the pool pages, and every mirror page is lent back."""
    from radixmesh.services.common.kv_transfer import KvTransfer

    p, d, _ = engines
    assert p.flush_cache() and d.flush_cache()  # no cached prefix lives in the pages scribbled on below
    send, recv = KvTransfer(p, "fake", "127.0.0.1", stage=True), KvTransfer(d, "fake", "127.0.0.1", stage=True)
    assert send.layout.bases != layout_of(p.runner.kv_pool).bases  # the mirrors, not the pools
    for t in p.runner.kv_pool.buffers():
        t.view(-1)[:t.numel() // 2].uniform_()
    before = page_checksum(d.runner.kv_pool, dst)
    landing = recv.hold(dst)
    assert landing == list(range(len(dst)))  # one run of mirror pages

    async def move():
        return await send.write(recv.session_id, recv.layout, src, landing, verify=True)
    sent = asyncio.run(move())
    assert sent == recv.checksum(landing) == page_checksum(p.runner.kv_pool, src)
    assert page_checksum(d.runner.kv_pool, dst) == before  # not in the pool until staged in
    recv.stage_in(landing, dst)
    recv.release(landing)
    assert page_checksum(d.runner.kv_pool, dst) == page_checksum(p.runner.kv_pool, src)
    whole = recv.mirror.local[0].shape[0] // d.args.page_size
    assert send.mirror.slots.num_free == recv.mirror.slots.num_free == whole  # nothing still lent
    assert send.gbps > 0 and send.latency_ms > 0
    for t in p.runner.kv_pool.buffers() + d.runner.kv_pool.buffers():
        t.zero_()
    send.close()
    recv.close()


def test_an_abort_while_the_last_prefill_step_is_in_flight_frees_its_pages(engines, monkeypatch):
    """The caller of a prefill-role request gives up (the router stopped waiting for a hung prefill worker) just
    after the request's last prefill step was launched: the overlap scheduler resolves that step one step later, and
    until then the request is in no queue. The abort and the service's release_kv both land in that gap; the request
    must end aborted, never hand over, and keep no page."""
    p, _, _ = engines
    sched = p.scheduler
    assert sched.overlap  # without overlap a step resolves before the inbox is read again: no gap
    ids = parity_prompts(model_path("tiny-llama"), seed=10)[2]
    assert len(ids) < OPTS["chunked_prefill_size"]  # one prefill step
    rid, execute, handed = "aborted-in-flight", sched._execute, []

    def execute_then_abort(batch):
        result = execute(batch)
        if any(r.rid == rid for r in batch.reqs):  # as the service does when its call is cancelled: abort, release
            sched.abort(rid, "the router gave up on this worker")
            sched.call(lambda: sched.release_kv(rid))
        return result
    monkeypatch.setattr(sched, "_execute", execute_then_abort)

    async def run():
        role = PrefillRole(lambda pages, first: handed.append(pages))
        return await p.async_generate(input_ids=ids, sampling_params={"max_new_tokens": 4}, rid=rid, handoff=role)
    out = asyncio.run(run())
    assert out["meta_info"]["finish_reason"]["message"] == "the router gave up on this worker"
    assert handed == []
    load = p.get_load()
    assert load["held_rooms"] == 0 and load["available_kv_tokens"] == load["max_total_num_tokens"], load


def test_an_abort_that_arrives_while_the_request_is_prepared_is_not_lost(engines, monkeypatch):
    """The decode worker's handoff can fail at once (the prefill worker's bootstrap port refuses the connection)
    while the engine still prepares the request on its prep threads: the abort reaches the scheduler before the
    request. It must still end the request, not leave it waiting for KV that never comes; likewise an abort of
    one sample of an n = 2 request during its preparation."""
    _, d, c = engines
    ids = parity_prompts(model_path("tiny-llama"), seed=11)[1]
    for engine in (d, c):
        specs = engine._specs
        monkeypatch.setattr(engine, "_specs", lambda *a, _specs=specs: (time.sleep(0.3), _specs(*a))[1])

    async def run():
        loop = asyncio.get_running_loop()
        role = DecodeRole(lambda pages, cached: None)
        waiting = asyncio.create_task(d.async_generate(input_ids=ids, sampling_params={"max_new_tokens": 4},
                                                       rid="refused", handoff=role))
        sampled = asyncio.create_task(c.async_generate(input_ids=ids, rid="two", sampling_params={
            "max_new_tokens": 4, "n": 2, "temperature": 1.0, "sampling_seed": 3}))
        await asyncio.sleep(0.05)  # both are being prepared
        d.abort_request("refused", "the prefill worker refused the handoff")
        c.abort_request("two-1", "sample 1 is not wanted")
        started = loop.time()
        got = await asyncio.wait_for(waiting, 10), await asyncio.wait_for(sampled, 10)
        return got, loop.time() - started
    (refused, two), took = asyncio.run(run())
    assert refused["meta_info"]["finish_reason"]["message"] == "the prefill worker refused the handoff"
    assert two[0]["meta_info"]["finish_reason"]["type"] == "length"
    assert two[1]["meta_info"]["finish_reason"]["message"] == "sample 1 is not wanted"
    assert took < 5
    for engine in (d, c):
        load = engine.get_load()
        assert load["prealloc_waiting"] == load["prealloc_rooms"] == 0, load
        assert load["available_kv_tokens"] == load["max_total_num_tokens"], load
        assert engine._early_aborts._pending == {} and engine._early_aborts._preparing == {}


def test_a_call_whose_awaiting_task_was_cancelled_does_not_stop_the_scheduler(engines):
    """A decode worker's handoff awaits the engine's deliver_kv through asyncio.wrap_future; when its Generate call
    ends first (a chaos run: the prefill worker killed, the router moving the request), the task is cancelled and
    so is the Future, still queued behind the scheduler's work. The scheduler skips it and serves on (it crashed
    here, setting a result on the cancelled Future, and took the worker down)."""
    _, _, c = engines
    ran = []

    async def run():
        busy = c.scheduler.call(lambda: time.sleep(0.3))  # the scheduler thread is busy while the next call queues
        async def deliver():  # as the handoff task awaits deliver_kv
            return await asyncio.wrap_future(c.scheduler.call(lambda: ran.append("skipped")))
        waiter = asyncio.create_task(deliver())
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.wait_for(asyncio.wrap_future(busy), 5)
        return await asyncio.wait_for(asyncio.wrap_future(c.scheduler.call(lambda: ran.append("after") or len(ran))), 5)
    assert asyncio.run(run()) == 1 and ran == ["after"]
    out = c.generate(input_ids=parity_prompts(model_path("tiny-llama"), seed=3)[0],
                     sampling_params={"max_new_tokens": 2})
    assert len(out["output_ids"]) == 2


def test_an_fp8_kv_cache_hands_over_half_the_bytes_and_decodes_as_colocated():
    """--kv-cache-dtype fp8_e4m3 on both sides: the pages move as fp8 bytes (a quarter of float32's) and the handed
    over request decodes as a colocated fp8 engine does (its first token from the prefill's unrounded chunk, every
    later one from the rounded cache, on both)."""
    path = model_path("tiny-llama")
    opts = {**OPTS, "kv_cache_dtype": "fp8_e4m3"}
    with running_engine(path, **opts) as p, running_engine(path, **opts) as d, running_engine(path, **opts) as c:
        pool = p.runner.kv_pool
        assert pool.page_bytes == pool.page_size * pool.k[0][0].numel()  # one byte an element
        pair = Pair(p, d)
        sp = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}

        async def run():
            for ids in parity_prompts(path)[:3]:
                _same(await pair.generate(ids, sp, verify=True, **LP),
                      await c.async_generate(input_ids=ids, sampling_params=sp, **LP))
        asyncio.run(run())
