"""Transfer backends by name (--disaggregation-transfer-backend), imported lazily so `import engine` works
without Mooncake installed."""

from __future__ import annotations

from typing import Callable

from radixmesh.engine.disaggregation.transfer import TransferBackend


def _mooncake(host: str, **options) -> TransferBackend:
    from radixmesh.engine.disaggregation.mooncake_backend import MooncakeBackend

    return MooncakeBackend(host, **options)


def _fake(host: str, **options) -> TransferBackend:
    from radixmesh.engine.disaggregation.fake_backend import FakeBackend

    return FakeBackend(host, **options)


def _shm(host: str, **options) -> TransferBackend:
    from radixmesh.engine.disaggregation.shm_backend import ShmBackend

    return ShmBackend(host, **options)


BACKENDS: dict[str, Callable[..., TransferBackend]] = {"mooncake": _mooncake, "shm": _shm, "fake": _fake}


def make_backend(name: str, host: str = "127.0.0.1", faults=None, **options) -> TransferBackend:
    """The named backend; the fake one, and any other given `faults` (a fake_backend.Faults), comes wrapped in a
    FaultInjector whose `faults` can be changed at any time."""
    if name not in BACKENDS:
        raise ValueError(f"unknown transfer backend {name!r}; choose one of {', '.join(BACKENDS)}")
    backend = BACKENDS[name](host, **options)
    if name == "fake" or faults is not None:
        from radixmesh.engine.disaggregation.fake_backend import FaultInjector

        backend = FaultInjector(backend, faults)
    return backend
