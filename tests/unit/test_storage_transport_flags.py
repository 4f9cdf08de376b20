"""The transport of L3 page bytes as flags: the engine's extra-config key (checked with a clear error), and the
launcher's --kvstore-transport, which starts the kvstore with its transfer engine and adds the key to the workers'
extra config (keeping what the user put there)."""

from __future__ import annotations

import json

import pytest

from radixmesh.engine.config import EngineArgs, hicache_extra
from radixmesh.services.launch import LaunchSettings, plan


def _args(backend: str | None, extra: dict) -> EngineArgs:
    return EngineArgs(model_path="m", enable_hierarchical_cache=True, hicache_storage_backend=backend,
                      hicache_storage_backend_extra_config=json.dumps(extra))


def test_the_engine_checks_the_transport():
    assert hicache_extra(_args("kvstore", {"transport": "mooncake"}))["transport"] == "mooncake"
    with pytest.raises(ValueError, match="transport must be one of"):
        hicache_extra(_args("kvstore", {"transport": "rdma"}))
    with pytest.raises(ValueError, match="kvstore backend only"):
        hicache_extra(_args("redis", {"transport": "mooncake"}))


def _argv(children, name: str) -> list[str]:
    return next(c.argv for c in children if c.name.startswith(name))


def test_the_launcher_wires_the_mooncake_transport():
    engine = {"model_path": "m", "enable_hierarchical_cache": True,
              "hicache_storage_backend_extra_config": '{"skip_slow_fetches": false}'}
    children = plan(LaunchSettings(kvstore=True, kvstore_transport="mooncake"), engine)
    assert "--enable-mooncake-transfer" in _argv(children, "kvstore")
    worker = _argv(children, "worker")
    extra = json.loads(worker[worker.index("--hicache-storage-backend-extra-config") + 1])
    assert extra == {"skip_slow_fetches": False, "transport": "mooncake"}
    # grpc (the default) changes nothing; without L3 there is nothing to wire
    for settings in (LaunchSettings(kvstore=True), LaunchSettings(kvstore=True, kvstore_transport="mooncake",
                                                                  kvstore_l3=False)):
        children = plan(settings, engine)
        worker = _argv(children, "worker")
        assert "transport" not in worker[worker.index("--hicache-storage-backend-extra-config") + 1]
        assert "--enable-mooncake-transfer" not in _argv(children, "kvstore")
    with pytest.raises(ValueError, match="--kvstore-transport must be one of"):
        LaunchSettings(kvstore=True, kvstore_transport="tcp")


def test_the_engine_checks_the_io_backend():
    """--hicache-io-backend takes SGLang's kernel and direct; anything else is a clear error. On CPU both copy the
    same pages (no copy engine there: plain copies)."""
    import torch

    from radixmesh.engine.cache.host_pool import HostKVPool, KVMover
    from radixmesh.engine.cache.kv_pool import KVPool
    from radixmesh.engine.config import _check_hicache

    for io in ("kernel", "direct", None):  # None: host_pool.default_io_backend
        _check_hicache(EngineArgs(model_path="m", enable_hierarchical_cache=True, hicache_io_backend=io))
    with pytest.raises(ValueError, match="hicache_io_backend must be one of"):
        _check_hicache(EngineArgs(model_path="m", enable_hierarchical_cache=True, hicache_io_backend="dma"))
    kv = KVPool(8, 4, 2, 2, 8, torch.float32, torch.device("cpu"))
    host = HostKVPool(8, kv)
    host.data.copy_(torch.randn(host.data.shape))
    assert KVMover(kv, host).io_backend == "kernel"  # unset: no copy engine off CUDA
    mover = KVMover(kv, host, "direct")
    assert not mover.dma and mover.take_ready() is None
    mover.to_device([3, 4], [6, 1])
    mover.flush()
    assert torch.equal(kv.k[1].view(-1, 4, 2, 8)[6], host.data[3, 2]) and torch.equal(kv.v[0].view(-1, 4, 2, 8)[1],
                                                                                          host.data[4, 1])
