"""KV transfer backends: page runs become batched writes; the fake backend copies, drops, delays and corrupts on
request; the real Mooncake transfer engine moves pages between two processes over TCP on loopback and fails fast
when the peer is gone."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest
import torch

from radixmesh.engine.disaggregation.fake_backend import Faults
from radixmesh.engine.disaggregation.registry import make_backend
from radixmesh.engine.disaggregation.transfer import TransferError, Write, page_runs, page_writes

PAGE = 256  # bytes per page in these tests


def test_page_runs_group_consecutive_pages():
    assert page_runs([3, 4, 5, 9, 10, 2], [7, 8, 9, 1, 2, 20]) == [(3, 7, 3), (9, 1, 2), (2, 20, 1)]
    assert page_runs([1, 2, 3], [5, 7, 8]) == [(1, 5, 1), (2, 7, 2)]
    assert page_runs([], []) == []
    with pytest.raises(ValueError, match="2 source pages for 1"):
        page_runs([1, 2], [3])


def test_page_writes_cover_exactly_the_pages():
    writes = page_writes(1000, 50000, PAGE, [0, 1, 4], [10, 11, 2])
    assert writes == [Write(1000, 50000 + 10 * PAGE, 2 * PAGE), Write(1000 + 4 * PAGE, 50000 + 2 * PAGE, PAGE)]


def _buffers(pages: int = 16):
    src = np.arange(pages * PAGE, dtype=np.uint32).view(np.uint8)[:pages * PAGE].copy()
    return src, np.zeros(pages * PAGE, dtype=np.uint8)


def test_fake_backend_copies_pages_and_injects_faults():
    src, dst = _buffers()
    a, b = make_backend("fake"), make_backend("fake")
    a.register(src.ctypes.data, src.nbytes)
    b.register(dst.ctypes.data, dst.nbytes)
    src_pages, dst_pages = [1, 2, 3, 7], [4, 5, 6, 0]
    a.write(b.session_id, page_writes(src.ctypes.data, dst.ctypes.data, PAGE, src_pages, dst_pages))
    for s, d in zip(src_pages, dst_pages):
        assert (dst[d * PAGE:(d + 1) * PAGE] == src[s * PAGE:(s + 1) * PAGE]).all()
    assert a.writes_done == 2  # two runs
    dst[:] = 0
    a.faults = Faults(drop=True)
    with pytest.raises(TransferError, match="injected drop"):
        a.write(b.session_id, page_writes(src.ctypes.data, dst.ctypes.data, PAGE, [1], [1]))
    assert not dst.any()  # a dropped write copies nothing
    a.faults = Faults(corrupt=True, delay_s=0.05)
    t = time.monotonic()
    a.write(b.session_id, page_writes(src.ctypes.data, dst.ctypes.data, PAGE, [1], [1]))
    assert time.monotonic() - t >= 0.05
    assert dst[PAGE] != src[PAGE] and (dst[PAGE + 1:2 * PAGE] == src[PAGE + 1:2 * PAGE]).all()
    with pytest.raises(TransferError, match="not registered"):
        a.write(b.session_id, [Write(src.ctypes.data, dst.ctypes.data + dst.nbytes, 8)])
    b.close()
    with pytest.raises(TransferError, match="no peer"):
        a.write(b.session_id, [Write(src.ctypes.data, dst.ctypes.data, 8)])


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown transfer backend 'rdma-magic'"):
        make_backend("rdma-magic")


def _receiver(conn, pages: int) -> None:
    """A second process: registers a zeroed buffer, reports (session id, address), then returns its contents."""
    backend = make_backend("mooncake")
    dst = np.zeros(pages * PAGE, dtype=np.uint8)
    backend.register(dst.ctypes.data, dst.nbytes)
    conn.send((backend.session_id, dst.ctypes.data))
    conn.recv()  # the sender is done
    conn.send(dst.tobytes())
    conn.recv()


def test_mooncake_moves_pages_between_processes_over_tcp():
    pytest.importorskip("mooncake.engine")
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    peer = ctx.Process(target=_receiver, args=(there, 16), daemon=True)
    peer.start()
    try:
        session, remote = here.recv()
        src, _ = _buffers()
        backend = make_backend("mooncake")
        backend.register(src.ctypes.data, src.nbytes)
        src_pages, dst_pages = [0, 1, 2, 9, 3], [8, 9, 10, 0, 15]
        backend.write(session, page_writes(src.ctypes.data, remote, PAGE, src_pages, dst_pages))
        here.send("done")
        got = np.frombuffer(here.recv(), dtype=np.uint8)
        for s, d in zip(src_pages, dst_pages):
            assert (got[d * PAGE:(d + 1) * PAGE] == src[s * PAGE:(s + 1) * PAGE]).all()
        untouched = sorted(set(range(16)) - set(dst_pages))
        assert not any(got[d * PAGE:(d + 1) * PAGE].any() for d in untouched)
        here.send("bye")
        peer.join(timeout=10)
        peer.kill()
        t = time.monotonic()
        with pytest.raises(TransferError, match="failed"):
            backend.write(session, page_writes(src.ctypes.data, remote, PAGE, [0], [0]))
        assert time.monotonic() - t < 5  # a dead peer fails fast, not after a long timeout
        backend.close()
    finally:
        peer.kill()


def _pool(seed: int | None):
    import torch

    from radixmesh.engine.cache.kv_pool import KVPool

    pool = KVPool(num_pages=12, page_size=4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                  device=torch.device("cpu"))
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for t in pool.buffers():
            t.copy_(torch.randn(t.shape, generator=gen))
    return pool


def test_a_requests_pages_move_between_pools_and_checksums_catch_corruption():
    from radixmesh.engine.disaggregation.kv_pages import kv_writes, layout_of, page_checksum, register_pool

    src, dst = _pool(seed=1), _pool(seed=None)
    a, b = make_backend("fake"), make_backend("fake")
    register_pool(a, src)
    register_pool(b, dst)
    src_pages, dst_pages = [2, 3, 4, 9], [7, 8, 9, 1]
    writes = kv_writes(layout_of(src), layout_of(dst), src_pages, dst_pages)
    assert len(writes) == 2 * 3 * 2  # 2 runs in each of 6 buffers
    a.write(b.session_id, writes)
    for s_buf, d_buf in zip(src.buffers(), dst.buffers()):
        for s, d in zip(src_pages, dst_pages):
            assert (s_buf[s * 4:(s + 1) * 4] == d_buf[d * 4:(d + 1) * 4]).all()
    assert page_checksum(src, src_pages) == page_checksum(dst, dst_pages)
    assert page_checksum(dst, [5]) == page_checksum(_pool(seed=None), [5])  # untouched pages stay zero
    a.faults = Faults(corrupt=True)
    a.write(b.session_id, kv_writes(layout_of(src), layout_of(dst), [5], [5]))
    assert page_checksum(src, [5]) != page_checksum(dst, [5])
    other = _pool(seed=None)
    other.k = [t[:, :1].contiguous() for t in other.k]  # a model with fewer KV heads
    with pytest.raises(ValueError, match="KV layouts differ"):
        kv_writes(layout_of(src), layout_of(other), [1], [1])


def _shm_receiver(conn, pages: int) -> None:
    """A second process: a zeroed shared mirror of a KV pool, registered with an shm backend; reports (session id,
    layout), then returns the mirror's bytes."""
    from radixmesh.engine.disaggregation.kv_pages import KvLayout
    from radixmesh.engine.disaggregation.mirror import KvMirror

    mirror = KvMirror.for_pool(_pool(seed=None), shared=True)
    backend = make_backend("shm")
    for t in mirror.buffers:
        backend.register(t.data_ptr(), t.numel() * t.element_size())
    conn.send((backend.session_id, KvLayout(tuple(t.data_ptr() for t in mirror.buffers), mirror.pool.page_bytes),
               mirror.paths))
    conn.recv()  # the sender is done
    conn.send([t.clone() for t in mirror.buffers])
    conn.recv()
    backend.close()
    mirror.close()


