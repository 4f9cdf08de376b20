"""KV pages between the workers of one host through shared memory: the receiver's KV mirror lives in shared-memory
files, and the sender maps them and copies the pages in: from its GPU's pool straight into the mapped files (one DMA
per run of pages, the files page-locked in the sender too: `copy_in`), or from host memory with memcpy on a few
threads (`write`). No network stack and no transport engine between two processes of one machine; the receiver
then copies the pages from its mirror into its pool (engine.disaggregation.mirror). Measured in
benchmarks/results/NOTES.md.

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

import torch

from radixmesh.engine.disaggregation.transfer import TransferError, Write
from radixmesh.engine.shared_memory import lasting_path, ours, sweep_orphans, unlink

log = logging.getLogger(__name__)

PIECE_BYTES = 8 << 20  # a write is copied in pieces of this size, several at once
COPY_THREADS = 4
PIN_SEGMENT = 64 << 20  # a peer's memory is page-locked here in pieces of this size, as transfers reach them


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
                if fields[1][3] != "s" or not ours(path) or path.endswith("(deleted)"):  # (a GPU driver's shared mapping is not a peer's to map)
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
        self._tensors: list[torch.Tensor] = []  # the ranges as byte tensors, for copies from a GPU
        self._segments: set[tuple[int, int]] = set()  # (range, segment) pinned here, or tried
        self._pinned: list[int] = []  # addresses cudaHostRegister'ed here
        self._pin = True  # until a registration fails
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
        i = self._find(ptr, length)
        return self.bases[i] + ptr - self.ranges[i].ptr

    def _find(self, ptr: int, length: int) -> int:
        for i, r in enumerate(self.ranges):
            if r.ptr <= ptr and ptr + length <= r.ptr + r.nbytes:
                return i
        raise TransferError(f"[{ptr:#x}, +{length}) is not in memory the peer registered")

    def split(self, ptr: int, length: int) -> list[tuple[int, int]]:
        """[ptr, ptr + length) as (offset, length) pieces that each stay inside one pinning segment."""
        at = ptr - self.ranges[self._find(ptr, length)].ptr
        cuts = list(range((at // PIN_SEGMENT + 1) * PIN_SEGMENT, at + length, PIN_SEGMENT))
        edges = [at, *cuts, at + length]
        return [(a - at, b - a) for a, b in zip(edges, edges[1:])]

    def tensor(self, ptr: int, length: int) -> torch.Tensor:
        """The peer's [ptr, ptr + length) as a byte tensor over its memory, page-locked here (for the GPU's copy
        engines) where CUDA is: pinned by segments as transfers first reach them (a mirror is the pool's size, tens of
        gigabytes, and transfers mostly reuse its first pages; what pinning it whole would cost was not measured)."""
        i = self._find(ptr, length)
        r, base, at = self.ranges[i], self.bases[i], ptr - self.ranges[i].ptr
        if not self._tensors:
            for rr, m in zip(self.ranges, self._maps):
                skip = rr.offset % mmap.ALLOCATIONGRANULARITY
                self._tensors.append(torch.frombuffer(m, dtype=torch.uint8, count=rr.nbytes, offset=skip))
        if self._pin and torch.cuda.is_available():
            for seg in range(at // PIN_SEGMENT, (at + length - 1) // PIN_SEGMENT + 1):
                if (i, seg) not in self._segments:
                    self._segments.add((i, seg))
                    start = base + seg * PIN_SEGMENT
                    rc = int(torch.cuda.cudart().cudaHostRegister(start, min(PIN_SEGMENT, r.nbytes - seg * PIN_SEGMENT),
                                                                  0))
                    if rc == 0:
                        self._pinned.append(start)
                    else:  # still correct: the copy goes through the driver's own staging, slower
                        self._pin = False
                        log.warning("cudaHostRegister of a peer's KV mirror failed (%s): copies into it are not "
                                    "DMA", rc)
        return self._tensors[i][at:at + length]

    def close(self) -> None:
        for base in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(base)
        self._pinned, self._tensors, self._segments = [], [], set()
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
        if not session_id.startswith("shm:"):
            raise TransferError(f"peer {session_id} is not an shm transfer backend (both workers of a pair must use "
                                "the same --disaggregation-transfer-backend)")
        with self._lock:
            peer = self._peers.get(session_id)
            if peer is None:
                peer = self._peers[session_id] = _Peer(session_id)
            return peer

    def write(self, peer: str, writes: Sequence[Write]) -> None:
        """Each Write copies local `src` (host memory) to the peer's `dst`; large ranges in pieces, on several
        threads."""
        if not writes:
            return
        target = self._peer(peer)
        pieces = []
        for w in writes:
            dst = target.local(w.dst, w.length)
            pieces += [(dst + at, w.src + at, min(PIECE_BYTES, w.length - at))
                       for at in range(0, w.length, PIECE_BYTES)]
        list(self._copier.map(lambda piece: ctypes.memmove(*piece), pieces))  # ctypes calls run without the GIL

    def copy_in(self, peer: str, pieces: Sequence[tuple[torch.Tensor, int]]) -> None:
        """Copy each (source bytes, peer address) into the peer's memory with torch: from a GPU, one DMA per piece
        straight into the peer's shared-memory file (no staging copy on this side), queued on the caller's current
        stream, which the caller synchronizes."""
        target = self._peer(peer)
        for src, dst in pieces:
            for at, n in target.split(dst, src.numel()):  # a DMA stays inside one page-locked segment
                with self._lock:
                    view = target.tensor(dst + at, n)
                view.copy_(src[at:at + n], non_blocking=True)

    def close(self) -> None:
        self._copier.shutdown(wait=True)
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()
        self._ranges.clear()
        self._unlink_index()

    def _unlink_index(self) -> None:
        unlink([self._index, f"{self._index}.tmp"])
