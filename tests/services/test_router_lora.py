"""The router's side of LoRA serving against real worker processes (tiny-llama on loopback): what each worker has
loaded (fetched when it is added, polled, and seen anew once a worker restarts with other --lora-paths), routing
only to workers that have a request's adapter (a 400 naming the loaded ones when none has it, a 503 when only an
unhealthy one has), and the all-or-none fan-out of /load_lora_adapter and /unload_lora_adapter: a worker that
refuses (LoRA off, a rank over its --max-lora-rank) or cannot be reached leaves the adapter loaded nowhere, with
each failure named; a load whose caller gave up is undone on the worker."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from radixmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from radixmesh.services.router.core import Router
from radixmesh.services.router.errors import RouterError
from radixmesh.services.router.lora_fanout import LoraFanout
from radixmesh.services.router.policy_registry import make_policy
from radixmesh.services.router.settings import RouterSettings
from radixmesh.services.router.tokenizer_client import TokenizerClient
from radixmesh.services.router.workers import WorkerRegistry
from tests.conftest import model_path
from tests.engine_utils import parity_prompts
from tests.parity.test_lora import write_adapter
from tests.services.metrics_utils import spawn_grpc, stop, wait_grpc

MODEL = model_path("tiny-llama")
WORKER = "radixmesh.services.worker"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    return {"small": write_adapter(MODEL, root / "small", 4, 8, ["q_proj", "down_proj"], False, seed=1),
            "big": write_adapter(MODEL, root / "big", 8, 16, ["v_proj"], False, seed=2)}


@pytest.fixture(scope="module")
def workers():
    """Worker a serves LoRA adapters up to rank 8; worker b (the tests restart it) starts without LoRA."""
    a = spawn_grpc(WORKER, "--model-path", MODEL, "--enable-lora", "--max-lora-rank", "8")
    b = spawn_grpc(WORKER, "--model-path", MODEL)
    procs = {"a": a, "b": b}
    for proc, url in procs.values():
        wait_grpc(proc, url)
    yield procs
    for proc, _ in procs.values():
        stop(proc)


def loaded_on(url: str) -> dict[str, str]:
    """What the worker itself says it has loaded."""
    with grpc.insecure_channel(url) as ch:
        resp = worker_pb2_grpc.WorkerServiceStub(ch).ListLoraAdapters(worker_pb2.ListLoraAdaptersRequest(), timeout=10)
    return {a.lora_name: a.lora_path for a in resp.adapters}


@contextlib.asynccontextmanager
async def router_over(*urls: str):
    settings = RouterSettings(tokenizer_url="127.0.0.1:1", policy="cache_aware")
    registry = WorkerRegistry(connect_timeout_s=10.0, probe_interval_s=60.0, probing=False)
    tokenizer = TokenizerClient(settings.tokenizer_url, 1.0)
    router = Router(settings, registry, make_policy(settings.policy, settings, registry), tokenizer)
    try:
        for url in urls:
            await registry.add(url)
        yield router
    finally:
        await registry.close()
        await tokenizer.close()


async def fails(call, status: int) -> str:
    with pytest.raises(RouterError) as err:
        await call
    assert err.value.status == status, err.value.message
    return err.value.message


async def test_a_worker_that_refuses_leaves_the_adapter_loaded_nowhere(workers, adapters):
    a, b = workers["a"][1], workers["b"][1]
    async with router_over(a, b) as router:
        fanout = LoraFanout(router.registry, 60.0)
        message = await fails(fanout.load("small", adapters["small"]), 400)
        assert f"worker {b} (colocated)" in message and "--enable-lora" in message and f"undone on {a}" in message
        assert loaded_on(a) == {} and router.lora.adapters() == {}
        worker_a, worker_b = router.registry.workers[a], router.registry.workers[b]
        assert worker_a.lora.enabled and not worker_b.lora.enabled
        message = await fails(router.choose(worker_pb2.GenerateRequest(lora_path="small"), set()), 400)
        assert message == "unknown LoRA adapter 'small' (loaded: none)"


async def test_routing_follows_what_workers_report_after_a_restart(workers, adapters):
    a, b = workers["a"][1], workers["b"][1]
    async with router_over(a, b) as router:
        stop(workers["b"][0])
        port = b.rpartition(":")[2]
        workers["b"] = spawn_grpc(WORKER, "--model-path", MODEL, "--enable-lora", "--max-lora-rank", "4",
                                  "--lora-paths", f"small={adapters['small']}", port=int(port))
        wait_grpc(*workers["b"])
        await router.lora.refresh_all()  # what the registry's poll does every --health-check-interval-s
        assert router.lora.adapters() == {"small": adapters["small"]}
        worker_a, worker_b = router.registry.workers[a], router.registry.workers[b]
        for _ in range(4):  # whatever the policy prefers, only b has the adapter
            assert await router.choose(worker_pb2.GenerateRequest(lora_path="small"), set()) is worker_b
        message = await fails(router.choose(worker_pb2.GenerateRequest(lora_path="nope"), set()), 400)
        assert message == "unknown LoRA adapter 'nope' (loaded: small)"
        router.registry.mark_failed(worker_b, "test")
        message = await fails(router.choose(worker_pb2.GenerateRequest(lora_path="small"), set()), 503)
        assert f"loaded on {b}" in message
        assert await router.choose(worker_pb2.GenerateRequest(), set()) is worker_a  # the base model: any worker
        router.registry.mark_healthy(worker_b, "test")
        await _load_refused_by_rank_then_unload(router, a, b, adapters)


async def _load_refused_by_rank_then_unload(router, a: str, b: str, adapters: dict[str, str]) -> None:
    fanout = LoraFanout(router.registry, 60.0)
    message = await fails(fanout.load("big", adapters["big"]), 400)
    assert f"worker {b} (colocated)" in message and "max" in message and f"undone on {a}" in message
    assert loaded_on(a) == {} and loaded_on(b) == {"small": adapters["small"]}
    assert "big" not in router.lora.adapters()
    await fanout.load("again", adapters["small"])
    assert loaded_on(a) == {"again": adapters["small"]}
    assert loaded_on(b) == {"again": adapters["small"], "small": adapters["small"]}
    assert router.lora.adapters() == {"again": adapters["small"], "small": adapters["small"]}
    await fanout.unload("small")  # a never had it: it is unloaded where it is
    await fanout.unload("again")
    assert loaded_on(a) == loaded_on(b) == {} and router.lora.adapters() == {}
    assert "no LoRA adapter named 'small'" in await fails(fanout.unload("small"), 400)


async def test_a_load_whose_caller_gave_up_is_undone(workers, adapters):
    """A load whose caller's 1-ms deadline passed is unloaded again when it completes. A load is applied between
    two steps of the scheduler, so it is asked while a long generation runs, and waits for a step to end; on an idle
    fast machine a load has come back within 1 ms five times in a row (thirty-fifth session), and under a loaded
    suite once (seventeenth): an attempt that came back in time is unloaded and another made."""
    a = workers["a"][1]
    async with grpc.aio.insecure_channel(a) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        busy = stub.Generate(worker_pb2.GenerateRequest(
            request_id="busy", input_ids=parity_prompts(MODEL)[0], sampling_params=common_pb2.SamplingParams(
                temperature=0, max_new_tokens=600, ignore_eos=True)), timeout=120)
        await busy.read()  # its first token is out: the scheduler is stepping
        try:
            for attempt in range(10):
                name = f"late{attempt}"
                try:
                    await stub.LoadLoraAdapter(worker_pb2.LoadLoraAdapterRequest(
                        lora_name=name, lora_path=adapters["small"]), timeout=0.001)
                except grpc.aio.AioRpcError as err:
                    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                    break
                await stub.UnloadLoraAdapter(worker_pb2.UnloadLoraAdapterRequest(lora_name=name), timeout=30)
            else:
                pytest.fail("10 loads with a 1-ms deadline all came back in time")
        finally:
            busy.cancel()
    await asyncio.sleep(2.0)  # the load has completed by now (or soon, on a busy machine) and is then undone
    deadline = time.monotonic() + 30
    while name in loaded_on(a) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert name not in loaded_on(a) and not [n for n in loaded_on(a) if n.startswith("late")]


async def test_an_unreachable_worker_fails_the_load_and_the_others_are_undone(workers, adapters):
    a, b = workers["a"][1], workers["b"][1]
    async with router_over(a, b) as router:
        stop(workers["b"][0])
        message = await fails(LoraFanout(router.registry, 10.0).load("small2", adapters["small"]), 503)
        assert f"worker {b} (colocated)" in message and f"undone on {a}" in message
        assert loaded_on(a) == {} and "small2" not in router.lora.adapters()


async def output(url: str, lora: str, prompt: list[int]) -> list[int]:
    """The worker's own greedy output ids for `prompt` with adapter `lora`."""
    async with grpc.aio.insecure_channel(url) as ch:
        request = worker_pb2.GenerateRequest(request_id=f"r-{time.monotonic_ns()}", input_ids=prompt, lora_path=lora,
                                             sampling_params=common_pb2.SamplingParams(temperature=0, max_new_tokens=8))
        msgs = [m async for m in worker_pb2_grpc.WorkerServiceStub(ch).Generate(request, timeout=60)]
    return list(msgs[-1].complete.output_ids)


