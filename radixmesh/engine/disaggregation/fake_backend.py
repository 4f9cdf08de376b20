"""An in-process transfer backend for tests, and the fault injector every backend can be wrapped in.

FakeBackend: peers live in the same process (a class-level table of session ids) and writes are memmoves between
registered ranges.

FaultInjector: wraps any backend (the fake always; Mooncake with --disaggregation-inject-fault) and injects the
failures the real path must survive: dropped writes (an error, nothing copied), delays, and silent corruption (the
writes succeed, then one byte of the destination is overwritten with its complement, through the backend itself, so
it works across processes too)."""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from dataclasses import dataclass
from typing import ClassVar, Sequence

from radixmesh.engine.disaggregation.transfer import TransferBackend, TransferError, Write


@dataclass(slots=True)
class Faults:
    drop: bool = False  # fail the next writes with TransferError, copying nothing
    delay_s: float = 0.0  # sleep before each write batch
    corrupt: bool = False  # flip one byte of the first range after copying

    @classmethod
    def parse(cls, spec: str | None) -> "Faults":
        """'drop', 'corrupt', 'delay:SECONDS', or several joined by commas."""
        out = cls()
        for part in filter(None, (spec or "").split(",")):
            name, _, value = part.strip().partition(":")
            if name == "drop":
                out.drop = True
            elif name == "corrupt":
                out.corrupt = True
            elif name == "delay" and value:
                out.delay_s = float(value)
            else:
                raise ValueError(f"unknown fault {part!r}: use drop, corrupt or delay:SECONDS")
        return out


class FakeBackend:
    _peers: ClassVar[dict[str, "FakeBackend"]] = {}
    _ports = itertools.count(50000)
    _table_lock = threading.Lock()

    def __init__(self, host: str = "127.0.0.1"):
        with self._table_lock:
            self.session_id = f"{host}:{next(self._ports)}"
            self._peers[self.session_id] = self
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
        for w in writes:
            self._check(w.src, w.length, "source")
            target._check(w.dst, w.length, "destination")
        for w in writes:
            ctypes.memmove(w.dst, w.src, w.length)
        self.writes_done += len(writes)

    def close(self) -> None:
        with self._table_lock:
            self._peers.pop(self.session_id, None)


class FaultInjector:
    """A backend that misbehaves on purpose; everything else is the wrapped backend's."""

    def __init__(self, inner: TransferBackend, faults: Faults | None = None):
        self.inner = inner
        self.faults = faults or Faults()
        self._scratch = ctypes.create_string_buffer(8)  # the complemented byte is written from here
        inner.register(ctypes.addressof(self._scratch), len(self._scratch))

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def write(self, peer: str, writes: Sequence[Write]) -> None:
        if self.faults.delay_s:
            time.sleep(self.faults.delay_s)
        if self.faults.drop:
            raise TransferError(f"injected drop of {len(writes)} writes to {peer}")
        self.inner.write(peer, writes)
        if self.faults.corrupt and writes:
            self._scratch[0] = ctypes.c_uint8.from_address(writes[0].src).value ^ 0xFF
            self.inner.write(peer, [Write(ctypes.addressof(self._scratch), writes[0].dst, 1)])
