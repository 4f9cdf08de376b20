"""Page bytes over the Mooncake transfer engine (TCP) between a real kvstore process (`--enable-mooncake-transfer`)
and `KvStoreTransferStorage`: round trips as bytes and straight from and into registered memory (the host pool's
path), a page changed under the store's read is refused, leases are released (and expire when a caller vanishes),
a store without the engine answers with a clear error, bad transfer requests are INVALID_ARGUMENT."""

from __future__ import annotations

import time
import zlib

import grpc
import numpy as np
import pytest

from radixmesh.engine.cache.storage import StorageError, StorageOptions, is_direct, make_page
from radixmesh.v1 import kvstore_pb2 as pb
from radixmesh.services.kvstore.client import KvStoreStorage, KvStoreTransferStorage, open_kvstore
from radixmesh.services.kvstore.transfer import SLOT_BYTES, StagingSlots
from tests.services.test_kvstore_service import LAYOUT, PAGE_BYTES, client, pages_for, start_kvstore

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda")
pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def kvstore(tmp_path):
    kv = start_kvstore(tmp_path, "--backend", "memory", "--enable-mooncake-transfer", "--transfer-buffer-bytes",
                       str(2 * SLOT_BYTES), "--transfer-lease-s", "1")
    yield kv
    kv.kill()


def transfer_client(kv, timeout_s: float = 5.0) -> KvStoreTransferStorage:
    storage = open_kvstore(StorageOptions(url=kv.url, timeout_s=timeout_s, layout=LAYOUT, transport="mooncake"))
    assert isinstance(storage, KvStoreTransferStorage) and is_direct(storage)
    return storage


class HostMemory:
    """A registered buffer of pages standing in for the host pool."""

    def __init__(self, storage: KvStoreTransferStorage, pages: int):
        self.data = np.zeros(pages * PAGE_BYTES, dtype=np.uint8)
        storage.register_host(self.data.ctypes.data, self.data.nbytes)

    def address(self, page: int) -> int:
        return self.data.ctypes.data + page * PAGE_BYTES

    def view(self, page: int) -> np.ndarray:
        return self.data[page * PAGE_BYTES:(page + 1) * PAGE_BYTES]


def test_bytes_round_trip_and_grpc_clients_see_the_same_pages(kvstore):
    storage = transfer_client(kvstore)
    plain = client(kvstore)
    try:
        assert storage.stats()["transfer_session"], "GetStats names the store's transfer engine"
        pages = pages_for(20, b"t")
        assert storage.set(pages) == 20
        assert [p.data for p in storage.get([p.key for p in pages] + [b"missing"])] == [p.data for p in pages]
        # the same store serves page bytes over gRPC to a client without the engine
        assert [p.data for p in plain.get([p.key for p in pages])] == [p.data for p in pages]
        other = pages_for(3, b"g", fill=7)
        assert plain.set(other) == 3
        assert [p.data for p in storage.get([p.key for p in other])] == [p.data for p in other]
    finally:
        storage.close()
        plain.close()


def test_straight_from_and_into_registered_memory(kvstore):
    storage = transfer_client(kvstore)
    try:
        host = HostMemory(storage, 64)
        rng = np.random.default_rng(0)
        host.data[:] = rng.integers(0, 256, host.data.size, dtype=np.uint8)
        keys = [b"direct" + i.to_bytes(10, "big") for i in range(30)]
        sources = list(range(30))
        checksums = [zlib.crc32(host.view(p)) for p in sources]
        assert storage.set_from(keys, checksums, [host.address(p) for p in sources], PAGE_BYTES) == 30
        # read them back into other pages (in reverse order, so no range merges by accident)
        targets = [63 - i for i in range(30)]
        assert storage.get_into(keys + [b"missing!"], [host.address(p) for p in targets] + [host.address(0)],
                                PAGE_BYTES) == checksums
        for src, dst in zip(sources, targets):
            assert np.array_equal(host.view(src), host.view(dst))
        # a page whose memory changed after its checksum was taken is refused, not stored
        host.view(1)[:] ^= 0xFF
        bad = [b"changed-under-read"]
        assert storage.set_from(bad, [checksums[1]], [host.address(1)], PAGE_BYTES) == 0
        assert storage.exists(bad) == 0
        assert storage.stats()["pages"] == 30
    finally:
        storage.close()


def test_every_lease_is_released_and_slots_do_not_run_out(kvstore):
    storage = transfer_client(kvstore)
    try:
        pages = pages_for(4)
        storage.set(pages)
        # 2 slots: without releases the third call would wait for a lease to expire
        start = time.monotonic()
        for _ in range(10):
            assert len(storage.get([p.key for p in pages])) == 4
        assert time.monotonic() - start < 1.0
        assert "expired" not in kvstore.output()
    finally:
        storage.close()


def test_a_vanished_reader_s_lease_expires():
    slots = StagingSlots("127.0.0.1", 2 * SLOT_BYTES, lease_s=0.2)
    try:
        a, b = slots.take(0.1), slots.take(0.1)
        slots.lease(a)
        slots.lease(b)
        with pytest.raises(StorageError, match="no free transfer slot"):
            slots.take(0.05)
        assert slots.take(1.0) in (a, b), "a lease nobody released frees its slot when it expires"
        assert slots.stats["expired_leases"] >= 1
        assert slots.release(12345) is False
    finally:
        slots.close()


