"""L3 traffic of one worker, on its own thread: page write-backs from the host pool and prefetches into it.

The scheduler thread submits jobs and drains completions (`poll`); the storage thread only reads host pages it was
given (they stay referenced until their completion is drained) and writes host pages allocated for a fetch. After a
failure the store is skipped for `retry_after_s` (fetches complete empty, writes are dropped), so a store that is
down makes requests recompute instead of waiting on timeouts; then it is tried again. The store is opened on the
storage thread too, and reopened the same way, so a worker starts even while its store is unreachable.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from typing import Callable

from radixmesh.engine.cache.host_pool import HostKVPool
from radixmesh.engine.cache.storage import PageStorage, StorageError, StoredPage, checksum, intact, is_direct

log = logging.getLogger(__name__)


class JobKind(enum.Enum):
    WRITE = "write"
    FETCH = "fetch"


@dataclass(slots=True)
class StorageJob:
    kind: JobKind
    token: object  # the submitter's handle, returned with the completion
    keys: list[bytes]
    host_pages: list[int]
    data: list[bytes] | None = None  # WRITE: the pages' bytes, when taken before their host pages were freed
    loaded: int = 0  # FETCH: pages written into host_pages[:loaded]
    corrupt: int = 0
    error: str | None = None
    seconds: float = 0.0
    submitted: float = field(default_factory=time.monotonic)


class StorageIO:
    def __init__(self, open_storage: Callable[[], PageStorage], host: HostKVPool, retry_after_s: float = 5.0):
        self._open, self.host = open_storage, host
        self.storage: PageStorage | None = None
        self.retry_after_s = retry_after_s
        # Fetches have their own thread and queue: a request waiting for its prefetch never waits behind
        # write-backs, which can be many and large.
        self._queues = {kind: queue.SimpleQueue() for kind in JobKind}
        self._done: queue.SimpleQueue[StorageJob] = queue.SimpleQueue()
        self._open_lock = threading.Lock()
        self._down_until = 0.0
        self.pending = 0
        self.write_backlog_pages = 0  # pages submitted for writing and not completed (scheduler thread's count)
        self.fetch_tokens_per_s = 0.0  # measured, EMA over fetches that loaded pages
        self.stats = {"written_pages": 0, "fetched_pages": 0, "failed_calls": 0, "corrupt_pages": 0,
                      "skipped_write_pages": 0, "skipped_fetches": 0}
        self._threads = [threading.Thread(target=self._run, args=(q,), name=f"radixmesh-storage-{kind.value}",
                                          daemon=True) for kind, q in self._queues.items()]
        for t in self._threads:
            t.start()

    def submit(self, job: StorageJob) -> None:
        self.pending += 1
        if job.kind is JobKind.WRITE:
            self.write_backlog_pages += len(job.keys)
        self._queues[job.kind].put(job)

    def poll(self) -> list[StorageJob]:
        """Completed jobs since the last call (scheduler thread)."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.pending -= len(out)
        self.write_backlog_pages -= sum(len(j.keys) for j in out if j.kind is JobKind.WRITE)
        return out

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until every submitted job completed (their completions stay queued for poll)."""
        deadline = time.monotonic() + timeout_s
        while self._done.qsize() < self.pending and time.monotonic() < deadline:
            time.sleep(0.005)
        return self._done.qsize() >= self.pending

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout=10)
        if self.storage is not None:
            self.storage.close()

    # ---- storage thread ---------------------------------------------------------------------------------------
    def _run(self, jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            start = time.perf_counter()
            try:
                if time.monotonic() < self._down_until:
                    job.error = "store unavailable (retrying later)"
                elif self.storage is None and not self._connect(job):
                    pass
                elif job.kind is JobKind.WRITE:
                    self._write(job)
                else:
                    self._fetch(job)
            except StorageError as e:
                self._failed(job, str(e))
            except Exception as e:  # a backend bug must not kill the thread: the job just fails
                log.exception("storage %s job failed", job.kind.value)
                self._failed(job, repr(e))
            job.seconds = time.perf_counter() - start
            self._done.put(job)

    def _connect(self, job: StorageJob) -> bool:
        with self._open_lock:
            if self.storage is not None:
                return True
            try:
                storage = self._open()
                if is_direct(storage):  # page bytes move straight between the store and the host pool
                    data = self.host.group
                    storage.register_host(data.data_ptr(), data.numel() * data.element_size())
                self.storage = storage
                log.info("L3 store open%s", " (page bytes straight from and into the host pool)"
                         if is_direct(storage) else "")
                return True
            except StorageError as e:
                self._failed(job, f"cannot open: {e}")
                return False

    def _failed(self, job: StorageJob, reason: str) -> None:
        job.error = reason
        self.stats["failed_calls"] += 1
        self._down_until = time.monotonic() + self.retry_after_s
        log.warning("L3 store %s failed (%s); recomputing instead, retrying the store in %.0f s", job.kind.value,
                    reason, self.retry_after_s)

    def _write(self, job: StorageJob) -> None:
        if job.data is None and is_direct(self.storage):
            views = [self.host.page_view(p) for p in job.host_pages]
            self.storage.set_from(job.keys, [checksum(v) for v in views],
                                  [self.host.page_address(p) for p in job.host_pages], self.host.page_bytes)
            self.stats["written_pages"] += len(job.keys)
            return
        pages = []
        for i, (key, page) in enumerate(zip(job.keys, job.host_pages)):
            data = job.data[i] if job.data is not None else self.host.read_page(page)
            pages.append(StoredPage(key, data, checksum(data)))
        self.storage.set(pages)
        self.stats["written_pages"] += len(pages)

    def _fetch(self, job: StorageJob) -> None:
        start = time.perf_counter()
        if is_direct(self.storage):
            self._fetch_direct(job)
        else:
            pages = self.storage.get(job.keys)
            for page, key, host_page in zip(pages, job.keys, job.host_pages):
                if page.key != key or not intact(page) or len(page.data) != self.host.page_bytes:
                    self._corrupt(job, key)
                    break
                self.host.write_page(host_page, page.data)
                job.loaded += 1
        self.stats["fetched_pages"] += job.loaded
        if job.loaded:
            rate = job.loaded * self.host.page_size / max(time.perf_counter() - start, 1e-6)
            self.fetch_tokens_per_s = rate if not self.fetch_tokens_per_s else \
                0.8 * self.fetch_tokens_per_s + 0.2 * rate

    def _fetch_direct(self, job: StorageJob) -> None:
        """The store writes the pages into the job's host pages; each is checked against the checksum it came with."""
        addresses = [self.host.page_address(p) for p in job.host_pages]
        checksums = self.storage.get_into(job.keys, addresses, self.host.page_bytes)
        for key, host_page, crc in zip(job.keys, job.host_pages, checksums):
            if checksum(self.host.page_view(host_page)) != crc:
                self._corrupt(job, key)
                break
            job.loaded += 1

    def _corrupt(self, job: StorageJob, key: bytes) -> None:
        job.corrupt += 1
        self.stats["corrupt_pages"] += 1
        log.warning("L3 page %s failed its checksum or size; recomputing it", key.hex())
