"""Page bytes over the Mooncake transfer engine instead of inside gRPC messages.

Both ends register memory with their own engine (`engine.disaggregation.mooncake_backend`, TCP with the
peer-to-peer handshake) and the gRPC calls carry only keys, checksums, lengths and addresses. The rule that keeps
this safe: only the owner of memory writes into it, and always from inside its own synchronous call.
- BatchSet: the store reads the pages from the caller's memory into a slot of its own, checks each page's checksum
  (so a page that changed under a late read is refused, never stored) and keeps the bytes.
- BatchGet: the store copies the pages into a slot of its own and leases the slot to the caller, who reads them
  into its memory, checks the checksums and calls ReleaseStaged. A lease that is never released expires; a read
  after expiry sees reused bytes and fails the checksum.

`StagingSlots` is the store's side: registered memory cut into slots of SLOT_BYTES, leased per call.
`PageTransport` is a caller's side: its engine, a registered staging buffer for pages that arrive or leave as
Python bytes, and the registered host pool for pages that move straight from and into it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Sequence

import numpy as np

from radixmesh.engine.cache.storage import StorageError, StoredPage
from radixmesh.engine.disaggregation.transfer import TransferError, Write

log = logging.getLogger(__name__)

# One call moves at most this many bytes of pages: the store's slot size and the callers' request bound.
SLOT_BYTES = 64 << 20


def _engine(host: str):
    from radixmesh.engine.disaggregation.mooncake_backend import MooncakeBackend

    return MooncakeBackend(host)


def reads(remote: Sequence[int], local: Sequence[int], length: int) -> list[Write]:
    """The ranges that copy page i from remote[i] to local[i], merged where both sides run back to back."""
    out: list[Write] = []
    for r, l in zip(remote, local):
        if out and out[-1].src + out[-1].length == r and out[-1].dst + out[-1].length == l:
            out[-1] = Write(out[-1].src, out[-1].dst, out[-1].length + length)
        else:
            out.append(Write(r, l, length))
    return out


class StagingSlots:
    """The store's engine and registered memory: `num_slots` slots of SLOT_BYTES; a slot is taken for one BatchSet
    or leased to one BatchGet's caller until ReleaseStaged (or `lease_s`)."""

    def __init__(self, host: str, buffer_bytes: int, lease_s: float = 10.0):
        if buffer_bytes < SLOT_BYTES:
            raise ValueError(f"the transfer buffer must hold at least one slot of {SLOT_BYTES} bytes, "
                             f"got {buffer_bytes}")
        self.engine = _engine(host)
        self.num_slots = buffer_bytes // SLOT_BYTES
        self.buffer = np.zeros(self.num_slots * SLOT_BYTES, dtype=np.uint8)
        self.base = self.buffer.ctypes.data
        self.engine.register(self.base, self.buffer.nbytes)
        self.lease_s = lease_s
        self._free = list(range(self.num_slots))
        self._leases: dict[int, tuple[int, float]] = {}  # lease id -> (slot, expiry)
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self.stats = {"transfer_bytes_in": 0, "transfer_bytes_out": 0, "expired_leases": 0}
        log.info("page transfer engine on %s: %d slots of %d MiB", self.session_id, self.num_slots, SLOT_BYTES >> 20)

    @property
    def session_id(self) -> str:
        return self.engine.session_id

    def _expire(self, now: float) -> None:
        for lease, (slot, expiry) in list(self._leases.items()):
            if expiry <= now:
                del self._leases[lease]
                self._free.append(slot)
                self.stats["expired_leases"] += 1
                log.warning("staging lease %d expired unreleased after %.0f s", lease, self.lease_s)

    def take(self, timeout_s: float) -> int:
        """A free slot (its index); raises StorageError when none frees up within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                now = time.monotonic()
                self._expire(now)
                if self._free:
                    return self._free.pop()
                if now >= deadline:
                    raise StorageError(f"no free transfer slot within {timeout_s:.1f} s "
                                       f"({self.num_slots} slots, all in use)")
                # leases expire without anyone notifying: wake up for the next expiry at the latest
                next_expiry = min((e for _, e in self._leases.values()), default=deadline)
                self._cond.wait(max(min(deadline, next_expiry) - now, 0.001))

    def give_back(self, slot: int) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def lease(self, slot: int) -> int:
        with self._cond:
            lease = next(self._ids)
            self._leases[lease] = (slot, time.monotonic() + self.lease_s)
            return lease

    def release(self, lease: int) -> bool:
        with self._cond:
            held = self._leases.pop(lease, None)
            if held is None:
                return False
            self._free.append(held[0])
            self._cond.notify()
            return True

    def address(self, slot: int) -> int:
        return self.base + slot * SLOT_BYTES

    def stage(self, slot: int, pages: Sequence[StoredPage]) -> list[int]:
        """Copy the pages' bytes back to back into the slot; returns their addresses."""
        view = self.buffer[slot * SLOT_BYTES:(slot + 1) * SLOT_BYTES]
        addresses, at = [], 0
        for page in pages:
            n = len(page.data)
            view[at:at + n] = np.frombuffer(page.data, dtype=np.uint8)
            addresses.append(self.address(slot) + at)
            at += n
        self.stats["transfer_bytes_out"] += at
        return addresses

    def fetch(self, slot: int, peer: str, addresses: Sequence[int], lengths: Sequence[int]) -> list[bytes]:
        """Read each range of the peer's memory into the slot (back to back); returns the bytes of each."""
        total = sum(lengths)
        if total > SLOT_BYTES:
            raise ValueError(f"{total} bytes of pages in one call; at most {SLOT_BYTES}")
        local, at = [], self.address(slot)
        for n in lengths:
            local.append(at)
            at += n
        ranges = [Write(r, l, n) for r, l, n in zip(addresses, local, lengths)]
        try:
            self.engine.read(peer, ranges)
        except TransferError as e:
            raise StorageError(str(e)) from e
        self.stats["transfer_bytes_in"] += total
        start = slot * SLOT_BYTES
        out, at = [], start
        for n in lengths:
            out.append(self.buffer[at:at + n].tobytes())
            at += n
        return out

    def close(self) -> None:
        self.engine.close()


