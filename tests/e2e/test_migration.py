"""Request migration on the launched mesh (2 colocated workers, an API key, loopback): under 60 concurrent streamed
chat completions, a worker SIGKILLed, or stopped (SIGSTOP: hung), mid-stream costs no client anything: every
stream completes without an error event, and every output equals the unfailed run's, token for token (greedy, and
every fifth stream two seeded samples: odd and even ones, so that round robin, which alternates, gives both workers
some): the router moved each broken stream to the other worker, which continued after the tokens already streamed
(services/router/core.py, engine.results.resume_req), an n = 2 stream sample by sample. (A PD mesh's prefill and
decode workers killed and stopped under streaming load: tests/e2e/test_chaos.py.)
With --max-migrations 0 the broken streams end with an error instead, naming why."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import openai
import pytest

from tests.conftest import model_path
from tests.e2e.conftest import MODEL
from tests.e2e.mesh import cmdline, migrations, running_mesh, streaming_on

NAME = model_path(MODEL)
KEY = "migration-test-key"
# Every worker runs dozens at once when the fault comes (round robin: 30 each), past the router's circuit breaker
# threshold (10 failures) were each broken stream counted. 200 only doubled the run (110 s of 700); 100 cost this file
# a sixth more CPU than 60 for the same checks (the hung worker's wait for the health probes sets its wall time).
STREAMS = 60
TOKENS = 120
IDS: dict[int, str] = {}  # stream -> its completion id (the router's request id), for a failure's message
pytestmark = pytest.mark.timeout(600)


def _prompt(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Tell story number {i} about the lighthouse keeper and the storm."}]


async def _chat(client: openai.AsyncOpenAI, i: int, started: list[int]) -> tuple[str, str | None, str | None]:
    """(text, finish_reason, error) of one streamed completion. Every fifth asks for two seeded samples (n = 2,
    temperature 0.8): its text is both, "|"-separated."""
    texts, reason = ["", ""], None
    sampled = {"n": 2, "temperature": 0.8, "seed": i} if i % 5 == 0 else {"temperature": 0}
    try:
        stream = await client.chat.completions.create(model=NAME, messages=_prompt(i), max_tokens=TOKENS,
                                                      stream=True, extra_body={"ignore_eos": True}, **sampled)
        async for chunk in stream:
            IDS[i] = chunk.id
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                reason = choice.finish_reason or reason
            started.append(i)  # a chunk of stream i
        return "|".join(texts), reason, None
    except openai.APIError as e:
        return "|".join(texts), reason, f"{type(e).__name__}: {e}"


async def _run(mesh, fault=None, ready=None) -> list[tuple[str, str | None, str | None]]:
    """All streams at once; `fault()` runs once `ready(started)` holds (`started`: the stream of each chunk so far),
    by default once there were as many chunks as streams. A thread of its own checks and strikes, every 20 ms: the
    check never waits for this event loop, which 200 streams keep busy (on a loaded 2-core machine a check scheduled
    from the loop came seconds apart, and a worker's whole answer fitted between two of them: a CI run)."""
    chunks: list[int] = []
    async with openai.AsyncOpenAI(base_url=mesh.url + "/v1", api_key=KEY, max_retries=0, timeout=300) as client:
        tasks = [asyncio.create_task(_chat(client, i, chunks)) for i in range(STREAMS)]
        if fault is None:
            return await asyncio.gather(*tasks)
        stop, running = threading.Event(), []

        def watch() -> None:
            while not stop.is_set():
                if ready(list(chunks)) if ready is not None else len(chunks) >= STREAMS:
                    running.append(sum(not t.done() for t in tasks))  # the streams open at the fault
                    fault()
                    return
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, name="fault", daemon=True)
        watcher.start()
        try:
            results = await asyncio.gather(*tasks)
        finally:
            stop.set()
            await asyncio.to_thread(watcher.join)
        assert running and running[0] > STREAMS // 4, ("the streams ended before the fault", running)
        return results


def _streaming_on(mesh, pid: int, samples: bool = False):
    """_run's `ready`: once the worker of `pid` has calls streaming; with `samples`, also once every n = 2 stream
    has streamed (so some of them are mid-stream on that worker: its first streams may be a prefill batch of n = 1
    ones only, a CI run; and half of them streaming were all the other worker's, arriving in round robin's
    alternation, another CI run)."""
    argv = cmdline(pid).split()
    on = streaming_on(mesh, "127.0.0.1:" + argv[argv.index("--port") + 1])
    pairs = {i for i in range(STREAMS) if i % 5 == 0}
    return lambda started: (not samples or pairs.issubset(started)) and on()


def _workers(mesh) -> list[int]:
    return [pid for pid in mesh.services().values() if "radixmesh.services.worker" in cmdline(pid)]


def _check(got, want) -> None:
    errors = [err for _, _, err in got if err is not None]
    assert not errors, f"{len(errors)} streams failed, e.g. {errors[:3]}"
    bad = [i for i in range(STREAMS) if got[i][0] != want[i][0]]
    assert not bad, (len(bad), got[bad[0]], want[bad[0]], IDS.get(bad[0]))
    assert all(reason == "length" for _, reason, _ in got)


def test_a_worker_killed_or_hung_mid_stream_costs_no_client_anything(tmp_path):
    """One mesh, two faults: a worker SIGKILLed (the launcher restarts it), then, once both are healthy again, the
    other one SIGSTOPped (hung: the router's health probes give up on it and move its streams). The second fault's
    streams go to the restarted worker: its circuit breaker counted the crash of its dozens of open streams as one
    failure, so it takes them at once."""
    from tests.e2e.test_supervision import _healthy_workers, _wait

    # round robin: both workers carry streams when one fails
    with running_mesh(NAME, tmp_path, "--enable-metrics", "--policy", "round_robin", num_workers=2,
                      api_key=KEY) as mesh:
        want = asyncio.run(_run(mesh))
        assert all(err is None and reason == "length" for _, reason, err in want), want[:3]
        first, second = _workers(mesh)
        _check(asyncio.run(_run(mesh, lambda: os.kill(first, signal.SIGKILL), _streaming_on(mesh, first, True))),
               want)
        assert migrations(mesh) > 0, "no stream was in flight on the killed worker"
        assert "migrating samples" in mesh.log_path.read_text()  # n = 2 streams went on sample by sample
        _wait(lambda: _healthy_workers(mesh, {"Authorization": f"Bearer {KEY}"}) == 2, 90, "no restart")
        before = migrations(mesh)
        try:
            _check(asyncio.run(_run(mesh, lambda: os.kill(second, signal.SIGSTOP), _streaming_on(mesh, second))),
                   want)
        finally:
            os.kill(second, signal.SIGCONT)
        assert migrations(mesh) > before, "no stream was in flight on the hung worker"


def test_without_migration_broken_streams_end_with_a_clear_error(tmp_path):
    with running_mesh(NAME, tmp_path, "--max-migrations", "0", "--enable-metrics", "--policy", "round_robin",
                      num_workers=2, api_key=KEY) as mesh:
        victim = _workers(mesh)[0]
        got = asyncio.run(_run(mesh, lambda: os.kill(victim, signal.SIGKILL), _streaming_on(mesh, victim)))
        errors = [err for _, _, err in got if err is not None]
        assert errors and all("--max-migrations 0" in e for e in errors), errors[:3]
