"""KV pages between the workers of one host through shared memory: the receiver's KV mirror lives in shared-memory
files, and the sender maps them and copies the pages in with memcpy, on a few threads: no network stack and no
transport engine between two processes of one machine. (On an H200 host, 2026-12-04, a 2k-token request's transfer
took ~0.6 s with this backend and with Mooncake's TCP alike: the staging copies around the transport were the
bottleneck then, and have changed since; benchmarks/results/NOTES.md.)

Peers can write only into memory backed by a shared-memory file (engine.shared_memory.shared_tensor; KvTransfer
asks the engine for such a mirror: `ShmBackend.shared_mirror`). Its session id is "shm:" and the path of an index file
listing, for each registered range, its address here and its file; a peer reads the index once, maps the files and
translates the addresses a write names. Workers on other hosts (or containers without a shared /dev/shm) cannot
reach each other's files: a write to such a peer fails with TransferError, and the handoff with it."""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Sequence

from radixmesh.engine.disaggregation.transfer import TransferError, Write
from radixmesh.engine.shared_memory import lasting_path, sweep_orphans, unlink

log = logging.getLogger(__name__)

PIECE_BYTES = 8 << 20  # a write is copied in pieces of this size, several at once
COPY_THREADS = 4


class _Range(NamedTuple):
    """A registered range: `nbytes` at address `ptr`, byte `offset` of the shared-memory file `path`."""

    ptr: int
    nbytes: int
    path: str
    offset: int


def _backing(ptr: int, nbytes: int) -> tuple[str, int] | None:
    """The file whose shared mapping holds [ptr, ptr + nbytes) in this process, and the range's offset in it; None
    for memory of no such file."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6:
                continue
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr and ptr + nbytes <= hi:
                path = fields[5].strip()
                if fields[1][3] != "s" or not path.startswith("/") or path.endswith("(deleted)"):
                    return None
                return path, int(fields[2], 16) + ptr - lo
    return None


class _Peer:
    """A peer's registered ranges, mapped here: its addresses -> this process's."""

    def __init__(self, session_id: str):
        index = session_id.removeprefix("shm:")
        try:
            with open(index) as f:
                ranges = [_Range(*r) for r in json.load(f)]
        except (OSError, ValueError) as e:
            raise TransferError(f"shm peer {session_id}: cannot read its index ({e}); the shm backend moves KV "
                                "between workers that share one host's /dev/shm") from None
        self.ranges = sorted(ranges)
        self._maps: list[mmap.mmap] = []
        self.bases: list[int] = []
        try:
            for r in self.ranges:
                skip = r.offset % mmap.ALLOCATIONGRANULARITY  # a mapping starts on a page
                with open(r.path, "r+b") as f:
                    m = mmap.mmap(f.fileno(), r.nbytes + skip, offset=r.offset - skip)
                self._maps.append(m)
                self.bases.append(ctypes.addressof(ctypes.c_char.from_buffer(m)) + skip)
        except (OSError, ValueError) as e:
            self.close()
            raise TransferError(f"shm peer {session_id}: cannot map its memory ({e})") from None

    def local(self, ptr: int, length: int) -> int:
        """The address here of the peer's [ptr, ptr + length)."""
        for r, base in zip(self.ranges, self.bases):
            if r.ptr <= ptr and ptr + length <= r.ptr + r.nbytes:
                return base + ptr - r.ptr
        raise TransferError(f"[{ptr:#x}, +{length}) is not in memory the peer registered")

    def close(self) -> None:
        self.bases = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a ctypes view still refers to it; the mapping goes with the process
                pass
        self._maps = []


class ShmBackend:
    shared_mirror = True  # KvTransfer asks the engine for a mirror in shared-memory files

    def __init__(self, host: str = "127.0.0.1"):
        orphans = sweep_orphans()  # what killed workers of this host left (their mirrors can be gigabytes)
        if orphans:
            log.warning("removed %d shared-memory files of workers that are gone: %s", len(orphans),
                        ", ".join(orphans))
        self._index = lasting_path("kv-shm-index")
        atexit.register(self._unlink_index)  # and at close()
        self.session_id = f"shm:{self._index}"
        self._ranges: dict[int, _Range] = {}
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._copier = ThreadPoolExecutor(max_workers=COPY_THREADS, thread_name_prefix="radixmesh-kv-shm")
        self._publish()

    def register(self, ptr: int, nbytes: int) -> None:
        """Memory in a shared-memory file is published to peers; other memory can only be written from (any local
        address can: registering it is a no-op)."""
        backing = _backing(ptr, nbytes)
        if backing is not None:
            self._ranges[ptr] = _Range(ptr, nbytes, *backing)
            self._publish()

    def unregister(self, ptr: int) -> None:
        if self._ranges.pop(ptr, None) is not None:
            self._publish()

    def _publish(self) -> None:
        tmp = f"{self._index}.tmp"
        with open(tmp, "w") as f:
            json.dump([list(r) for r in self._ranges.values()], f)
        os.replace(tmp, self._index)  # a peer never reads half of it

    def _peer(self, session_id: str) -> _Peer:
        with self._lock:
            peer = self._peers.get(session_id)
            if peer is None:
                peer = self._peers[session_id] = _Peer(session_id)
            return peer

    def write(self, peer: str, writes: Sequence[Write]) -> None:
        """Each Write copies local `src` to the peer's `dst`; large ranges in pieces, on several threads."""
        if not writes:
            return
        if not peer.startswith("shm:"):
            raise TransferError(f"peer {peer} is not an shm transfer backend (both workers of a pair must use the "
                                "same --disaggregation-transfer-backend)")
        target = self._peer(peer)
        pieces = []
        for w in writes:
            dst = target.local(w.dst, w.length)
            pieces += [(dst + at, w.src + at, min(PIECE_BYTES, w.length - at))
                       for at in range(0, w.length, PIECE_BYTES)]
        list(self._copier.map(lambda piece: ctypes.memmove(*piece), pieces))  # ctypes calls run without the GIL

    def close(self) -> None:
        self._copier.shutdown(wait=True)
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()
        self._ranges.clear()
        self._unlink_index()

    def _unlink_index(self) -> None:
        unlink([self._index, f"{self._index}.tmp"])
