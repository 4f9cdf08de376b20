"""`mooncake`: pages in a Mooncake store (`mooncake.store.MooncakeDistributedStore`), the distributed memory pool
of a Mooncake master. This process joins the pool as a client and contributes capacity_bytes of its own memory
(its global segment); pages may live in any client's segment, and the master evicts when the pool fills.

options.url: `mooncake://MASTER_HOST:RPC_PORT[?param=value&...]` (or plain `HOST:PORT`), params:
  metadata_server   transfer metadata (default P2PHANDSHAKE: none needed; or etcd/http addresses)
  protocol          tcp (default) or rdma;  device: RDMA device names
  local_hostname    the address other clients reach this one at (default: the one that routes to the master)
  local_buffer_bytes  registered buffer every transfer passes through (default 64 MiB; bounds a page's size)
  metrics_port      the master's metrics port: stats() then reports the pool's keys, bytes and evictions

A page is the object `rmkv:<key hex>`: its CRC-32 (4 bytes, little-endian), then the data. ttl_s is not supported
(the master's eviction bounds the pool). Every call runs on one thread of this backend and the caller waits at most
timeout_s; a master that does not answer becomes StorageError, and the client reconnects by itself once it is back.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import urllib.request
from urllib.parse import parse_qs, urlsplit

from radixmesh.engine.cache.storage import StorageError, StorageOptions, StoredPage, intact
from radixmesh.engine.cache.storage_backends.base import (KEY_PREFIX, VALUE_HEADER, Counters, check_keys, leading_hits,
                                                          pack, split_intact, unpack)

DEFAULT_LOCAL_BUFFER_BYTES = 64 << 20
SETUP_TIMEOUT_S = 30.0  # joining the pool: the master answers in well under a second when it is up
# Return codes of the Mooncake client (mooncake-store/include/types.h, ErrorCode).
ERRORS = {-200: "NO_AVAILABLE_HANDLE (the pool is full)", -600: "INVALID_PARAMS", -703: "REPLICA_IS_NOT_READY",
          -704: "OBJECT_NOT_FOUND", -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED", -900: "RPC_FAIL",
          -901: "RPC_TIMEOUT"}
UNREACHABLE = (-900, -901)  # the master did not answer


def _name(key: bytes) -> str:
    return KEY_PREFIX.decode() + key.hex()


def _error(code: int) -> str:
    return f"{code} {ERRORS.get(code, 'error')}"


class MooncakeUrl:
    """The parsed options.url."""

    def __init__(self, url: str):
        parts = urlsplit(url if "://" in url else f"mooncake://{url}")
        if parts.scheme != "mooncake" or not parts.hostname or not parts.port:
            raise StorageError(f"mooncake storage: the url must be mooncake://MASTER_HOST:PORT[?params], got {url!r}")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        known = {"metadata_server", "protocol", "device", "local_hostname", "local_buffer_bytes", "metrics_port"}
        unknown = sorted(set(query) - known)
        if unknown:
            raise StorageError(f"mooncake storage: unknown url parameter(s) {', '.join(unknown)}; "
                               f"known: {', '.join(sorted(known))}")
        self.host, self.port = parts.hostname, parts.port
        self.master = f"{self.host}:{self.port}"
        self.metadata_server = query.get("metadata_server", "P2PHANDSHAKE")
        self.protocol = query.get("protocol", "tcp")
        self.device = query.get("device", "")
        self.local_hostname = query.get("local_hostname", "")
        self.local_buffer_bytes = int(query.get("local_buffer_bytes", DEFAULT_LOCAL_BUFFER_BYTES))
        self.metrics_port = int(query["metrics_port"]) if "metrics_port" in query else None


def _route_address(host: str, port: int) -> str:
    """This host's address on the route to host:port (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


