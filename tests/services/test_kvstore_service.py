"""The kvstore service as a real OS process on loopback (`python -m radixmesh.services.kvstore`), driven through the
engine's network client `KvStoreStorage`: round trips over the memory, file, redis and mooncake backends, bad input,
checksums refused on set, GetStats, a killed kvstore (bounded StorageError, then recovery when it is back), pages
of the file backend across a kvstore restart, a redis that goes away behind the kvstore (UNAVAILABLE with the
reason), SIGTERM."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixmesh.engine.cache.storage import KvLayout, StorageError, StorageOptions, StoredPage, make_page
from radixmesh.v1 import kvstore_pb2 as pb
from radixmesh.v1 import kvstore_pb2_grpc
from radixmesh.services.kvstore import convert
from radixmesh.services.kvstore.__main__ import main as kvstore_main
from radixmesh.services.kvstore.client import KvStoreStorage, register_kvstore_backend
from tests.conftest import ROOT
from tests.redis_fixture import free_port, redis_server  # noqa: F401 - a fixture
from tests.unit.test_storage_backends import MooncakeMaster
from tests.unit.test_storage_backends import _mooncake_master_binary as mooncake_master_binary

pytestmark = pytest.mark.timeout(60)

SERVICE = "radixmesh.v1.KvStoreService"
LAYOUT = KvLayout("tiny", page_size=4, dtype="float16", num_layers=2, num_kv_heads=2, head_dim=8)
PAGE_BYTES = LAYOUT.page_bytes  # 512


@dataclass
class KvStoreProcess:
    """`python -m radixmesh.services.kvstore` on a fixed port; start() again after kill() is a restart on the
    same port."""

    workdir: Path
    flags: list[str]
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.workdir / f"kvstore-{self.port}.log"

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def start(self, timeout_s: float = 20.0) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "radixmesh.services.kvstore", "--host", "127.0.0.1",
                                          "--port", str(self.port), *self.flags], cwd=ROOT, stdout=out,
                                         stderr=subprocess.STDOUT)
        self.starts += 1
        options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 100)]
        with grpc.insecure_channel(self.url, options=options) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, f"kvstore exited with {self.proc.returncode}:\n{self.output()}"
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.05)
        raise AssertionError(f"kvstore not SERVING after {timeout_s} s:\n{self.output()}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stub(self, ch: grpc.Channel) -> kvstore_pb2_grpc.KvStoreServiceStub:
        return kvstore_pb2_grpc.KvStoreServiceStub(ch)


def start_kvstore(workdir: Path, *flags: str) -> KvStoreProcess:
    kv = KvStoreProcess(workdir, list(flags))
    kv.start()
    return kv


def pages_for(n: int, tag: bytes = b"p", fill: int = 0) -> list[StoredPage]:
    return [make_page(tag + i.to_bytes(15, "big"), bytes([(i + fill) % 256]) * PAGE_BYTES) for i in range(n)]


def client(kv: KvStoreProcess, timeout_s: float = 2.0) -> KvStoreStorage:
    return KvStoreStorage(StorageOptions(url=kv.url, timeout_s=timeout_s, layout=LAYOUT))


@pytest.fixture
def kvstore(request, tmp_path):
    """A kvstore over the backend named by the parameter."""
    backend = request.param
    flags = ["--backend", backend]
    if backend == "file":
        flags += ["--storage-url", str(tmp_path / "pages")]
    elif backend == "redis":
        flags += ["--storage-url", request.getfixturevalue("redis_server").url, "--storage-timeout-s", "0.5"]
    elif backend == "mooncake":
        flags += ["--storage-url", request.getfixturevalue("mooncake_master").url, "--capacity-bytes", str(16 << 20)]
    kv = start_kvstore(tmp_path, *flags)
    yield kv
    kv.kill()


@pytest.fixture
def mooncake_master(tmp_path):
    if mooncake_master_binary() is None:
        pytest.skip("the Mooncake package (mooncake-transfer-engine-non-cuda) with mooncake_master is not installed")
    master = MooncakeMaster(tmp_path)
    master.start()
    yield master
    master.stop()


@pytest.mark.parametrize("kvstore", ["memory", "file", "redis", "mooncake"], indirect=True)
def test_round_trip_through_the_network_client(kvstore):
    store = client(kvstore)
    ps = pages_for(5)
    assert store.set([ps[0], ps[1], ps[2], ps[4]]) == 4
    keys = [p.key for p in ps]
    assert store.exists(keys) == 3
    got = store.get(keys)
    assert got == ps[:3]  # keys, data and checksums
    assert store.exists([]) == 0 and store.get([]) == [] and store.set([]) == 0
    newer = pages_for(1, fill=7)
    assert store.set(newer) == 1 and store.get(keys[:1]) == newer
    stats = store.stats()
    assert stats["pages"] == 4 and stats["bytes"] == 4 * PAGE_BYTES
    assert stats["indexed_workers"] == 0 and stats["backend"] == kvstore.flags[1]
    assert store.clear() == 4 and store.exists(keys) == 0
    store.close()


@pytest.mark.parametrize("kvstore", ["memory"], indirect=True)
def test_large_batches_go_in_several_requests(kvstore, monkeypatch):
    from radixmesh.services.kvstore import client as client_module

    monkeypatch.setattr(client_module, "REQUEST_BYTES", 2 * PAGE_BYTES)
    store = client(kvstore)
    ps = pages_for(7)
    assert store.set(ps[:5]) == 5  # 3 requests
    keys = [p.key for p in ps]
    assert store.get(keys) == ps[:5]  # 3 requests, the last one short
    assert store.get(keys[:4]) == ps[:4]
    assert store.set(ps[5:]) == 2 and store.get(keys) == ps
    store.close()


@pytest.mark.parametrize("kvstore", ["memory"], indirect=True)
def test_a_latent_layout_keeps_pages_of_one_buffer_a_layer(kvstore):
    """A latent cache's layout (kv_buffers 1: DeepSeek's one buffer a layer) reaches the store with its page size,
    half a K-and-V layout's of the same shape, under keys of its own; a K-and-V page is refused at that size."""
    latent = KvLayout("tiny", page_size=4, dtype="float16", num_layers=2, num_kv_heads=2, head_dim=8, kv_buffers=1)
    assert latent.page_bytes * 2 == PAGE_BYTES and latent.tag() != LAYOUT.tag()
    assert convert.layout_from_proto(convert.layout_to_proto(latent)) == latent
    assert convert.layout_from_proto(pb.KvLayout(model="tiny", page_size=4, dtype="float16", num_layers=2,
                                                 num_kv_heads=2, head_dim=8)) == LAYOUT  # unset: K and V
    with pytest.raises(ValueError, match="kv_buffers must be 1 or 2"):
        convert.layout_from_proto(pb.KvLayout(model="m", page_size=4, dtype="float16", num_layers=1, num_kv_heads=1,
                                              head_dim=1, kv_buffers=3))
    store = KvStoreStorage(StorageOptions(url=kvstore.url, timeout_s=2.0, layout=latent))
    page = make_page(b"latent".ljust(16, b"\0"), bytes(range(256)))
    assert store.set([page]) == 1 and store.get([page.key]) == [page]
    with pytest.raises(StorageError, match="a page of layout tiny\\|p4\\|float16\\|L2\\|H2\\|D8\\|B1 is 256 bytes"):
        store.set([make_page(b"kv".ljust(16, b"\0"), b"x" * PAGE_BYTES)])


