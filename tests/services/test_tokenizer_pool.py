"""The router's tokenizer pool over two real tokenizer service processes, one of them stopped (SIGSTOP: it holds
its connections and answers nothing): every request still gets its tokens; those that were waiting on the stopped
replica fail over after one timeout, together, not each after its own; later requests do not go near it; once it
runs again (SIGCONT) its probe finds it and it takes calls again."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from radixmesh.v1 import tokenizer_pb2 as pb
from radixmesh.services.router.tokenizer_client import TokenizerClient, TokenizerUnavailable
from radixmesh.services.router.tokenizer_pool import TokenizerPool
from tests.conftest import model_path
from tests.services.metrics_utils import spawn_grpc, stop, wait_grpc

MODEL = model_path("tiny-llama")
TIMEOUT_S = 2.0
pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def replicas(tmp_path):
    started = [spawn_grpc("radixmesh.services.tokenizer", "--model-path", MODEL, log=tmp_path / f"tokenizer{i}.log")
               for i in range(2)]
    for proc, url in started:
        wait_grpc(proc, url)
    yield started
    for proc, _ in started:
        os.kill(proc.pid, signal.SIGCONT)
        stop(proc)


def test_a_stopped_replica_costs_one_timeout_then_nothing(replicas):
    (stopped, _), _ = replicas

    async def wave(pool: TokenizerPool, n: int, tag: str) -> tuple[list[list[int]], float]:
        start = time.monotonic()
        got = []
        for i in range(n):  # a few per loop turn: several batches on each replica
            got.append(asyncio.ensure_future(pool.tokenize(pb.TokenizeRequest(text=f"{tag} prompt {i}"))))
            if i % 4 == 3:
                await asyncio.sleep(0)
        return [list(r.input_ids) for r in await asyncio.gather(*got)], time.monotonic() - start

    async def alone_on_the_stopped_replica(client: TokenizerClient) -> None:
        """Without another replica the callers get TokenizerUnavailable (the router's 503); those that came half
        a timeout after the first get it when the first do: the hung stream was closed."""
        start = time.monotonic()
        first = asyncio.ensure_future(client.tokenize(pb.TokenizeRequest(text="early")))
        await asyncio.sleep(TIMEOUT_S / 2)
        later = asyncio.ensure_future(client.tokenize(pb.TokenizeRequest(text="later")))
        for fut in (first, later):
            with pytest.raises(TokenizerUnavailable):
                await fut
        assert time.monotonic() - start < TIMEOUT_S + TIMEOUT_S / 4
        await client.close()

    async def run():
        pool = TokenizerPool([url for _, url in replicas], TIMEOUT_S)
        await pool.connect(30)
        want, _ = await wave(pool, 40, "first")
        alone = TokenizerClient(replicas[0][1], TIMEOUT_S)
        await alone.connect(30)
        await alone.tokenize(pb.TokenizeRequest(text="the stream is open"))
        os.kill(stopped.pid, signal.SIGSTOP)
        got, took = await wave(pool, 40, "first")
        assert got == want  # nothing lost: the stopped replica's share was tokenized by the other
        assert took < 2 * TIMEOUT_S + 1, took  # one timeout for all that waited on it, not one after another
        assert pool._down == [True, False]
        again, took = await wave(pool, 40, "first")
        assert again == want and took < 1.0, took  # no call goes to the stopped replica any more
        await alone_on_the_stopped_replica(alone)
        os.kill(stopped.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while pool._down[0]:
            assert time.monotonic() < deadline, "the replica was not taken back after SIGCONT"
            await asyncio.sleep(0.1)
        before = pool.clients[0].batcher.requests
        assert (await wave(pool, 40, "first"))[0] == want
        assert pool.clients[0].batcher.requests > before  # back in rotation
        await pool.close()
    asyncio.run(run())
