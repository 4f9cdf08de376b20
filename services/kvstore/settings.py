"""Flags of the kvstore service."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.cache.storage import StorageOptions
from services.common.server import GrpcSettings

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

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend in ("file", "redis", "mooncake") and not self.storage_url:
            raise ValueError(f"--backend {self.backend} needs --storage-url")
        if self.capacity_bytes < 0:
            raise ValueError(f"--capacity-bytes must be >= 0, got {self.capacity_bytes}")
        if self.ttl_s < 0:
            raise ValueError(f"--ttl-s must be >= 0, got {self.ttl_s}")
        for name in ("storage_timeout_s", "worker_ttl_s", "subscribe_backoff_max_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.storage_threads <= 0:
            raise ValueError(f"--storage-threads must be > 0, got {self.storage_threads}")

    def storage_options(self) -> StorageOptions:
        return StorageOptions(url=self.storage_url, timeout_s=self.storage_timeout_s,
                              capacity_bytes=self.capacity_bytes, ttl_s=self.ttl_s)
