"""The hierarchical cache on CUDA: host-pool copies run on their own stream (loads make the compute stream wait,
backups are polled), with graphs and overlap on. Greedy outputs from the device, the host pool and the L3 file
store equal those with the hierarchy off, in float32, and nothing leaks on either tier."""

from __future__ import annotations

import random

import pytest
import torch

from radixmesh.engine.cache.host_pool import KVMover
from tests.conftest import model_path
from tests.engine_utils import converse, running_engine

pytestmark = pytest.mark.gpu
SP = {"max_new_tokens": 8, "temperature": 0}


@pytest.mark.parametrize("backend", ["triton", "torch_native"])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_host_and_l3_tiers_on_cuda_are_token_exact(tmp_path, backend, policy):
    pytest.importorskip("triton" if backend == "triton" else "torch")
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 900) for _ in range(60)] for _ in range(8)]
    path = model_path("tiny-llama")
    common = dict(device="cuda", dtype="float32", page_size=16, attention_backend=backend)
    with running_engine(path, max_total_tokens=4096, **common) as llm:
        want = [o["output_ids"] for o in llm.generate(input_ids=prompts, sampling_params=SP)]
    # write_through: every page is in L3 as soon as it is on the host, so after a flush round 2 comes back from L3.
    # write_back: L3 is the host pool's victim store (a flush drops what never left the host), so the host pool is
    # made too small for the prompts: pages leave it for L3 in every round and come back from there.
    through = policy == "write_through"
    with running_engine(path, max_total_tokens=192, enable_hierarchical_cache=True, hicache_ratio=4 if through else 1,
                        hicache_write_policy=policy, hicache_storage_backend="file",
                        hicache_storage_url=str(tmp_path / "l3"), hicache_storage_prefetch_policy="wait_complete",
                        hicache_storage_backend_extra_config='{"skip_slow_fetches": false}',
                        **common) as llm:
        for round_ in range(3):
            outs = [llm.generate(input_ids=p, sampling_params=SP) for p in prompts]
            assert [o["output_ids"] for o in outs] == want, f"round {round_}"
            if round_:
                assert all(o["meta_info"]["cached_tokens"] == 48 for o in outs)
            if round_ == 1 and through:
                assert llm.flush_cache()
        load = llm.get_load()
        assert load["storage_written_pages"] > 0 and load["storage_hit_tokens"] > 0
        cache = llm.cache
        assert llm.flush_cache()
        assert cache.pages.num_free == cache.pages.num_pages
        host = cache.hierarchy.host.allocator
        assert host.num_free == host.num_pages


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_a_slow_host_load_is_waited_for(monkeypatch, io_backend):
    """Loads run on a stream of their own, issued as the forward that reads them starts, layer by layer, with no
    host synchronization: with every load held back ~10 ms on that stream (longer than a tiny model's whole
    forward), outputs served from the host pool still equal those with the hierarchy off."""
    real = KVMover.flush

    def slow(self):
        if self._queued:
            with torch.cuda.stream(self.load_stream):
                torch.cuda._sleep(20_000_000)  # noqa: SLF001 - the load stream is busy when the copies are issued
        return real(self)

    rng = random.Random(1)
    prompts = [[rng.randrange(5, 900) for _ in range(60)] for _ in range(8)]
    path = model_path("tiny-llama")
    common = dict(device="cuda", dtype="float32", page_size=16, attention_backend="triton")
    with running_engine(path, max_total_tokens=4096, **common) as llm:
        want = [o["output_ids"] for o in llm.generate(input_ids=prompts, sampling_params=SP)]
    monkeypatch.setattr(KVMover, "flush", slow)
    with running_engine(path, max_total_tokens=192, enable_hierarchical_cache=True, hicache_ratio=4,
                        hicache_io_backend=io_backend, **common) as llm:
        for round_ in range(2):
            outs = [llm.generate(input_ids=p, sampling_params=SP) for p in prompts]
            assert [o["output_ids"] for o in outs] == want, f"round {round_}"
        assert llm.cache.hierarchy.hit_tokens["host"] > 0, "nothing came back from the host pool"
        mover = llm.cache.hierarchy.mover
        if io_backend == "kernel":
            assert mover.direct and not mover.dma, "the pinned host pool's kernel copies (kernels.kv_pages) not used"
        else:
            assert mover.dma, "the loads did not go over the copy engine (engine.cache.dma)"


def test_the_default_io_backend_is_the_copy_engine_where_the_driver_batches_copies():
    from radixmesh.engine.cache import dma
    from radixmesh.engine.cache.host_pool import HostKVPool
    from radixmesh.engine.cache.kv_pool import KVPool

    kv = KVPool(64, 4, 3, 2, 8, torch.bfloat16, torch.device("cuda"))
    mover = KVMover(kv, HostKVPool(40, kv))
    assert mover.io_backend == ("direct" if dma.batch_available() else "kernel")
    assert mover.batched == dma.batch_available()


