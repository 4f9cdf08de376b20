"""`memory`: pages in this process's memory, bounded by capacity_bytes with least-recently-used eviction (a get
refreshes a page's recency). For tests, single-node setups and as the kvstore's default backend."""

from __future__ import annotations

import threading
from collections import OrderedDict

from radixmesh.engine.cache.storage import StorageOptions, StoredPage, intact
from radixmesh.engine.cache.storage_backends.base import Counters, check_keys, split_intact


class MemoryStorage:
    """Thread-safe: one lock guards the page map; checksums are verified outside it."""

    def __init__(self, capacity_bytes: int = 0):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes  # 0: unbounded
        self._pages: OrderedDict[bytes, StoredPage] = OrderedDict()  # least recently used first
        self._bytes = 0  # sum of len(page.data) over _pages
        self._counters = Counters()
        self._lock = threading.Lock()

    def exists(self, keys: list[bytes]) -> int:
        check_keys(keys)
        with self._lock:
            n = 0
            for key in keys:
                if key not in self._pages:
                    break
                n += 1
            return n

    def get(self, keys: list[bytes]) -> list[StoredPage]:
        """Refreshes the recency of returned pages; deletes a damaged page and stops there."""
        check_keys(keys)
        with self._lock:
            found = []
            for key in keys:
                page = self._pages.get(key)
                if page is None:
                    break
                found.append(page)
        out = []
        for page in found:
            if not intact(page):
                self._drop_corrupt(page)
                break
            out.append(page)
        with self._lock:
            for page in out:
                if self._pages.get(page.key) is page:
                    self._pages.move_to_end(page.key)
            self._counters.count_get(len(keys), len(out))
        return out

    def set(self, pages: list[StoredPage]) -> int:
        """Stores intact pages no larger than the capacity, evicting the least recently used pages to fit."""
        check_keys(p.key for p in pages)
        good, rejected = split_intact(pages)
        stored = 0
        with self._lock:
            for page in good:
                size = len(page.data)
                if self.capacity_bytes and size > self.capacity_bytes:
                    rejected += 1
                    continue
                page = StoredPage(page.key, bytes(page.data), page.checksum)
                old = self._pages.pop(page.key, None)
                if old is not None:
                    self._bytes -= len(old.data)
                self._pages[page.key] = page
                self._bytes += size
                stored += 1
                self._evict()
            self._counters.sets += stored
            self._counters.rejected += rejected
        return stored

    def _evict(self) -> None:
        while self.capacity_bytes and self._bytes > self.capacity_bytes:
            _, old = self._pages.popitem(last=False)
            self._bytes -= len(old.data)
            self._counters.evictions += 1

    def _drop_corrupt(self, page: StoredPage) -> None:
        with self._lock:
            if self._pages.get(page.key) is page:
                del self._pages[page.key]
                self._bytes -= len(page.data)
            self._counters.corrupt_pages += 1

    def clear(self) -> int:
        with self._lock:
            n = len(self._pages)
            self._pages.clear()
            self._bytes = 0
            return n

    def stats(self) -> dict:
        with self._lock:
            return {"backend": "memory", "pages": len(self._pages), "bytes": self._bytes,
                    "capacity_bytes": self.capacity_bytes, **self._counters.as_dict()}

    def close(self) -> None:
        self.clear()


def open_memory(options: StorageOptions) -> MemoryStorage:
    return MemoryStorage(options.capacity_bytes)
