"""What both sides of a prefill/decode pair share: the transfer backend over the engine's KV pool, a thread that
runs its blocking writes, the measured transfer rate for GetLoads, and the room-state log lines.

Pages move between the engines' mirrors (engine.disaggregation.mirror): a pool on the GPU is staged through pinned
host memory (a CPU build of Mooncake cannot register device memory), and under tensor parallelism the mirror holds
every rank's shard, so each prefill rank's shard lands in the matching decode rank's. The sender copies the pages it
sends into free pages of its mirror, the backend moves them to free pages of the peer's mirror (its "landing"
pages), and the receiver copies them from there into the pool's pages before the request decodes: a request's pool
pages may be scattered, its mirror pages are one run where there is one, so a transfer is one write per buffer. With
the shm backend (one host) the sender has no mirror: its GPU copies the pages straight into the receiver's."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from radixmesh.engine.disaggregation.fake_backend import Faults
from radixmesh.engine.disaggregation.kv_pages import KvLayout, check_layouts, kv_format, kv_writes
from radixmesh.engine.disaggregation.registry import make_backend

log = logging.getLogger("radixmesh.pd")

RATE_WINDOW = 64  # transfers averaged for kv_transfer_gbps / kv_transfer_latency_ms

# Why a room failed, as metrics label it (few values, so a dashboard can show each).
FAILURE_REASONS = ("bootstrap_timeout", "transfer_timeout", "peer_lost", "transfer_error", "checksum_mismatch",
                   "prefill_failed", "aborted", "cancelled")


class TransferObserver(Protocol):
    """Told of every completed KV transfer and every failed room (services.worker.metrics implements it). Called
    from the event loop or the writer threads: implementations must be thread-safe and quick."""

    def transferred(self, nbytes: int, seconds: float) -> None: ...

    def failed(self, reason: str) -> None: ...


def set_once(fut: asyncio.Future, value) -> None:
    """Resolve `fut` unless it already is (a callback from another thread may arrive after a cancel)."""
    if not fut.done():
        fut.set_result(value)


def room_log(room: int, rid: str, state: str, detail: str = "", level: int = logging.INFO) -> None:
    """One line per room state change; failures at WARNING, so they show at the default log level."""
    log.log(level, "room %016x request %s: %s%s", room, rid, state, f" ({detail})" if detail else "")


class KvTransfer:
    def __init__(self, engine, backend_name: str, host: str, faults: str | None = None, stage: bool | None = None,
                 receives: bool = True):
        """`receives`: peers write into this worker's mirror (a decode worker); with a backend whose peers map the
        receiver's memory (shm) only a receiver's mirror is made in shared memory."""
        self.backend = make_backend(backend_name, host, Faults.parse(faults) if faults else None)
        self.pool = engine.runner.kv_pool
        maps_peers = getattr(self.backend, "shared_mirror", False)
        # A sender whose backend copies tensors into its peers' memory (shm) sends from the pool itself, GPU or not:
        # no mirror of its own to stage through (under tensor parallelism the leader still gathers every rank's).
        self.direct = maps_peers and not receives
        self.mirror = engine.kv_mirror(False if self.direct else stage, shared=receives and maps_peers)
        for t in self.mirror.buffers:
            self.backend.register(t.data_ptr(), t.numel() * t.element_size())
        self.layout: KvLayout = KvLayout(tuple(t.data_ptr() for t in self.mirror.buffers), self.pool.page_bytes)
        self.kv_format = kv_format(self.pool)  # (what a peer's pages must mean too)
        self._writer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="radixmesh-kv-write")
        self._recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=RATE_WINDOW)
        self.observer: TransferObserver | None = None  # set when metrics are on

    @property
    def session_id(self) -> str:
        return self.backend.session_id

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks whose KV shards this transfer moves (a peer must have as many)."""
        return self.mirror.tp_size

    def hold(self, pages: list[int]) -> list[int]:
        """Mirror pages for the pool's `pages` to move through (a receiver's landing pages): lent until `release`."""
        return self.mirror.hold(pages)

    def release(self, slots: list[int]) -> None:
        self.mirror.release(slots)

    def stage_in(self, slots: list[int], pages: list[int]) -> None:
        """Copy the mirror's `slots` into the pool's `pages` (every rank's); returns once they are there."""
        self.mirror.stage_in(slots, pages)

    def checksum(self, slots: list[int]) -> str:
        """A digest of the mirror's `slots` (every rank's): the bytes a transfer moved."""
        return self.mirror.checksum(slots)

    def write(self, peer: str, dest: KvLayout, src_pages: list[int], dst_pages: list[int],
              verify: bool = False) -> asyncio.Future:
        """Start moving the pool's `src_pages` into the peer's `dst_pages` (pages of its mirror, in the layout
        `dest`) on the writer thread; the future completes when every byte landed, with the moved pages' checksum
        when `verify` (else ""), or raises TransferError. A blocking write cannot be interrupted: callers that
        stop waiting must keep the source pages pinned until this future is done. ValueError now when the layouts
        do not match."""
        check_layouts(self.layout, dest)
        started = time.perf_counter()
        nbytes = len(src_pages) * self.layout.page_bytes * len(self.layout.bases)
        return asyncio.get_running_loop().run_in_executor(
            self._writer, lambda: self._write(peer, dest, list(src_pages), list(dst_pages), verify, nbytes, started))

    def _write(self, peer: str, dest: KvLayout, src_pages: list[int], dst_pages: list[int], verify: bool,
               nbytes: int, started: float) -> str:
        if self.direct and not self.mirror.staged:  # the pool's pages straight into the peer's memory
            digest = self.mirror.checksum(src_pages) if verify else ""
            try:
                with self.mirror.copying():
                    self.backend.copy_in(peer, self.mirror.pieces(src_pages, dest, dst_pages))
            finally:  # (after a failure too: no copy may still read the source pages once this returns)
                self.mirror.synchronize()
        else:  # staged through free pages of the mirror, then written from there
            slots = self.mirror.hold(src_pages)
            try:
                self.mirror.stage_out(src_pages, slots)
                digest = self.mirror.checksum(slots) if verify else ""
                self.backend.write(peer, kv_writes(self.layout, dest, slots, dst_pages))
            finally:
                self.mirror.release(slots)
        self.record(nbytes, time.perf_counter() - started)
        return digest

    def record(self, nbytes: int, seconds: float) -> None:
        """A transfer completed: `nbytes` moved in `seconds` (sent, on a prefill worker; received, on a decode one)."""
        self._recent.append((nbytes, seconds))
        if self.observer is not None:
            self.observer.transferred(nbytes, seconds)

    def failed(self, reason: str) -> None:
        """A room failed; `reason` is one of FAILURE_REASONS."""
        if self.observer is not None:
            self.observer.failed(reason if reason in FAILURE_REASONS else "transfer_error")

    @property
    def gbps(self) -> float:
        total_s = sum(s for _, s in self._recent)
        return sum(b for b, _ in self._recent) / total_s / 1e9 if total_s else 0.0

    @property
    def latency_ms(self) -> float:
        return 1000 * sum(s for _, s in self._recent) / len(self._recent) if self._recent else 0.0

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self.backend.close()
        self.mirror.close()