async def until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)


def restart(procs: dict, key: str, flags: tuple[str, ...]) -> None:
    """SIGKILL the worker and start another on its port (as the launcher's supervisor does)."""
    proc, url = procs[key]
    proc.kill()
    proc.wait()
    procs[key] = spawn_grpc(WORKER, *flags, port=int(url.rpartition(":")[2]))


async def test_a_restarted_worker_gets_the_run_time_changes_back_before_it_is_routed_an_adapter(adapters):
    """Two workers started with adapter `flag`; at run time `run` is loaded and `flag` unloaded through the router.
    Worker d is killed and started again on its port with its flags only: the router (no health probes, no polls
    here: only its watch of d's connection) sees the connection go, routes d no adapter until it has loaded `run`
    and unloaded `flag` there again, then routes `run` to it, which gives the outputs it gave before. Then an unload
    of `run` that raced d's next restart (queued before d's resync): `run` does not come back on d."""
    flags = ("--model-path", MODEL, "--enable-lora", "--max-lora-rank", "8", "--lora-paths",
             f"flag={adapters['small']}")
    procs = {"c": spawn_grpc(WORKER, *flags), "d": spawn_grpc(WORKER, *flags)}
    try:
        for proc, url in procs.values():
            wait_grpc(proc, url)
        c, d = procs["c"][1], procs["d"][1]
        prompt = parity_prompts(MODEL)[0]
        async with router_over(c, d) as router:
            worker_c, worker_d = router.registry.workers[c], router.registry.workers[d]
            await router.lora.sync.settle([worker_c, worker_d])
            fanout = LoraFanout(router.registry, 60.0, router.lora.intent)
            await fanout.load("run", adapters["big"])
            await fanout.unload("flag")
            want = await output(d, "run", prompt)
            assert want != await output(d, "", prompt)  # the adapter changes what the model says
            restart(procs, "d", flags)
            await until(lambda: not worker_d.lora.synced, 10, "the lost connection was not noticed")
            assert await router.choose(worker_pb2.GenerateRequest(lora_path="run"), set()) is worker_c
            wait_grpc(*procs["d"])
            await until(lambda: worker_d.lora.synced, 60, "d was not resynced once it was back")
            assert loaded_on(d) == {"run": adapters["big"]}  # `run` loaded again, `flag` from its flags unloaded
            assert await router.choose(worker_pb2.GenerateRequest(lora_path="run"), {c}) is worker_d
            assert await output(d, "run", prompt) == want
            assert "unknown LoRA adapter 'flag'" in await fails(
                router.choose(worker_pb2.GenerateRequest(lora_path="flag"), set()), 400)
            await _an_unload_racing_a_restart_stays_done(router, fanout, procs, flags)
    finally:
        for proc, _ in procs.values():
            stop(proc)


async def _an_unload_racing_a_restart_stays_done(router, fanout: LoraFanout, procs: dict, flags) -> None:
    """d restarts while an unload of `run` waits for the lock; d's resync (which found `run` missing) comes after the
    unload, reads the adapter as unloaded and leaves it so."""
    c, d = procs["c"][1], procs["d"][1]
    worker_d = router.registry.workers[d]
    async with router.lora.intent.lock:
        unload = asyncio.ensure_future(fanout.unload("run"))
        await asyncio.sleep(0.1)  # the unload waits for the lock now
        restart(procs, "d", flags)
        await until(lambda: not worker_d.lora.synced, 10, "the lost connection was not noticed")
        wait_grpc(*procs["d"])
        # d's resync polled it (no `run`: it came back with its flags only) and waits for the lock behind the unload
        await until(lambda: "run" not in worker_d.lora.adapters, 60, "d's resync did not poll it")
    await unload
    await until(lambda: worker_d.lora.synced, 60, "d was not resynced")
    assert loaded_on(c) == loaded_on(d) == {} and router.lora.adapters() == {}
    assert router.lora.intent.unloaded == {"flag", "run"} and router.lora.intent.loaded == {}
