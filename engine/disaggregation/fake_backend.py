"""An in-process transfer backend for tests: peers live in the same process (a class-level table of session ids)
and writes are memmoves between registered ranges. It can inject the failures the real path must survive:
dropped writes (an error, nothing copied), delays, and silent corruption (the copy succeeds with a byte flipped)."""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from dataclasses import dataclass
from typing import ClassVar, Sequence

from engine.disaggregation.transfer import TransferError, Write


@dataclass(slots=True)
class Faults:
    drop: bool = False  # fail the next writes with TransferError, copying nothing
    delay_s: float = 0.0  # sleep before each write batch
    corrupt: bool = False  # flip one byte of the first range after copying


class FakeBackend:
    _peers: ClassVar[dict[str, "FakeBackend"]] = {}
    _ports = itertools.count(50000)
    _table_lock = threading.Lock()

    def __init__(self, host: str = "127.0.0.1", faults: Faults | None = None):
        with self._table_lock:
            self.session_id = f"{host}:{next(self._ports)}"
            self._peers[self.session_id] = self
        self.faults = faults or Faults()
        self.regions: dict[int, int] = {}
        self.writes_done = 0

    def register(self, ptr: int, nbytes: int) -> None:
        self.regions[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        self.regions.pop(ptr, None)

    def _check(self, addr: int, length: int, who: str) -> None:
        if not any(base <= addr and addr + length <= base + size for base, size in self.regions.items()):
            raise TransferError(f"{who} range [{addr:#x}, +{length}) is not registered memory")

    def write(self, peer: str, writes: Sequence[Write]) -> None:
        target = self._peers.get(peer)
        if target is None:
            raise TransferError(f"no peer {peer}")
        if self.faults.delay_s:
            time.sleep(self.faults.delay_s)
        if self.faults.drop:
            raise TransferError(f"injected drop of {len(writes)} writes to {peer}")
        for w in writes:
            self._check(w.src, w.length, "source")
            target._check(w.dst, w.length, "destination")
        for w in writes:
            ctypes.memmove(w.dst, w.src, w.length)
        if self.faults.corrupt and writes:
            byte = ctypes.c_uint8.from_address(writes[0].dst)
            byte.value ^= 0xFF
        self.writes_done += len(writes)

    def close(self) -> None:
        with self._table_lock:
            self._peers.pop(self.session_id, None)
