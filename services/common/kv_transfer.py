"""What both sides of a prefill/decode pair share: the transfer backend over the engine's KV pool, a thread that
runs its blocking writes, the measured transfer rate for GetLoads, and the room-state log lines."""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor

from engine.disaggregation.fake_backend import Faults
from engine.disaggregation.kv_pages import KvLayout, layout_of, register_pool
from engine.disaggregation.registry import make_backend
from engine.disaggregation.transfer import Write

log = logging.getLogger("radixmesh.pd")

RATE_WINDOW = 64  # transfers averaged for kv_transfer_gbps / kv_transfer_latency_ms


def transfer_host(configured: str | None, listen_host: str) -> str:
    """The address peers reach this worker's transfer engine at: the configured one, else the gRPC listen address
    unless that is a wildcard, else this host's name resolved."""
    if configured:
        return configured
    if listen_host not in ("0.0.0.0", "::", ""):
        return listen_host
    return socket.gethostbyname(socket.gethostname())


def room_log(room: int, rid: str, state: str, detail: str = "", level: int = logging.INFO) -> None:
    """One line per room state change; failures at WARNING, so they show at the default log level."""
    log.log(level, "room %016x request %s: %s%s", room, rid, state, f" ({detail})" if detail else "")


class KvTransfer:
    def __init__(self, engine, backend_name: str, host: str, faults: str | None = None):
        self.backend = make_backend(backend_name, host, Faults.parse(faults) if faults else None)
        self.pool = engine.runner.kv_pool
        register_pool(self.backend, self.pool)
        self.layout: KvLayout = layout_of(self.pool)
        self._writer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="radixmesh-kv-write")
        self._recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=RATE_WINDOW)

    @property
    def session_id(self) -> str:
        return self.backend.session_id

    def write(self, peer: str, writes: list[Write]) -> asyncio.Future:
        """Start the writes on the writer thread; the future completes when every byte landed (or raises
        TransferError). A blocking write cannot be interrupted: callers that stop waiting must keep its pages
        pinned until this future is done."""
        started = time.perf_counter()
        nbytes = sum(w.length for w in writes)

        def run() -> None:
            self.backend.write(peer, writes)
            self.record(nbytes, time.perf_counter() - started)
        return asyncio.get_running_loop().run_in_executor(self._writer, run)

    def record(self, nbytes: int, seconds: float) -> None:
        self._recent.append((nbytes, seconds))

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
