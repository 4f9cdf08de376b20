"""Policy kv_index: which worker it picks given the kvstore's MatchPrefix answers and the workers' measured loads.

A tiny in-process grpc.aio KvStoreService stands in for the kvstore (the real one is tested end to end elsewhere):
the longest device match wins at equal load; a host match beats nothing when host loads are fast (and loses when
they are slow); a deeply queued worker loses to an idle one; a burst between two load polls spreads out; ties go
by rendezvous hashing, identically in two policy instances (two routers); with the kvstore down or hung the choice
is made within the timeout, by load. Then the wiring: GetLoads polled through the registry, and a real router
process with --policy kv_index routing by the index, passing the tenant, and falling back when the kvstore is
gone."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import grpc
import pytest

from radixmesh.v1 import kvstore_pb2, kvstore_pb2_grpc, worker_pb2
from radixmesh.services.launch import free_port
from radixmesh.services.router import kv_index
from radixmesh.services.router.kv_index import KvIndexPolicy
from radixmesh.services.router.rendezvous import prompt_key, rendezvous
from radixmesh.services.router.ttft_cost import (HOST_PRIOR_SPEEDUP, PRIOR_PREFILL_TOKENS_PER_S, Match, Rates,
                                                 WorkerSpeeds, expected_ttft_s, fleet_prefill_rate, rates_of)
from radixmesh.services.router.workers import WorkerRegistry
from tests.conftest import ROOT
from tests.unit.test_router_tenants import (ALPHA_KEY, TENANT_FLAGS, RecordingWorker, bearer, grpc_server, http,
                                            run_router, run_tokenizer, serve_worker)


@dataclass
class W:
    url: str
    in_flight: int = 0


def wm(url: str, device: int = 0, host: int = 0, storage: int = 0) -> kvstore_pb2.WorkerMatch:
    return kvstore_pb2.WorkerMatch(worker_url=url, matched_tokens=device + host, device_tokens=device,
                                   host_tokens=host, storage_tokens=storage)


def loads(prefill: float = 0.0, host: float = 0.0, storage: float = 0.0, queued: int = 0, queue_time: float = 0.0):
    return worker_pb2.GetLoadsResponse(prefill_tokens_per_s=prefill, host_load_tokens_per_s=host,
                                       storage_load_tokens_per_s=storage, queued_prefill_tokens=queued,
                                       queue_time_s=queue_time)


class FakeKvStore(kvstore_pb2_grpc.KvStoreServiceServicer):
    """Answers MatchPrefix with `matches` (after `delay_s`), keeping the requests."""

    def __init__(self):
        self.matches: list[kvstore_pb2.WorkerMatch] = []
        self.delay_s = 0.0
        self.requests: list[kvstore_pb2.MatchPrefixRequest] = []
        self._lock = threading.Lock()

    def answer(self, request) -> kvstore_pb2.MatchPrefixResponse:
        with self._lock:
            self.requests.append(request)
        return kvstore_pb2.MatchPrefixResponse(matches=self.matches)


class AsyncKvStore(kvstore_pb2_grpc.KvStoreServiceServicer):
    def __init__(self, fake: FakeKvStore):
        self.fake = fake

    async def MatchPrefix(self, request, context):
        if self.fake.delay_s:
            await asyncio.sleep(self.fake.delay_s)
        return self.fake.answer(request)


class SyncKvStore(kvstore_pb2_grpc.KvStoreServiceServicer):
    def __init__(self, fake: FakeKvStore):
        self.fake = fake

    def MatchPrefix(self, request, context):
        return self.fake.answer(request)


@pytest.fixture
async def kvstore():
    fake = FakeKvStore()
    server = grpc.aio.server()
    kvstore_pb2_grpc.add_KvStoreServiceServicer_to_server(AsyncKvStore(fake), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield fake, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@contextlib.asynccontextmanager
async def policy_of(url: str, timeout_s: float = 2.0, **kw):
    policy = KvIndexPolicy(url, timeout_s, **kw)
    try:
        yield policy
    finally:
        await policy.close()


PROMPT = list(range(1000, 1300))  # 300 tokens


# ---- the cost model --------------------------------------------------------------------------------------------
def test_cost_model_priors_and_clipping():
    assert fleet_prefill_rate([WorkerSpeeds()]) == PRIOR_PREFILL_TOKENS_PER_S
    assert fleet_prefill_rate([WorkerSpeeds(1000.0), WorkerSpeeds(3000.0), WorkerSpeeds()]) == 2000.0
    r = rates_of(WorkerSpeeds(), 2000.0)
    assert r == Rates(2000.0, 2000.0 * HOST_PRIOR_SPEEDUP, 2000.0)  # an unreported store rate: worth nothing
    assert rates_of(WorkerSpeeds(500.0, 700.0, 900.0), 2000.0) == Rates(500.0, 700.0, 900.0)
    rates = Rates(100.0, 1000.0, 200.0)
    assert expected_ttft_s(300, Match(100, 100, 50), rates, 50) == pytest.approx((50 + 50) / 100 + 0.1 + 0.25)
    # tiers that claim more than the prompt are clipped to it: nothing left to compute, loads only for what fits
    assert expected_ttft_s(100, Match(80, 80, 80), rates, 0) == pytest.approx(20 / 1000)


# ---- choices given the index and the loads ---------------------------------------------------------------------
async def test_longest_device_match_wins_at_equal_load(kvstore):
    fake, url = kvstore
    fake.matches = [wm("b:2", device=256), wm("a:1", device=64)]  # c:3 is not in the index: matched 0
    ws = [W("a:1"), W("b:2"), W("c:3")]
    async with policy_of(url) as policy:
        assert (await policy.pick_async(ws, PROMPT, "alpha")).url == "b:2"
        assert policy.decisions.snapshot()["by_reason"] == {"index": 1, "tie": 0, "fallback": 0}
        assert fake.requests[-1].tenant == "alpha" and list(fake.requests[-1].token_ids) == PROMPT
        fake.matches = [wm("grpc://c:3", device=288), wm("b:2", device=256)]  # URLs as registered, normalized
        assert (await policy.pick_async(ws, PROMPT)).url == "c:3"
        assert fake.requests[-1].tenant == ""


async def test_a_fast_host_match_beats_nothing_and_a_slow_one_does_not(kvstore):
    fake, url = kvstore
    fake.matches = [wm("a:1", host=256)]
    ws = [W("a:1"), W("b:2")]
    async with policy_of(url) as policy:
        for u in ("a:1", "b:2"):
            policy.observe_loads(u, loads(prefill=10_000, host=200_000))
        assert (await policy.pick_async(ws, PROMPT)).url == "a:1"
    async with policy_of(url) as policy:
        for u in ("a:1", "b:2"):  # loading from host slower than recomputing: the empty worker is quicker
            policy.observe_loads(u, loads(prefill=10_000, host=2_000))
        assert (await policy.pick_async(ws, PROMPT)).url == "b:2"
    async with policy_of(url) as policy:  # nothing measured: the priors rank host loads above recomputing
        assert (await policy.pick_async(ws, PROMPT)).url == "a:1"
    fake.matches = [wm("b:2", storage=256)]
    async with policy_of(url) as policy:  # store hits count only at a rate the worker reported (it waits for them)
        policy.observe_loads("b:2", loads(prefill=10_000, storage=50_000))
        assert (await policy.pick_async(ws, PROMPT)).url == "b:2"
    async with policy_of(url) as policy:  # no rate reported (best_effort, or not measured): a tie, by hash
        assert policy.costs(ws, PROMPT, {"b:2": wm("b:2", storage=256)})[0] == pytest.approx(
            policy.costs(ws, PROMPT, {"b:2": wm("b:2", storage=256)})[1])


async def test_a_deeply_queued_worker_loses_to_an_idle_one(kvstore):
    fake, url = kvstore
    fake.matches = [wm("a:1", device=288)]
    ws = [W("a:1"), W("b:2")]
    async with policy_of(url) as policy:
        policy.observe_loads("a:1", loads(prefill=10_000, queued=200_000, queue_time=20.0))
        policy.observe_loads("b:2", loads(prefill=10_000, queued=0))
        assert (await policy.pick_async(ws, PROMPT)).url == "b:2"
        # a short wait: the cache wins again (288 cached tokens are worth 29 ms at 10k tokens/s)
        policy.observe_loads("a:1", loads(prefill=10_000, queued=100, queue_time=0.01))
        assert (await policy.pick_async(ws, PROMPT)).url == "a:1"


async def test_a_burst_between_polls_spreads_over_the_workers(kvstore):
    fake, url = kvstore
    ws = [W("a:1"), W("b:2"), W("c:3")]
    async with policy_of(url) as policy:
        picks = [(await policy.pick_async(ws, PROMPT)).url for _ in range(6)]
        assert sorted(picks) == ["a:1", "a:1", "b:2", "b:2", "c:3", "c:3"]  # the same prompt, yet spread out
        assert policy.routed == {"a:1": 600, "b:2": 600, "c:3": 600}
        for u in ("a:1", "b:2", "c:3"):  # the poll took them into the workers' own queue counts
            policy.observe_loads(u, loads())
        assert policy.routed == {"a:1": 0, "b:2": 0, "c:3": 0}


async def test_ties_go_by_rendezvous_hashing_the_same_in_two_routers(kvstore):
    fake, url = kvstore
    ws = [W("10.0.0.1:8000"), W("10.0.0.2:8000"), W("10.0.0.3:8000")]
    prompts = [[7, 7, i, i * 31 % 997] + list(range(50)) for i in range(100)]
    async with policy_of(url) as one, policy_of(url) as two:
        choices = []
        for prompt in prompts:
            a = await one.pick_async(ws, prompt)
            b = await two.pick_async(list(reversed(ws)), prompt)  # the candidates' order does not matter
            assert a.url == b.url == rendezvous(ws, prompt_key(prompt)).url
            choices.append(a.url)
            for policy in (one, two):  # idle again, as after a load poll of idle workers
                for w in ws:
                    policy.observe_loads(w.url, loads())
        assert one.decisions.by_reason["tie"] == two.decisions.by_reason["tie"] == 100
        assert {u: choices.count(u) > 10 for u in {w.url for w in ws}} == {w.url: True for w in ws}
        # the same prompt again goes to the same worker; only the first HASH_TOKENS tokens are hashed
        assert (await one.pick_async(ws, prompts[3] + [1] * 200)).url == choices[3]


async def test_kvstore_down_falls_back_to_least_loaded_within_the_timeout(caplog):
    ws = [W("a:1", in_flight=3), W("b:2", in_flight=0), W("c:3", in_flight=0)]
    async with policy_of(f"127.0.0.1:{free_port()}", timeout_s=0.05) as policy:  # nothing listens there
        with caplog.at_level(logging.WARNING, logger=kv_index.__name__):
            t0 = time.monotonic()
            chosen = await policy.pick_async(ws, PROMPT)
            elapsed = time.monotonic() - t0
        assert chosen.url == rendezvous(ws[1:], prompt_key(PROMPT)).url  # least loaded, ties by rendezvous
        assert elapsed < 1.0
        assert policy.fallbacks == 1 and policy.decisions.by_reason["fallback"] == 1
        assert "MatchPrefix failed" in caplog.text and "UNAVAILABLE" in caplog.text


async def test_a_hung_kvstore_costs_the_timeout_then_is_skipped_for_a_while(kvstore, caplog):
    fake, url = kvstore
    fake.delay_s = 10.0
    now = [100.0]
    ws = [W("a:1", in_flight=1), W("b:2")]
    async with policy_of(url, timeout_s=0.05, clock=lambda: now[0]) as policy:
        with caplog.at_level(logging.WARNING, logger=kv_index.__name__):
            t0 = time.monotonic()
            assert (await policy.pick_async(ws, PROMPT)).url == "b:2"
            assert time.monotonic() - t0 < 2.0  # bounded by the timeout, not the kvstore's 10 s
            asked = len(fake.requests)
            for _ in range(5):  # within the backoff: the index is not asked, nothing waits
                assert (await policy.pick_async(ws, PROMPT)).url == "b:2"
            assert len(fake.requests) == asked
        assert "DEADLINE_EXCEEDED" in caplog.text and caplog.text.count("MatchPrefix failed") == 1
        assert policy.decisions.by_reason["fallback"] == 6
        fake.delay_s, fake.matches = 0.0, [wm("a:1", device=288)]
        now[0] += kv_index.INDEX_BACKOFF_S + 0.01
        assert (await policy.pick_async(ws, PROMPT)).url == "a:1"  # the index is back
        assert policy.decisions.by_reason["index"] == 1


# ---- wiring: load polls through the registry -------------------------------------------------------------------
async def test_loads_are_polled_through_the_registry(kvstore):
    fake, url = kvstore
    recording = RecordingWorker(loads=loads(prefill=1234.0, host=5678.0, queued=42))
    with serve_worker(recording) as wurl:
        registry = WorkerRegistry(connect_timeout_s=5.0, probe_interval_s=60.0)
        async with policy_of(url, registry=registry) as policy:
            worker = await registry.add(wurl)
            registry.start()
            policy.routed[wurl] = 500
            deadline = time.monotonic() + 10
            while wurl not in policy.speeds and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await registry.close()
            assert policy.speeds[wurl] == WorkerSpeeds(1234.0, 5678.0, 0.0, 42)
            assert policy.routed[wurl] == 0 and recording.load_polls >= 1
            policy.forget(worker.url)
            assert wurl not in policy.speeds and wurl not in policy.routed


# ---- a real router process with --policy kv_index --------------------------------------------------------------
@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv_index")


def test_kv_index_needs_a_kvstore_url():
    proc = subprocess.run([sys.executable, "-m", "radixmesh.services.router", "--tokenizer-url", "127.0.0.1:1",
                           "--policy", "kv_index"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--policy kv_index needs --kvstore-url" in proc.stderr


def test_router_routes_by_the_index_and_falls_back_without_it(log_dir):
    fake = FakeKvStore()
    a, b = RecordingWorker(), RecordingWorker()
    with run_tokenizer(log_dir) as tok, serve_worker(a) as aurl, serve_worker(b) as burl, \
            grpc_server(lambda s: kvstore_pb2_grpc.add_KvStoreServiceServicer_to_server(SyncKvStore(fake), s)) as kv:
        fake.matches = [wm(burl, device=192)]
        flags = (*TENANT_FLAGS, "--policy", "kv_index", "--kvstore-url", kv, "--kvstore-timeout-s", "1")
        with run_router(tok, [aurl, burl], log_dir, *flags) as r:
            for i in range(4):
                status, body = http("POST", r.url + "/generate", {"input_ids": list(range(192)) + [i] * 8},
                                    bearer(ALPHA_KEY))
                assert status == 200, body
            assert len(b.take()) == 4 and a.take() == []
            assert {q.tenant for q in fake.requests} == {"alpha"}
            status, raw = http("GET", r.url + "/get_server_info", headers=bearer(ALPHA_KEY))
            decisions = json.loads(raw)["routing_decisions"]
            assert decisions["by_reason"]["index"] == 4 and decisions["by_worker"][burl]["index"] == 4
            deadline = time.monotonic() + 10
            while not (a.load_polls and b.load_polls) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert a.load_polls and b.load_polls  # the policy polls GetLoads in the background
        down = f"127.0.0.1:{free_port()}"
        flags = ("--policy", "kv_index", "--kvstore-url", down)
        with run_router(tok, [aurl, burl], log_dir, *flags) as r:
            for i in range(6):
                assert http("POST", r.url + "/generate", {"input_ids": [9, i]})[0] == 200
            assert len(a.take()) + len(b.take()) == 6
            status, raw = http("GET", r.url + "/get_server_info")
            assert json.loads(raw)["routing_decisions"]["by_reason"]["fallback"] == 6