def _shm_peer():
    """A receiver process (_shm_receiver) and our end of its pipe."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    peer = ctx.Process(target=_shm_receiver, args=(there, 12), daemon=True)
    peer.start()
    return peer, here


@pytest.mark.parametrize("how,src_pages,dst_pages", [
    ("memcpy", [0, 1, 2, 7, 3], [8, 9, 10, 0, 11]),  # host memory (write)
    ("tensor copies", [0, 1, 2, 7, 3], [8, 9, 10, 0, 11]),  # a pool's tensors (copy_in), by runs
    ("tensor copies", [11, 0, 9, 2, 7, 4, 5, 1, 10, 3], list(range(2, 12)))])  # scattered: gathered first
def test_shm_moves_pages_between_processes_and_refuses_what_it_cannot_reach(how, src_pages, dst_pages):
    from radixmesh.engine.disaggregation.kv_pages import kv_writes, layout_of
    from radixmesh.engine.disaggregation.mirror import KvMirror

    peer, here = _shm_peer()
    try:
        session, remote, files = here.recv()
        assert session.startswith("shm:") and all(os.path.exists(f) for f in files)
        src = _pool(seed=3)
        backend = make_backend("shm")  # the source needs no shared memory: any local address can be written from
        for t in src.buffers():
            backend.register(t.data_ptr(), t.numel() * t.element_size())
        if how == "memcpy":
            backend.write(session, kv_writes(layout_of(src), remote, src_pages, dst_pages))
        else:
            pool_itself = KvMirror.for_pool(src, staged=False)  # what a sender on a GPU copies from
            backend.copy_in(session, pool_itself.pieces(src_pages, remote, dst_pages))
            with pytest.raises(TransferError, match="not in memory the peer registered"):
                backend.copy_in(session, [(src.buffers()[0].view(-1).view(torch.uint8)[:8], max(remote.bases) + 2**30)])
            with pytest.raises(TransferError, match="not an shm transfer backend"):
                backend.copy_in("127.0.0.1:4000", pool_itself.pieces([1], remote, [1]))
            with pytest.raises(ValueError, match="KV layouts differ"):
                list(pool_itself.pieces([1], remote._replace(page_bytes=remote.page_bytes * 2), [1]))
        here.send("done")
        got = here.recv()
        size = src.page_size
        for s_buf, d_buf in zip(src.buffers(), got):
            for s, d in zip(src_pages, dst_pages):
                assert (s_buf[s * size:(s + 1) * size] == d_buf[d * size:(d + 1) * size]).all()
            untouched = sorted(set(range(12)) - set(dst_pages))
            assert not any(d_buf[d * size:(d + 1) * size].any() for d in untouched)
        with pytest.raises(TransferError, match="not in memory the peer registered"):
            backend.write(session, [Write(src.buffers()[0].data_ptr(), max(remote.bases) + 2**30, 8)])
        with pytest.raises(TransferError, match="not an shm transfer backend"):
            backend.write("127.0.0.1:4000", [Write(src.buffers()[0].data_ptr(), remote.bases[0], 8)])
        here.send("bye")
        peer.join(timeout=10)
        assert not any(os.path.exists(f) for f in [*files, session.removeprefix("shm:")])  # nothing left in /dev/shm
        with pytest.raises(TransferError, match="cannot read its index"):
            backend.write("shm:/dev/shm/radixmesh-none", [Write(src.buffers()[0].data_ptr(), 0, 8)])
        backend.close()
    finally:
        peer.kill()


def test_shm_files_of_a_killed_worker_are_swept_by_the_next_backend():
    peer, here = _shm_peer()
    session, _, files = here.recv()
    peer.kill()  # no atexit, no close: its mirror and index stay in /dev/shm
    peer.join(timeout=10)
    left = [*files, session.removeprefix("shm:")]
    assert all(os.path.exists(f) for f in left)
    make_backend("shm").close()
    assert not any(os.path.exists(f) for f in left)


@pytest.mark.parametrize("pages", [[2, 3, 4, 9, 10], [0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 11]])  # runs / scattered
def test_staging_copies_exactly_the_pages_whether_in_runs_or_scattered(pages):
    from radixmesh.engine.disaggregation.mirror import KvMirror

    pool = _pool(seed=5)
    mirror = KvMirror.for_pool(pool, staged=True)
    for t in mirror.buffers:
        t.fill_(-1.0)
    before = [t.clone() for t in mirror.buffers]
    slots = mirror.hold(pages)
    assert slots == list(range(len(pages)))  # one run of the mirror's pages, whatever the pool's
    mirror.stage_out(pages, slots)
    size = pool.page_size
    for src, twin, old in zip(pool.buffers(), mirror.buffers, before):
        for m in range(12):
            want = src[pages[m] * size:(pages[m] + 1) * size] if m < len(pages) else old[m * size:(m + 1) * size]
            assert torch.equal(twin[m * size:(m + 1) * size], want), m  # mirror pages not lent are left alone
    back = _pool(seed=None)
    KvMirror(back, mirror.buffers).stage_in(slots, pages)
    for src, got in zip(pool.buffers(), back.buffers()):
        for p in range(12):
            want = src if p in pages else torch.zeros_like(src)
            assert torch.equal(got[p * size:(p + 1) * size], want[p * size:(p + 1) * size]), p
    mirror.release(slots)
    assert mirror.slots.num_free == mirror.buffers[0].shape[0] // size  # every page lent came back


def test_mirror_slots_lend_one_run_where_there_is_one_and_merge_what_comes_back():
    from radixmesh.engine.disaggregation.mirror import Slots

    slots = Slots(10)
    a, b, c = slots.take(3), slots.take(3), slots.take(3)
    assert (a, b, c) == ([0, 1, 2], [3, 4, 5], [6, 7, 8])
    slots.give(a)
    slots.give(c)  # free: 0-2, 6-9
    assert slots.take(4) == [6, 7, 8, 9]  # the first run long enough
    assert slots.take(2) == [0, 1]
    slots.give([1, 0])
    slots.give(b)  # 0-5 merged back into one run
    assert slots.take(6) == [0, 1, 2, 3, 4, 5]
    slots.give([0, 1, 4, 5])
    assert slots.take(3) == [0, 1, 4]  # no run long enough: pieces of several
    with pytest.raises(RuntimeError, match="1 free pages, 2 asked for"):
        slots.take(2)
