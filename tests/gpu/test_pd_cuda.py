"""Prefill/decode KV transfer on CUDA through the shm backend, as two workers of one host run it: the prefill
engine's GPU copies a request's pages straight into the decode worker's shared mirror (gathered on the device when
they are scattered in the pool), the decode engine copies them from its mirror into its pool (scattered on the
device), both on the mirrors' own streams. Greedy outputs equal the engine's own, with the pools churned so that the
pages of later requests are scattered; every page and mirror page comes back free."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from radixmesh.engine.disaggregation.mirror import MAX_RUNS, KvMirror
from radixmesh.engine.disaggregation.transfer import page_runs
from radixmesh.services.common.kv_transfer import KvTransfer
from tests.api.test_tp_disaggregation import _handoff
from tests.conftest import model_path
from tests.engine_utils import running_engine

pytestmark = pytest.mark.gpu
GREEDY = {"max_new_tokens": 8, "temperature": 0}


def test_staging_on_cuda_gathers_and_scatters_scattered_pages_exactly():
    from tests.unit.test_transfer_backends import _pool

    host = _pool(seed=7)
    pool = _pool(seed=None)
    for src, dst in zip(host.buffers(), pool.buffers()):
        dst.copy_(src)
    pool.k = [t.cuda() for t in pool.k]
    pool.v = [t.cuda() for t in pool.v]
    mirror = KvMirror.for_pool(pool)  # pinned twins, the staging stream
    assert mirror.staged and mirror.stream is not None
    pages = [11, 0, 9, 2, 7, 4, 5, 1, 10, 3]
    assert len(page_runs(pages, range(len(pages)))) > MAX_RUNS
    slots = mirror.hold(pages)
    mirror.stage_out(pages, slots)
    size = pool.page_size
    for src, twin in zip(host.buffers(), mirror.buffers):
        for m, p in zip(slots, pages):
            assert torch.equal(twin[m * size:(m + 1) * size], src[p * size:(p + 1) * size])
    back = _pool(seed=None)
    back.k = [t.cuda() for t in back.k]
    back.v = [t.cuda() for t in back.v]
    KvMirror(back, mirror.buffers).stage_in(slots, pages[::-1])  # into other pages, scattered too
    for src, got in zip(host.buffers(), back.buffers()):
        for p, q in zip(pages, pages[::-1]):
            assert torch.equal(got[q * size:(q + 1) * size].cpu(), src[p * size:(p + 1) * size])
    mirror.release(slots)


def test_shm_handoff_on_cuda_is_token_exact_with_scattered_pages():
    path = model_path("tiny-llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 900) for _ in range(rng.randrange(20, 90))] for _ in range(12)]
    common = dict(device="cuda", dtype="float32", max_total_tokens=256, disable_radix_cache=True)
    with running_engine(path, **common) as p, running_engine(path, **common) as d:
        want = [o["output_ids"] for o in p.generate(input_ids=prompts, sampling_params=GREEDY)]
        send = KvTransfer(p, "shm", "127.0.0.1", receives=False)
        recv = KvTransfer(d, "shm", "127.0.0.1", receives=True)
        assert send.direct and not send.mirror.staged and recv.mirror.staged  # GPU -> shared mirror -> GPU
        moved: list = []
        try:
            async def run():
                got = []
                for i, ids in enumerate(prompts):
                    if i % 3 == 1:  # requests of other lengths in between: the free lists are shuffled
                        p.generate(input_ids=[ids[:7], ids[3:40]], sampling_params=GREEDY)
                        d.generate(input_ids=[ids[5:31], ids[:12]], sampling_params=GREEDY)
                    got.append((await _handoff(p, d, send, recv, ids, GREEDY, moved))["output_ids"])
                return got
            got = asyncio.run(run())
        finally:
            send.close()
            recv.close()
        assert got == want
        assert any(len(page_runs(src, range(len(src)))) > MAX_RUNS for src, _ in moved)  # the gather path ran
        assert any(len(page_runs(dst, range(len(dst)))) > MAX_RUNS for _, dst in moved)  # the scatter path ran
        assert recv.mirror.slots.num_free == recv.mirror.local[0].shape[0] // d.args.page_size
        for e in (p, d):
            load = e.get_load()
            assert load["prealloc_rooms"] == 0 and load["available_kv_tokens"] == load["max_total_num_tokens"]
