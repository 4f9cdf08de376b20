"""`redis`: pages in a Redis server (options.url, `redis://host:port/db`), shared by every process that reaches it.

A page is the binary value of `rmkv:<key>`: its CRC-32 (4 bytes, little-endian), then the data. Batches are one
round trip (a pipeline, or MGET). With ttl_s > 0 a page expires ttl_s after its last write. Every socket operation is
bounded by timeout_s and nothing is retried, so a call fails within about timeout_s; errors become StorageError, and
the next call after the server is back reconnects by itself (the client's pool opens a fresh connection).
Capacity and eviction are the server's own (maxmemory, maxmemory-policy); stats() reports them.
"""

from __future__ import annotations

import contextlib
import threading
from urllib.parse import urlsplit, urlunsplit

import redis as redis_lib
from redis.backoff import NoBackoff
from redis.retry import Retry

from radixmesh.engine.cache.storage import StorageError, StorageOptions, StoredPage, intact
from radixmesh.engine.cache.storage_backends.base import (KEY_PREFIX, VALUE_HEADER, Counters, check_keys, leading_hits,
                                                          pack, split_intact, unpack)

SCAN_BATCH = 1000


def _redact(url: str) -> str:
    """The url without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class RedisStorage:
    """Thread-safe: redis-py's connection pool hands each calling thread its own connection."""

    def __init__(self, url: str, timeout_s: float = 2.0, ttl_s: float = 0.0):
        self.url = _redact(url)
        self.ttl_ms = int(ttl_s * 1000) if ttl_s > 0 else None
        self._counters = Counters()
        self._lock = threading.Lock()  # guards the counters
        try:
            self._client = redis_lib.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
                health_check_interval=0)
        except ValueError as e:
            raise StorageError(f"redis storage: bad url {self.url!r}: {e}") from e
        with self._errors("connect"):
            self._client.ping()

    @contextlib.contextmanager
    def _errors(self, what: str):
        try:
            yield
        except redis_lib.RedisError as e:
            raise StorageError(f"redis at {self.url}: {what} failed: {type(e).__name__}: {e}") from e

    def exists(self, keys: list[bytes]) -> int:
        check_keys(keys)
        if not keys:
            return 0
        with self._errors("exists"):
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(KEY_PREFIX + key)
            found = pipe.execute()
        return leading_hits(found)

    def get(self, keys: list[bytes]) -> list[StoredPage]:
        """Deletes a damaged page and stops there."""
        check_keys(keys)
        if not keys:
            return []
        with self._errors("get"):
            values = self._client.mget([KEY_PREFIX + k for k in keys])
        out, corrupt = [], None
        for key, value in zip(keys, values):
            page = unpack(key, value)
            if page is None and value is None:
                break
            if page is None or not intact(page):
                corrupt = key
                break
            out.append(page)
        if corrupt is not None:
            with self._errors("delete a corrupt page"):
                self._client.delete(KEY_PREFIX + corrupt)
        with self._lock:
            self._counters.count_get(len(keys), len(out))
            self._counters.corrupt_pages += corrupt is not None
        return out

    def set(self, pages: list[StoredPage]) -> int:
        check_keys(p.key for p in pages)
        good, rejected = split_intact(pages)
        if good:
            with self._errors("set"):
                pipe = self._client.pipeline(transaction=False)
                for page in good:
                    pipe.set(KEY_PREFIX + page.key, pack(page), px=self.ttl_ms)
                pipe.execute()
        with self._lock:
            self._counters.sets += len(good)
            self._counters.rejected += rejected
        return len(good)

    def _scan(self):
        """Batches of this backend's keys (SCAN: O(keys in the database), for admin calls only)."""
        batch = []
        for key in self._client.scan_iter(match=KEY_PREFIX + b"*", count=SCAN_BATCH):
            batch.append(key)
            if len(batch) >= SCAN_BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    def clear(self) -> int:
        n = 0
        with self._errors("clear"):
            for batch in self._scan():
                n += self._client.unlink(*batch)
        return n

    def stats(self) -> dict:
        """Pages and their bytes by a SCAN of the keys (O(pages)); capacity and evictions from the server's INFO."""
        pages = data_bytes = 0
        with self._errors("stats"):
            for batch in self._scan():
                pipe = self._client.pipeline(transaction=False)
                for key in batch:
                    pipe.strlen(key)
                sizes = pipe.execute()
                pages += sum(1 for s in sizes if s)
                data_bytes += sum(max(s - VALUE_HEADER.size, 0) for s in sizes if s)
            info = self._client.info()
        with self._lock:
            counters = self._counters.as_dict()
        counters["evictions"] = int(info.get("evicted_keys", 0))
        return {"backend": "redis", "pages": pages, "bytes": data_bytes,
                "capacity_bytes": int(info.get("maxmemory", 0)), "url": self.url, **counters}

    def close(self) -> None:
        self._client.close()


def open_redis(options: StorageOptions) -> RedisStorage:
    if not options.url:
        raise StorageError("the redis storage backend needs a url (--storage-url redis://host:port/0)")
    return RedisStorage(options.url, options.timeout_s, options.ttl_s)
