"""Prefill/decode disaggregation under tensor parallelism, with the services' transfer path (KvTransfer over the
engine's mirrors, the fake backend): each prefill rank's KV shard lands in the matching decode rank's pool, so the
handed-over request decodes token-exact with the single-process engine (logprobs within 1e-5), the transfer's
checksum covers every rank's shard, and the pages come back free. One process holds one tensor-parallel group (the
default process group), so here one TP=2 engine plays both roles, moving pages from its prefill-role request to its
decode-role request; tests/e2e/test_tp_mesh.py runs the pair as separate workers. Also: an idle tensor-parallel
engine outlives --dist-timeout (the leader's heartbeat), and so does its staging channel. Both tests share one TP=2
engine."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from radixmesh.engine.disaggregation.handoff import DecodeRole, PrefillRole
from radixmesh.services.common.kv_transfer import KvTransfer
from tests.api.test_tensor_parallel import OPTS, _assert_same
from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine

pytestmark = pytest.mark.timeout(300)
_rids = itertools.count()
LP = {"return_logprob": True, "top_logprobs_num": 3}


@pytest.fixture(scope="module")
def tp2():
    """One TP=2 engine and its transfer path (an engine makes its mirrors once) for both tests: its follower process,
    which imports torch and loads the model, is most of a test's CPU. At the idle test's short --dist-timeout, so the
    handoff's staging commands also run under it."""
    with running_engine(model_path("tiny-llama"), tp_size=2, dist_timeout=3, **OPTS) as llm:
        transfer = KvTransfer(llm, "fake", "127.0.0.1")
        try:
            yield llm, transfer
        finally:
            transfer.close()


async def _handoff(p, d, send: KvTransfer, recv: KvTransfer, ids: list[int], params: dict,
                   moved: list | None = None) -> dict:
    """One request through the pair, as services/prefill/bootstrap.py and services/worker/receive.py move it;
    (source pages, destination pages) appended to `moved`."""
    loop = asyncio.get_running_loop()
    ready, allocated = loop.create_future(), loop.create_future()
    rid = f"tp-pd-{next(_rids)}"
    prid = rid + "-prefill" if p is d else rid
    prole = PrefillRole(lambda pages, first: loop.call_soon_threadsafe(ready.set_result, (pages, first)))
    drole = DecodeRole(lambda pages, cached: loop.call_soon_threadsafe(allocated.set_result, (pages, cached)))
    decoding = asyncio.create_task(d.async_generate(input_ids=ids, sampling_params=params, rid=rid, handoff=drole,
                                                    **LP))
    prefilling = asyncio.create_task(p.async_generate(input_ids=ids, sampling_params=params, rid=prid,
                                                      handoff=prole, **LP))
    (src, first), (dst, cached) = await ready, await allocated
    src = src[cached // p.args.page_size:]
    if moved is not None:
        moved.append((list(src), list(dst)))
    try:
        landing = recv.hold(dst)
        sent = await send.write(recv.session_id, recv.layout, src, landing, verify=True)
        assert sent and recv.checksum(landing) == sent  # every rank's shard arrived intact
        recv.stage_in(landing, dst)
        recv.release(landing)
        assert d.deliver_kv(rid, first).result(timeout=30) is True
    finally:
        p.release_kv(prid).result(timeout=30)
    await prefilling
    return await decoding


def test_a_tp2_handoff_decodes_as_one_process(tp2):
    path = model_path("tiny-llama")
    prompts = parity_prompts(path)[:4]
    greedy = {"max_new_tokens": 10, "temperature": 0}
    with running_engine(path, **OPTS) as one:
        want = one.generate(input_ids=prompts, sampling_params=greedy, **LP)
    llm, transfer = tp2
    assert llm.flush_cache() is True  # nothing cached from the other test: every page moves, and all come back
    assert transfer.tp_size == 2
    assert len(transfer.layout.bases) == 2 * len(llm.runner.kv_pool.buffers())  # rank 0's, then rank 1's

    async def run():
        return [await _handoff(llm, llm, transfer, transfer, ids, greedy) for ids in prompts]
    got = asyncio.run(run())
    _assert_same(got, want)
    load = llm.get_load()
    assert load["prealloc_rooms"] == 0 and load["available_kv_tokens"] == load["max_total_num_tokens"]


def test_an_idle_tp_engine_outlives_the_dist_timeout(tp2):
    """Followers wait for the next step (and the next staging command) in collectives bound by --dist-timeout (3 s
    here); an idle spell twice as long (a missed heartbeat fails the group at 3 s) leaves the group and the transfer
    path working."""
    llm, transfer = tp2
    assert llm.args.dist_timeout == 3
    params = {"max_new_tokens": 6, "temperature": 0}
    first = llm.generate("hello there", params)["output_ids"]
    mirror = transfer.mirror
    time.sleep(6)
    assert llm.generate("hello there", params)["output_ids"] == first
    mirror.stage_out([1, 2], [5, 6])  # the staging channel's followers are still there