def test_a_store_without_the_engine_says_so(tmp_path):
    kv = start_kvstore(tmp_path, "--backend", "memory")
    storage = open_kvstore(StorageOptions(url=kv.url, timeout_s=2, layout=LAYOUT, transport="mooncake"))
    try:
        assert storage.stats()["transfer_session"] == ""
        with pytest.raises(StorageError, match="--enable-mooncake-transfer"):
            storage.set(pages_for(1))
        with pytest.raises(StorageError, match="--enable-mooncake-transfer"):
            storage.get([b"k"])
        assert isinstance(open_kvstore(StorageOptions(url=kv.url, layout=LAYOUT)), KvStoreStorage)
    finally:
        storage.close()
        kv.kill()


def test_bad_transfer_requests_are_invalid_argument(kvstore):
    page = make_page(b"k1", b"\0" * PAGE_BYTES)
    layout = pb.KvLayout(model=LAYOUT.model, page_size=LAYOUT.page_size, dtype=LAYOUT.dtype,
                         num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads, head_dim=LAYOUT.head_dim)
    head = pb.KvPage(key=page.key, checksum=page.checksum, length=PAGE_BYTES)
    cases = {
        "session_id is required": pb.BatchSetRequest(layout=layout, pages=[head],
                                                     transfer=pb.TransferPages(addresses=[4096])),
        "addresses has 2 entries for 1 pages": pb.BatchSetRequest(
            layout=layout, pages=[head], transfer=pb.TransferPages(session_id="127.0.0.1:1", addresses=[1, 2])),
        "length is 3": pb.BatchSetRequest(layout=layout, pages=[pb.KvPage(key=b"k", length=3)],
                                          transfer=pb.TransferPages(session_id="127.0.0.1:1", addresses=[1])),
        "carries data": pb.BatchSetRequest(layout=layout, pages=[pb.KvPage(key=b"k", data=b"x" * PAGE_BYTES,
                                                                           length=PAGE_BYTES)],
                                           transfer=pb.TransferPages(session_id="127.0.0.1:1", addresses=[1])),
    }
    with grpc.insecure_channel(kvstore.url) as ch:
        stub = kvstore.stub(ch)
        for message, request in cases.items():
            with pytest.raises(grpc.RpcError) as e:
                stub.BatchSet(request, timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details(), message
        # a peer that is not there: the read fails with a reason, within the call, and the service keeps serving
        with pytest.raises(grpc.RpcError) as e:
            stub.BatchSet(pb.BatchSetRequest(layout=layout, pages=[head], transfer=pb.TransferPages(
                session_id="127.0.0.1:1", addresses=[4096])), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "mooncake read" in e.value.details()
        assert stub.ReleaseStaged(pb.ReleaseStagedRequest(lease_id=999), timeout=5).released is False
        assert stub.GetStats(pb.GetStatsRequest(), timeout=5).pages == 0


def test_the_worker_s_storage_path_moves_host_pages_and_refuses_a_bad_one(kvstore):
    """StorageIO over a real host pool: write-back and prefetch go straight from and into the pool; a page whose
    bytes do not match the checksum the store sent ends the fetch there and is counted corrupt."""
    from types import SimpleNamespace

    import torch

    from radixmesh.engine.cache.host_pool import HostKVPool
    from radixmesh.engine.cache.storage_io import JobKind, StorageIO, StorageJob

    k = torch.empty((1, LAYOUT.num_kv_heads, LAYOUT.head_dim), dtype=torch.float16)
    host = HostKVPool(16, SimpleNamespace(k=[k] * LAYOUT.num_layers, page_size=LAYOUT.page_size, parts=2))
    assert host.page_bytes == PAGE_BYTES
    host.data.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(0))
    storage = transfer_client(kvstore)
    flip = {"on": False}
    get_into = storage.get_into

    def damaged(keys, addresses, page_bytes):
        crcs = get_into(keys, addresses, page_bytes)
        return [c ^ 1 if flip["on"] and i == 2 else c for i, c in enumerate(crcs)]

    storage.get_into = damaged
    io = StorageIO(lambda: storage, host)

    def run(job: StorageJob) -> StorageJob:
        io.submit(job)
        assert io.wait_idle(30)
        (done,) = io.poll()
        assert done.error is None, done.error
        return done

    try:
        keys = [b"io" + i.to_bytes(4, "big") for i in range(4)]
        run(StorageJob(JobKind.WRITE, None, keys, [1, 2, 3, 4]))
        assert run(StorageJob(JobKind.FETCH, None, keys, [9, 10, 11, 12])).loaded == 4
        raw = host.data.view(torch.uint8)
        assert torch.equal(raw[1:5], raw[9:13])
        flip["on"] = True
        bad = run(StorageJob(JobKind.FETCH, None, keys, [5, 6, 7, 8]))
        assert (bad.loaded, bad.corrupt) == (2, 1) and io.stats["corrupt_pages"] == 1
        stats = storage.stats()
        assert stats["transfer_bytes_in"] == 4 * PAGE_BYTES and stats["transfer_bytes_out"] == 8 * PAGE_BYTES
    finally:
        io.close()