class MooncakeStorage:
    """Thread-safe: every store call runs on this backend's single thread, which also keeps concurrent transfers
    from competing for the local buffer (a batch that does not fit it comes back partly empty)."""

    def __init__(self, url: str, capacity_bytes: int, timeout_s: float = 2.0):
        self.url = MooncakeUrl(url)
        self.capacity_bytes = capacity_bytes
        self.timeout_s = timeout_s
        self._counters = Counters()
        self._lock = threading.Lock()  # guards the counters
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mooncake-store")
        self._probe_master()
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise StorageError(f"mooncake storage: the Mooncake package is not installed "
                               f"(pip install mooncake-transfer-engine-non-cuda): {e}") from e
        self._store = MooncakeDistributedStore()
        local = self.url.local_hostname or _route_address(self.url.host, self.url.port)
        rc = self._call(self._store.setup, local, self.url.metadata_server, capacity_bytes,
                        self.url.local_buffer_bytes, self.url.protocol, self.url.device, self.url.master,
                        timeout_s=max(timeout_s, SETUP_TIMEOUT_S), what="setup")
        if rc != 0:
            raise StorageError(f"mooncake storage: joining the pool of master {self.url.master} failed (setup "
                               f"returned {rc}; metadata server {self.url.metadata_server!r})")

    def _probe_master(self) -> None:
        """Fail fast: the client's own setup retries an absent master for 90 s."""
        try:
            socket.create_connection((self.url.host, self.url.port), timeout=self.timeout_s).close()
        except OSError as e:
            raise StorageError(f"mooncake storage: cannot reach the Mooncake master at {self.url.master}: {e}") from e

    def _call(self, fn, *args, timeout_s: float | None = None, what: str = "call"):
        future = self._thread.submit(fn, *args)
        try:
            return future.result(timeout=timeout_s or self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise StorageError(f"mooncake storage: {what} did not finish within {timeout_s or self.timeout_s:.1f} s "
                               f"(master {self.url.master})") from None

    def _exists(self, names: list[str]) -> list[int]:
        found = self._call(self._store.batch_is_exist, names, what="exists")
        bad = [c for c in found if c < 0]
        if bad:
            raise StorageError(f"mooncake storage: exists failed: {_error(bad[0])} (master {self.url.master})")
        return found

    def exists(self, keys: list[bytes]) -> int:
        check_keys(keys)
        if not keys:
            return 0
        return leading_hits(self._exists([_name(k) for k in keys]))

    def get(self, keys: list[bytes]) -> list[StoredPage]:
        """Deletes a damaged page and stops there. A batch larger than the local buffer comes back in rounds."""
        check_keys(keys)
        out: list[StoredPage] = []
        corrupt = False
        while len(out) < len(keys) and not corrupt:
            rest = keys[len(out):]
            values = self._call(self._store.get_batch, [_name(k) for k in rest], what="get")
            got = 0
            for key, value in zip(rest, values):
                if not value:
                    break
                page = unpack(key, value)
                if page is None or not intact(page):
                    self._call(self._store.batch_remove, [_name(key)], True, what="remove a corrupt page")
                    corrupt = True
                    break
                out.append(page)
                got += 1
            if got == 0 and not corrupt:
                self._exists([_name(rest[0])])  # raises if the master is unreachable; else a miss
                break
        with self._lock:
            self._counters.count_get(len(keys), len(out))
            self._counters.corrupt_pages += corrupt
        return out

    def set(self, pages: list[StoredPage]) -> int:
        """Upserts intact pages in batches that fit the local buffer; a full pool stores fewer (no error)."""
        check_keys(p.key for p in pages)
        good, rejected = split_intact(pages)
        stored = 0
        for batch in self._batches(good):
            if not batch:
                rejected += 1  # a page larger than the local buffer cannot be transferred
                continue
            rc = self._call(self._store.upsert_batch, [_name(p.key) for p in batch], [pack(p) for p in batch],
                            what="set")
            if rc in UNREACHABLE:
                raise StorageError(f"mooncake storage: set failed: {_error(rc)} (master {self.url.master})")
            if rc == 0:
                stored += len(batch)
        with self._lock:
            self._counters.sets += stored
            self._counters.rejected += rejected
        return stored

    def _batches(self, pages: list[StoredPage]):
        """Runs of pages whose stored values fit the local buffer together; [] for a page that never fits."""
        limit, batch, size = self.url.local_buffer_bytes, [], 0
        for page in pages:
            need = len(page.data) + VALUE_HEADER.size
            if need > limit:
                yield []
                continue
            if batch and size + need > limit:
                yield batch
                batch, size = [], 0
            batch.append(page)
            size += need
        if batch:
            yield batch

    def clear(self) -> int:
        n = self._call(self._store.remove_by_regex, "^" + KEY_PREFIX.decode(), True, what="clear")
        if n < 0:
            raise StorageError(f"mooncake storage: clear failed: {_error(n)} (master {self.url.master})")
        return n

    def stats(self) -> dict:
        """With metrics_port in the url: the pool's keys, bytes, capacity and evictions (every client's)."""
        with self._lock:
            out = {"backend": "mooncake", "pages": 0, "bytes": 0, "capacity_bytes": self.capacity_bytes,
                   "master": self.url.master, **self._counters.as_dict()}
        if self.url.metrics_port is not None:
            metrics = self._master_metrics()
            pages = int(metrics.get("master_key_count", 0))
            allocated = int(metrics.get("master_allocated_bytes", 0))  # values: a checksum header, then the data
            out.update(pages=pages, bytes=max(allocated - pages * VALUE_HEADER.size, 0),
                       capacity_bytes=int(metrics.get("master_total_capacity_bytes", 0)),
                       evictions=int(metrics.get("master_evicted_key_count", 0)))
        return out

    def _master_metrics(self) -> dict[str, float]:
        where = f"http://{self.url.host}:{self.url.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(where, timeout=self.timeout_s) as resp:
                text = resp.read().decode()
        except OSError as e:
            raise StorageError(f"mooncake storage: cannot read the master's metrics at {where}: {e}") from e
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if line and not line.startswith("#") and "{" not in name:
                try:
                    out[name] = float(value)
                except ValueError:
                    continue
        return out

    def close(self) -> None:
        """Leaves the pool (its pages in this process's segment go with it). close() holds the GIL, for ~2 s with
        a live master and ~7 s without one; with the master gone, dropping the client (~1 s) is the shorter way."""
        store, self._store = self._store, None
        if store is None:
            return
        try:
            self._probe_master()
            self._call(store.close, timeout_s=SETUP_TIMEOUT_S, what="close")
        except StorageError:
            pass
        finally:
            del store
            self._thread.shutdown(wait=False)


def open_mooncake(options: StorageOptions) -> MooncakeStorage:
    if not options.url:
        raise StorageError("the mooncake storage backend needs the master's address "
                           "(--storage-url mooncake://HOST:PORT)")
    if options.capacity_bytes <= 0:
        raise StorageError("the mooncake storage backend needs capacity_bytes > 0 (the memory this process adds "
                           "to the pool)")
    return MooncakeStorage(options.url, options.capacity_bytes, options.timeout_s)