def route_host(target: str) -> str:
    """The local address that routes to `target` ("host:port"): where a peer there reaches this process."""
    import socket

    host, _, port = target.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), int(port or 1)))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class PageTransport:
    """A caller's engine: a staging buffer of SLOT_BYTES for pages given or returned as bytes, and, once
    `register_host` ran, the host pool's memory for pages that move straight from and into it. Calls that use the
    staging buffer hold its lock, so the write and fetch threads can share one transport."""

    def __init__(self, host: str):
        self.engine = _engine(host)
        self.staging = np.zeros(SLOT_BYTES, dtype=np.uint8)
        self.staging_base = self.staging.ctypes.data
        self.engine.register(self.staging_base, self.staging.nbytes)
        self.staging_lock = threading.Lock()

    @property
    def session_id(self) -> str:
        return self.engine.session_id

    def register_host(self, ptr: int, nbytes: int) -> None:
        self.engine.register(ptr, nbytes)

    def put_staging(self, pages: Sequence[StoredPage]) -> list[int]:
        """Copy the pages back to back into the staging buffer (hold staging_lock); returns their addresses."""
        addresses, at = [], 0
        for page in pages:
            n = len(page.data)
            self.staging[at:at + n] = np.frombuffer(page.data, dtype=np.uint8)
            addresses.append(self.staging_base + at)
            at += n
        return addresses

    def read(self, peer: str, remote: Sequence[int], local: Sequence[int], length: int) -> None:
        try:
            self.engine.read(peer, reads(remote, local, length))
        except TransferError as e:
            raise StorageError(str(e)) from e

    def staged_bytes(self, address: int, length: int) -> bytes:
        at = address - self.staging_base
        return self.staging[at:at + length].tobytes()

    def close(self) -> None:
        self.engine.close()