@pytest.mark.parametrize("shared", [False, True], ids=["k-and-v", "latent"])
@pytest.mark.parametrize("path", ["page-batches", "2d-calls"])
def test_direct_loads_equal_the_host_pages(monkeypatch, path, shared):
    """--hicache-io-backend direct into scattered device pages, on each of its paths: one batch per layer straight
    into place, a copy per page (cuMemcpyBatchAsync, CUDA 12.8+); or, for older drivers, a cudaMemcpy2DAsync per
    run of host pages into staging slots (groups, a ring of slots) scattered by index copies: every byte lands where
    the kernel path puts it, and the per-layer events cover each layer. A latent pool (DeepSeek: K and V one buffer)
    has one part a layer in its host pages."""
    from radixmesh.engine.cache import dma, host_pool
    from radixmesh.engine.cache.host_pool import HostKVPool
    from radixmesh.engine.cache.kv_pool import KVPool

    if path == "page-batches" and not dma.batch_available():
        pytest.skip("this driver has no cuMemcpyBatchAsync (CUDA 12.8+)")
    monkeypatch.setattr(host_pool, "STAGING_PAGES", 3)  # several groups per layer, the ring wrapping within a layer
    kv = KVPool(64, 4, 3, 2, 8, torch.bfloat16, torch.device("cuda"), shared_kv=shared)
    host = HostKVPool(40, kv)
    assert host.data.shape[1] == 3 * kv.parts
    host.data.copy_(torch.randn(host.data.shape).to(host.data.dtype))
    mover = KVMover(kv, host, "direct")
    assert mover.dma and mover.batched == dma.batch_available()
    mover.batched = path != "2d-calls"
    host_pages = [5, 6, 7, 9, 20, 21, 3, 30, 31, 32, 33]  # runs of 3, 1, 2, 1 and 4
    dev_pages = [40, 2, 17, 33, 8, 9, 60, 1, 25, 50, 12]
    pending = mover.to_device(host_pages, dev_pages)
    ready = mover.take_ready()
    assert len(ready) == 3
    if mover.batched:  # queued layer by layer as a forward reaches them (host_pool._LayerLoads)
        assert ready.issued == 0 and not pending.done()
    ready[-1].synchronize()
    assert pending.done()
    mover.to_device([], [])  # a load of nothing still gives every layer an event
    assert len(mover.take_ready()) == 3
    for layer in range(3):
        for hp, dp in zip(host_pages, dev_pages):
            for j, buf in enumerate(kv.layer_buffers(layer)):
                assert torch.equal(buf.view(-1, 4, 2, 8)[dp].cpu(), host.data[hp, kv.parts * layer + j])


@pytest.mark.parametrize("shared", [False, True], ids=["k-and-v", "latent"])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_backups_equal_the_device_pages(io_backend, shared):
    """Backups (device -> host) from scattered device pages into scattered host pages, by kernels.kv_pages or, with
    --hicache-io-backend direct, one batch of copy-engine copies (one per page's K or V): every layer's K and V
    lands in its host page (a latent pool's one buffer a layer, once), and host pages not written keep their
    bytes."""
    from radixmesh.engine.cache.host_pool import HostKVPool
    from radixmesh.engine.cache.kv_pool import KVPool

    kv = KVPool(64, 4, 3, 2, 8, torch.bfloat16, torch.device("cuda"), shared_kv=shared)
    for t in kv.buffers():
        t.copy_(torch.randn(t.shape))
    host = HostKVPool(40, kv)
    before = host.data.clone()
    mover = KVMover(kv, host, io_backend)
    dev_pages, host_pages = [40, 2, 17, 33, 8, 9, 60], [5, 6, 7, 9, 20, 21, 3]  # 8-9 -> 20-21: a stretch of two
    pending = mover.to_host(dev_pages, host_pages)
    mover.flush()
    pending.wait()
    assert pending.done() and pending.elapsed_s() >= 0
    for layer in range(3):
        for hp, dp in zip(host_pages, dev_pages):
            for j, buf in enumerate(kv.layer_buffers(layer)):
                assert torch.equal(host.data[hp, kv.parts * layer + j], buf.view(-1, 4, 2, 8)[dp].cpu())
    untouched = [p for p in range(41) if p not in host_pages]
    assert torch.equal(host.data[untouched], before[untouched])


@pytest.mark.parametrize("tiers", [False, True])
def test_conversation_tails_on_cuda_are_token_exact(tiers):
    """The next turn of a conversation takes the previous turn's partly filled last page (engine.cache.tails): copied
    on the device, or loaded from the host tier after other conversations pushed it out, with graphs and overlap on;
    outputs equal an engine without a prefix cache and the cached tokens cover every token computed before."""
    pytest.importorskip("triton")
    rng = random.Random(3)
    convs = [[rng.randrange(5, 900) for _ in range(37)] for _ in range(3)]
    path = model_path("tiny-llama")
    common = dict(device="cuda", dtype="float32", page_size=16, attention_backend="triton")
    extra = dict(enable_hierarchical_cache=True, hicache_ratio=8, max_total_tokens=192) if tiers else \
        dict(max_total_tokens=4096)
    with running_engine(path, max_total_tokens=4096, disable_radix_cache=True, **common) as plain, \
            running_engine(path, **extra, **common) as llm:
        converse(llm, plain, convs, SP, rng, vocab=900)
        if tiers:
            assert llm.get_load()["host_loaded_hit_tokens"] > 0
        assert llm.flush_cache()
        cache = llm.cache
        assert cache.pages.num_free == cache.pages.num_pages
        if tiers:
            assert cache.hierarchy.host.allocator.num_free == cache.hierarchy.host.allocator.num_pages
