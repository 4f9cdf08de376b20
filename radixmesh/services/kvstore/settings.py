"""Flags of the kvstore service."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixmesh.engine.cache.storage import StorageOptions
from radixmesh.services.common.server import GrpcSettings

BACKENDS = ("memory", "file", "redis", "mooncake")


@dataclass(frozen=True, slots=True)
class KvStoreSettings(GrpcSettings):
    backend: str = field(default="memory", metadata={"help": f"where pages live: {', '.join(BACKENDS)}"})
    storage_url: str = field(default="", metadata={
        "help": "the backend's address: file: a directory; redis: redis://host:port/db; "
                "mooncake: mooncake://master_host:port[?params]; memory: unused"})
    capacity_bytes: int = field(default=1 << 30, metadata={
        "help": "memory: LRU bound; file: bound on the directory's pages (0: unbounded); mooncake: the memory this "
                "process adds to the pool"})
    ttl_s: float = field(default=0.0, metadata={
        "help": "redis: a page expires this long after its last write (0: never)"})
    storage_timeout_s: float = field(default=2.0, metadata={"help": "bound on one backend call, in seconds"})
    storage_threads: int = field(default=8, metadata={"help": "threads that run blocking backend calls"})
    worker_ttl_s: float = field(default=15.0, metadata={
        "help": "a worker whose event stream broke is forgotten when it has not re-registered for this long"})
    subscribe_backoff_max_s: float = field(default=5.0, metadata={
        "help": "longest wait between attempts to re-open a registered worker's event stream"})
    enable_mooncake_transfer: bool = field(default=False, metadata={
        "help": "also move page bytes with the Mooncake transfer engine (TCP) for workers that ask for it "
                "(transport mooncake): the gRPC calls then carry only keys and addresses"})
    transfer_host: str | None = field(default=None, metadata={
        "help": "the address workers reach this store's transfer engine at (default: --host unless it is a "
                "wildcard, else this host's name resolved)"})
    transfer_buffer_bytes: int = field(default=512 << 20, metadata={
        "help": "registered staging memory of the transfer engine, in slots of 64 MiB: how many transfer-engine "
                "calls can be in flight at once"})
    transfer_lease_s: float = field(default=10.0, metadata={
        "help": "a staged BatchGet's slot is freed after this long if the worker never released it"})

    def __post_init__(self) -> None:
        GrpcSettings.__post_init__(self)  # (slots: no zero-argument super())
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend in ("file", "redis", "mooncake") and not self.storage_url:
            raise ValueError(f"--backend {self.backend} needs --storage-url")
        if self.capacity_bytes < 0:
            raise ValueError(f"--capacity-bytes must be >= 0, got {self.capacity_bytes}")
        if self.ttl_s < 0:
            raise ValueError(f"--ttl-s must be >= 0, got {self.ttl_s}")
        if self.transfer_buffer_bytes < 64 << 20:
            raise ValueError(f"--transfer-buffer-bytes must be at least one 64 MiB slot, got "
                             f"{self.transfer_buffer_bytes}")
        for name in ("storage_timeout_s", "worker_ttl_s", "subscribe_backoff_max_s", "transfer_lease_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.storage_threads <= 0:
            raise ValueError(f"--storage-threads must be > 0, got {self.storage_threads}")

    def storage_options(self) -> StorageOptions:
        return StorageOptions(url=self.storage_url, timeout_s=self.storage_timeout_s,
                              capacity_bytes=self.capacity_bytes, ttl_s=self.ttl_s)
