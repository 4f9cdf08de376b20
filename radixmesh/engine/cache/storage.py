"""The L3 storage contract of the hierarchical KV cache, and the registry of its backends.

The engine talks to an L3 tier only through `PageStorage`: pages are opaque bytes under opaque keys (chained page
hashes from `engine.cache.page_keys`), each with a CRC-32 of its bytes. Calls block; the engine makes them from its
own storage thread, never from the scheduler. A backend raises `StorageError` (or a subclass) for anything that went
wrong, after its own bounded timeout; the engine then treats the pages as missing and recomputes them.

Backends live in a registry of lazily imported factories, so `import engine` imports neither redis nor Mooncake
nor gRPC. The storage backends themselves (`memory`, `file`, `redis`, `mooncake`, in `engine.cache.storage_backends`)
serve both a worker that uses one directly and the kvstore service, which is a gRPC shell over one of them; a service
registers the kvstore's network client as `kvstore` before it builds the engine.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol


class StorageError(Exception):
    """An L3 operation failed (unreachable, timed out, refused); the pages count as missing."""


# Bytes per element of the KV dtypes a page may hold.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "fp8_e4m3": 1, "fp8_e5m2": 1}  # (the last two: --kv-cache-dtype's names)


@dataclass(frozen=True, slots=True)
class KvLayout:
    """What a page's bytes mean; bound into every key, so differently shaped pages never mix."""

    model: str
    page_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_buffers: int = 2  # buffers a layer: K and V, or a latent cache's one (engine.cache.kv_pool's `parts`)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: K and V of every layer, [kv_buffers * num_layers, page_size, num_kv_heads, head_dim]."""
        return (self.kv_buffers * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim
                * DTYPE_BYTES[self.dtype])

    def tag(self) -> bytes:
        buffers = "" if self.kv_buffers == 2 else f"|B{self.kv_buffers}"  # (K and V pages keep their old keys)
        return (f"{self.model}|p{self.page_size}|{self.dtype}|L{self.num_layers}|H{self.num_kv_heads}"
                f"|D{self.head_dim}{buffers}").encode()


class StoredPage(NamedTuple):
    key: bytes
    data: bytes
    checksum: int  # zlib.crc32(data)


def checksum(data: bytes | memoryview) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def make_page(key: bytes, data: bytes) -> StoredPage:
    return StoredPage(key, data, checksum(data))


def intact(page: StoredPage) -> bool:
    return checksum(page.data) == page.checksum


class PageStorage(Protocol):
    def exists(self, keys: list[bytes]) -> int:
        """How many of `keys`, from the first, are stored."""

    def get(self, keys: list[bytes]) -> list[StoredPage]:
        """The pages of the consecutive hit prefix of `keys`, in order (possibly fewer than exists() said)."""

    def set(self, pages: list[StoredPage]) -> int:
        """Store pages (an existing key is overwritten); returns how many were stored."""

    def clear(self) -> int:
        """Drop every page; returns how many were dropped."""

    def stats(self) -> dict:
        """At least: pages, bytes, capacity_bytes (0: unbounded), evictions, corrupt_pages."""

    def close(self) -> None: ...


class DirectPageStorage(PageStorage, Protocol):
    """A store that moves page bytes straight between its peer and registered host memory (the host pool), with no
    copy through Python bytes: `register_host` once, then pages by address. Checksums stay the caller's: it computes
    them over the memory it sends and checks them over the memory it received."""

    def register_host(self, ptr: int, nbytes: int) -> None:
        """Make [ptr, ptr + nbytes) reachable for this store's transfers."""

    def set_from(self, keys: list[bytes], checksums: list[int], addresses: list[int], page_bytes: int) -> int:
        """Store the pages lying at `addresses` (each `page_bytes` long) under `keys`; returns how many were stored.
        The memory must stay unchanged until the call returns."""

    def get_into(self, keys: list[bytes], addresses: list[int], page_bytes: int) -> list[int]:
        """Write the consecutive hit prefix of `keys` to `addresses`; returns the checksums the store holds for the
        pages written (the caller verifies them against the memory)."""


def is_direct(storage: PageStorage) -> bool:
    return callable(getattr(storage, "register_host", None))


@dataclass(frozen=True, slots=True)
class StorageOptions:
    url: str = ""  # the backend's address (redis://host:port/db, host:port) or directory; "" for memory
    timeout_s: float = 2.0  # bound on one call
    capacity_bytes: int = 1 << 30  # memory: LRU bound; file: bound on the directory's pages (0: unbounded)
    ttl_s: float = 0.0  # redis: expiry of a page after its last write (0: none)
    layout: KvLayout | None = None  # the engine's layout (the kvstore client sends it); None in the kvstore service
    # kvstore: how page bytes travel, "grpc" (in the messages) or "mooncake" (the Mooncake transfer engine, straight
    # from and into the host pool); transfer_host: the address the store reaches this process's engine at ("" : the
    # local address that routes to the store)
    transport: str = "grpc"
    transfer_host: str = ""


StorageFactory = Callable[[StorageOptions], PageStorage]
_FACTORIES: dict[str, StorageFactory | str] = {
    "memory": "radixmesh.engine.cache.storage_backends.memory:open_memory",
    "file": "radixmesh.engine.cache.storage_backends.file:open_file",
    "redis": "radixmesh.engine.cache.storage_backends.redis:open_redis",
    "mooncake": "radixmesh.engine.cache.storage_backends.mooncake:open_mooncake",
}


def register_storage_backend(name: str, factory: StorageFactory | str) -> None:
    """Add a backend: a factory, or "module:function" imported on first use."""
    _FACTORIES[name] = factory


def storage_backends() -> list[str]:
    return sorted(_FACTORIES)


def check_storage_backend(name: str) -> None:
    if name not in _FACTORIES:
        raise ValueError(f"unknown storage backend {name!r}; known: {', '.join(sorted(_FACTORIES))}")


def open_storage(name: str, options: StorageOptions) -> PageStorage:
    """Raises ValueError for an unknown name and StorageError when the backend cannot be reached."""
    check_storage_backend(name)
    factory = _FACTORIES[name]
    if isinstance(factory, str):
        import importlib

        module, _, fn = factory.partition(":")
        factory = getattr(importlib.import_module(module), fn)
    return factory(options)