@pytest.mark.parametrize("kvstore", ["memory"], indirect=True)
def test_bad_input_is_invalid_argument_and_the_service_keeps_serving(kvstore):
    store = client(kvstore)
    with pytest.raises(StorageError, match=r"INVALID_ARGUMENT: pages\[0\].data is 10 bytes; a page of layout "
                                           r"tiny\|p4\|float16\|L2\|H2\|D8 is 512 bytes"):
        store.set([make_page(b"k", b"x" * 10)])
    with pytest.raises(StorageError, match=r"INVALID_ARGUMENT: keys\[1\] is empty"):
        store.get([b"a", b""])
    with grpc.insecure_channel(kvstore.url) as ch:
        stub = kvstore.stub(ch)
        bad_layout = pb.KvLayout(model="m", page_size=4, dtype="int3", num_layers=1, num_kv_heads=1, head_dim=1)
        for request, message in [
            (pb.RegisterWorkerRequest(worker_url="w:1"), "layout is required"),
            (pb.RegisterWorkerRequest(layout=convert.layout_to_proto(LAYOUT)), "worker_url is required"),
            (pb.RegisterWorkerRequest(worker_url="w:1", layout=bad_layout), "layout.dtype must be one of"),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                stub.RegisterWorker(request, timeout=2)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.BatchExists(pb.BatchExistsRequest(keys=[b"k" * 101]), timeout=2)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 100" in info.value.details()
        # without a layout (page_size 0) any page size is accepted
        raw = make_page(b"free", b"abc")
        response = stub.BatchSet(pb.BatchSetRequest(pages=convert.pages_to_proto([raw])), timeout=2)
        assert (response.stored, response.rejected) == (1, 0)
    assert store.set(pages_for(1)) == 1  # still serving
    store.close()


@pytest.mark.parametrize("kvstore", ["memory"], indirect=True)
def test_set_refuses_pages_whose_checksum_does_not_match(kvstore):
    good, bad = pages_for(2)
    bad = StoredPage(bad.key, bad.data, bad.checksum ^ 0xFFFF)
    with grpc.insecure_channel(kvstore.url) as ch:
        request = pb.BatchSetRequest(layout=convert.layout_to_proto(LAYOUT), pages=convert.pages_to_proto([good, bad]))
        response = kvstore.stub(ch).BatchSet(request, timeout=2)
    assert (response.stored, response.rejected) == (1, 1)
    store = client(kvstore)
    assert store.exists([good.key]) == 1 and store.exists([bad.key]) == 0
    assert store.set([bad]) == 0
    store.close()


def test_get_stats_counts(tmp_path):
    kv = start_kvstore(tmp_path, "--backend", "memory", "--capacity-bytes", str(3 * PAGE_BYTES))
    store = client(kv)
    ps = pages_for(4)
    try:
        assert store.set(ps[:3]) == 3
        assert len(store.get([p.key for p in ps])) == 3  # 3 hits, 1 miss
        assert store.set(ps[3:]) == 1  # evicts the least recently used page (page 0)
        stats = store.stats()
        assert stats == {"backend": "memory", "pages": 3, "bytes": 3 * PAGE_BYTES, "capacity_bytes": 3 * PAGE_BYTES,
                         "get_hits": 3, "get_misses": 1, "sets": 4, "evictions": 1, "corrupt_pages": 0,
                         "indexed_workers": 0, "indexed_pages": 0, "transfer_session": "", "transfer_bytes_in": 0,
                         "transfer_bytes_out": 0}
        assert store.exists([ps[0].key]) == 0 and store.exists([p.key for p in ps[1:]]) == 3
    finally:
        store.close()
        kv.kill()


@pytest.mark.parametrize("backend", ["memory", "file"])
def test_killed_kvstore_is_a_bounded_storage_error_then_recovers(backend, tmp_path):
    flags = ["--backend", backend] + (["--storage-url", str(tmp_path / "pages")] if backend == "file" else [])
    kv = start_kvstore(tmp_path, *flags)
    store = client(kv, timeout_s=1.0)
    ps = pages_for(3)
    try:
        assert store.set(ps) == 3
        kv.kill()
        for call in (lambda: store.exists([ps[0].key]), lambda: store.get([ps[0].key]), lambda: store.set(ps)):
            start = time.monotonic()
            with pytest.raises(StorageError, match=f"kvstore {kv.url} Batch\\w+: (UNAVAILABLE|DEADLINE_EXCEEDED)"):
                call()
            assert time.monotonic() - start < 2.0
        kv.start()  # same port
        deadline = time.monotonic() + 10
        while True:  # the channel reconnects within its (short) backoff
            try:
                found = store.exists([p.key for p in ps])
                break
            except StorageError:
                assert time.monotonic() < deadline, "the client did not reconnect to the restarted kvstore"
                time.sleep(0.05)
        assert found == (3 if backend == "file" else 0)  # the file backend's pages outlive the process
        if backend == "file":
            assert store.get([p.key for p in ps]) == ps
        assert store.set(pages_for(1, tag=b"q")) == 1
    finally:
        store.close()
        kv.kill()


def test_a_backend_failure_is_unavailable_with_the_reason(tmp_path, redis_server):  # noqa: F811
    kv = start_kvstore(tmp_path, "--backend", "redis", "--storage-url", redis_server.url, "--storage-timeout-s", "0.5")
    store = client(kv)
    try:
        assert store.set(pages_for(2)) == 2
        redis_server.stop()
        with pytest.raises(StorageError, match=f"UNAVAILABLE: redis storage: redis at {redis_server.url}"):
            store.exists([p.key for p in pages_for(2)])
        redis_server.start()
        assert store.set(pages_for(2)) == 2 and store.exists([p.key for p in pages_for(2)]) == 2
    finally:
        store.close()
        kv.kill()


def test_open_storage_kvstore_after_registering_the_backend(tmp_path):
    from radixmesh.engine.cache.storage import open_storage

    kv = start_kvstore(tmp_path, "--backend", "memory")
    try:
        register_kvstore_backend()
        store = open_storage("kvstore", StorageOptions(url=kv.url, timeout_s=1.0, layout=LAYOUT))
        assert isinstance(store, KvStoreStorage) and store.set(pages_for(1)) == 1
        store.close()
    finally:
        kv.proc.send_signal(signal.SIGTERM)
        assert kv.proc.wait(timeout=10) == 0
        assert "stopped" in kv.output()


def test_bad_flags_and_an_unreachable_backend_stop_the_process_with_the_reason(capsys):
    with pytest.raises(SystemExit):
        kvstore_main(["--backend", "file"])
    assert "--backend file needs --storage-url" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kvstore_main(["--backend", "rocks"])
    assert "--backend must be one of memory, file, redis, mooncake" in capsys.readouterr().err
    url = f"redis://127.0.0.1:{free_port()}/0"
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        assert kvstore_main(["--backend", "redis", "--storage-url", url, "--storage-timeout-s", "0.5"]) == 1
    finally:  # main() set up the service's logging; give pytest its own back
        root.handlers[:], root.level = handlers, level
    assert "cannot open the redis storage" in capsys.readouterr().err
