"""The host-memory KV pool (L2 of the hierarchical cache) and the copies between it and the device pool.

Host page p is one contiguous block [2 * num_layers, page_size, num_kv_heads, head_dim] (layer 0 K, layer 0 V, ...;
a latent cache's one buffer a layer: [num_layers, ...], engine.cache.kv_pool's `parts`), so a page is also the byte
layout the L3 store keeps (`engine.cache.storage.KvLayout.page_bytes`). Page 0 is never handed out. On CUDA the pool
is pinned and copies run on streams of their own, one per direction (a load never queues behind a backup, and the two
use the GPU's separate copy engines at once):
- device -> host (`to_host`) is asynchronous: queued, then issued with the other queued ones by the next `flush`
  (the scheduler's poll or the next forward), after the compute stream's work so far (the KV must be written);
  the caller gets a `Pending` and may use the host pages once it is done;
- host -> device (`to_device`) is queued and issued by the next forward (`take_ready`, ModelRunner): all of that
  forward's loads go out together, layer by layer, and its layer l waits only for layer l's part, so the copies
  overlap the forward that reads them without any host synchronization (over the copy engine in batches, each
  layer's copies are queued only as the forward reaches that layer: `_LayerLoads`).
With a pinned host pool both directions are one kernel launch per layer that reads or writes the host pages in place
(kernels.kv_pages); otherwise (a TP group's shared host file) a staged copy of whole pages. On CPU both copies are
plain synchronous copies.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from radixmesh.engine.cache.kv_pool import KVPool, PageAllocator


class HostKVPool:
    """`data` [pages + 1, *shape]: this rank's pages, which the copies to and from the device use; `group` [pages +
    1, ranks, *shape]: what the L3 store keeps, every rank's page p as one block (the same tensor with one rank).
    Under tensor parallelism with an L3 store the group lives in the shared file `path` (engine.shared_memory): the
    leader makes it (`path` None), each follower maps it and uses its own rank's slice. `replicated`: every rank's KV
    is the same (a latent cache under tensor parallelism: DeepSeek's latent is whole on every rank), so the group keeps
    one slice, which every rank maps: the leader alone copies pages to it, and a page is stored once."""

    def __init__(self, num_pages: int, kv: KVPool, rank: int = 0, ranks: int = 1, path: str | None = None,
                 replicated: bool = False):
        k = kv.k[0]
        self.page_size = kv.page_size
        self.num_layers = len(kv.k)
        self.shape = (kv.parts * self.num_layers, kv.page_size, k.shape[1], k.shape[2])
        self.path, self.replicated = path, replicated
        slices = 1 if replicated else ranks
        if ranks == 1:
            self.group = torch.zeros((num_pages + 1, 1, *self.shape), dtype=k.dtype, pin_memory=k.is_cuda)
        else:
            from radixmesh.engine.shared_memory import new_path, shared_tensor

            if rank == 0:
                self.path = new_path("host-kv")
            numel = (num_pages + 1) * slices * math.prod(self.shape)
            self.group = shared_tensor(self.path, numel, k.dtype, rank == 0).view(num_pages + 1, slices, *self.shape)
        self.data = self.group[:, 0 if replicated else rank]
        self.allocator = PageAllocator(num_pages)

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_pages * self.page_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in the store: every rank's."""
        return self.group[0].numel() * self.group.element_size()

    def page_address(self, page: int) -> int:
        return self.group.data_ptr() + page * self.page_bytes

    def page_view(self, page: int):
        """Page `page`'s bytes without a copy (a uint8 numpy array over the pool's memory)."""
        return self.group[page].view(torch.uint8).view(-1).numpy()

    def read_page(self, page: int) -> bytes:
        return self.group[page].view(torch.uint8).numpy().tobytes()

    def write_page(self, page: int, data: bytes) -> None:
        if len(data) != self.page_bytes:
            raise ValueError(f"page of {len(data)} bytes, expected {self.page_bytes}")
        self.group[page].view(torch.uint8).view(-1).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


@dataclass(slots=True)
class Pending:
    """A copy in flight: done once `event` completed (None: already done, in `seconds`)."""

    event: object | None
    tokens: int  # tokens copied (a load issued with others: every token of that flush, for rates)
    seconds: float = 0.0  # a synchronous copy's duration
    start_event: object = None  # CUDA: recorded on the copy stream before the copy (timing)
    keep: object = None  # buffers the copy reads or writes, alive until it is done
    flush: object = None  # a queued load: issues it (KVMover.flush); None once issued

    def done(self) -> bool:
        return self.flush is None and (self.event is None or self.event.query())

    def wait(self) -> None:
        if self.flush is not None:
            self.flush()
        if self.event is not None:
            self.event.synchronize()

    def elapsed_s(self) -> float:
        """How long the copy itself took (once done)."""
        if self.start_event is not None:
            return self.start_event.elapsed_time(self.event) / 1e3
        return self.seconds


def _timing_event(stream):
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def segments(host_pages: list[int], dev_pages: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(first index, length) arrays of the maximal stretches where both page lists count up by one."""
    h, d = np.asarray(host_pages, dtype=np.int64), np.asarray(dev_pages, dtype=np.int64)
    if not len(h):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint64)
    breaks = np.flatnonzero((np.diff(h) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    return starts, np.diff(np.concatenate([starts, [len(h)]])).astype(np.uint64)


def _runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """(index in pages, first page, count) for each run of consecutive page ids."""
    starts, lengths = segments(pages, pages)
    return [(int(i), int(pages[i]), int(n)) for i, n in zip(starts, lengths)]


# Copies run narrow: 16 programs still move ~45 GB/s either way (PCIe's rate) and slow a GEMM stream beside them ~1%,
# where 64 take ~6% (benchmarks.kv_copy, H100). A load is waited for layer by layer by the forward it overlaps, so
# what its width takes from that forward's kernels is on the forward's path.
BACKUP_PROGRAMS = 16
LOAD_PROGRAMS = 16


def _direct_copies(kv: KVPool, host: HostKVPool) -> bool:
    """Whether copies can be kernels.kv_pages launches: CUDA pools beside a pinned host pool, and Triton."""
    if not kv.k[0].is_cuda or not host.data.is_pinned():
        return False
    from radixmesh.engine.layers.triton_ops import use_kernels

    return use_kernels(kv.k[0])


IO_BACKENDS = ("kernel", "direct")  # --hicache-io-backend (SGLang's names)
# direct loads: pages a staging slot holds (one layer's K and V each: 256 KB for the 8B shape) and slots in the ring
STAGING_PAGES, STAGING_SLOTS = 128, 4


def default_io_backend(kv: KVPool, host: HostKVPool) -> str:
    """--hicache-io-backend when none is given: `direct` where the driver queues copy-engine copies in batches (CUDA
    12.8+) beside a pinned host pool, else `kernel` (SGLang's default). On an H200's multi-turn run (8B shape, 4x
    working set) the batched copy engine gave 333.7-350.3 ms mean TTFT against the kernel's 370.8-380.3
    (benchmarks/results/NOTES.md, 2026-11-28 night)."""
    if not kv.k[0].is_cuda or not host.data.is_pinned():
        return "kernel"
    from radixmesh.engine.cache import dma

    return "direct" if dma.available() and dma.batch_available() else "kernel"


class KVMover:
    def __init__(self, kv: KVPool, host: HostKVPool, io_backend: str | None = None):
        """`io_backend` (--hicache-io-backend), how loads reach the device on CUDA: `kernel` (kernels.kv_pages, one
        launch per layer reading the pinned host pool) or `direct` (the copy engine: engine.cache.dma); None:
        default_io_backend. Where the one asked for cannot run (no pinned pool, Triton or CUDA runtime), the other,
        else staged copies."""
        if io_backend is None:
            io_backend = default_io_backend(kv, host)
        assert io_backend in IO_BACKENDS, io_backend
        self.kv, self.host, self.io_backend = kv, host, io_backend
        self.cuda = kv.k[0].is_cuda
        self.direct = _direct_copies(kv, host)
        self.dma = self.cuda and host.data.is_pinned() and (io_backend == "direct" or not self.direct)
        self.batched = False  # dma in batches, every page straight into place, backups too
        if self.dma:
            from radixmesh.engine.cache import dma

            self.dma = dma.available()
            self.batched = self.dma and dma.batch_available()
        self.stream = torch.cuda.Stream(device=kv.k[0].device) if self.cuda else None  # device -> host
        # host -> device; high priority: a forward's layers wait for its copies, so their programs go first
        self.load_stream = torch.cuda.Stream(device=kv.k[0].device, priority=-1) if self.cuda else None
        # direct loads: staged pages go into the pool's pages here while the copy engine brings the next layer
        self.scatter_stream = torch.cuda.Stream(device=kv.k[0].device, priority=-1) if self.dma else None
        self.buffers = kv.buffers()
        if self.batched:
            # byte addresses for batched copies: each layer's K and V buffer (or its one latent buffer), [layers,
            # parts]; page p of a layer's K (or V) is `half` bytes at p * half; host page p is `host_stride` bytes at
            # data + p * host_stride
            self._ptrs = np.array([[t.data_ptr() for t in kv.layer_buffers(i)] for i in range(len(kv.k))],
                                  dtype=np.uint64)
            self._half = host.data[0, 0].numel() * host.data.element_size()
            self._host_stride = host.data.stride(0) * host.data.element_size()
        self._queued: list[tuple[list[int], list[int], Pending]] = []  # loads: host pages, device pages
        self._backups: list[tuple[list[int], list[int], Pending]] = []  # device pages, host pages
        self._ready: list | None = None  # per-layer events of the last loads issued, until a forward takes them
        self._lazy: _LayerLoads | None = None  # the last batched loads, until every layer of them is issued

    def _device_pages(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(-1, self.kv.page_size, buf.shape[1], buf.shape[2])

    def _gather(self, dev_pages: list[int]) -> torch.Tensor:
        """Device pages as host-pool blocks [pages, parts * layers, page, heads, dim], on the device."""
        idx = torch.tensor(dev_pages, dtype=torch.int64).to(self.kv.k[0].device, non_blocking=True)
        return torch.stack([self._device_pages(b)[idx] for b in self.buffers], dim=1)

    def _scatter(self, staged: torch.Tensor, dev_pages: list[int]) -> None:
        """Host-pool blocks (on the device) into device pages."""
        idx = torch.tensor(dev_pages, dtype=torch.int64).to(self.kv.k[0].device, non_blocking=True)
        for j, b in enumerate(self.buffers):
            self._device_pages(b)[idx] = staged[:, j]

    def _copy_layers(self, host_pages: list[int], dev_pages: list[int], to_host: bool, programs: int | None = None,
                     after_layer=None) -> tuple[torch.Tensor, torch.Tensor]:
        """kernels.kv_pages over every layer, one launch each (arguments checked once: the layers' buffers are
        alike), `after_layer(layer)` after each; returns the page lists, to keep until the copy is done."""
        from radixmesh.kernels.kv_pages import copy_kv_pages

        both = torch.tensor([host_pages, dev_pages], dtype=torch.int64).to(self.kv.k[0].device, non_blocking=True)
        hp, dp = both[0], both[1]
        for layer in range(len(self.kv.k)):
            copy_kv_pages(self.host.data, *self._k_v(layer), layer, hp, dp, to_host, programs, check=layer == 0)
            if after_layer is not None:
                after_layer(layer)
        return hp, dp

    def to_host(self, dev_pages: list[int], host_pages: list[int]) -> Pending:
        """Copy device pages into host pages (same order). On CUDA the copy is queued and issued by the next `flush`
        with every other queued one (one launch per layer for all of them), after what the compute stream holds
        then; a `wait` on the returned Pending issues it at once. (On CPU the flush copies synchronously.)"""
        pending = Pending(None, len(dev_pages) * self.kv.page_size, flush=self.flush)
        self._backups.append((list(dev_pages), list(host_pages), pending))
        return pending

    def _issue_backups(self) -> None:
        if not self._backups:
            return
        queued, self._backups = self._backups, []
        dev_pages = [p for d, _, _ in queued for p in d]
        host_pages = [p for _, h, _ in queued for p in h]
        if not self.cuda:
            started = time.perf_counter()
            self.host.data[torch.tensor(host_pages, dtype=torch.int64)] = self._gather(dev_pages)
            for _, _, pending in queued:
                pending.seconds, pending.flush = time.perf_counter() - started, None
            return
        self.stream.wait_stream(torch.cuda.current_stream())  # the KV must be written
        with torch.cuda.stream(self.stream):
            start = _timing_event(self.stream)
            if self.batched:
                keep = None
                self._backup_batched(dev_pages, host_pages)
            elif self.direct:
                keep = self._copy_layers(host_pages, dev_pages, True, BACKUP_PROGRAMS)
            else:
                keep = staged = self._gather(dev_pages)
                for i, first, n in _runs(host_pages):
                    self.host.data[first:first + n].copy_(staged[i:i + n], non_blocking=True)
            event = _timing_event(self.stream)
        for _, _, pending in queued:
            pending.event, pending.start_event, pending.keep, pending.flush = event, start, keep, None

    def to_device(self, host_pages: list[int], dev_pages: list[int]) -> Pending:
        """Queue a copy of host pages into device pages (same order). It is issued by the next `flush`: the model
        runner's at the start of its next forward (`take_ready`), or a `wait` on the returned Pending."""
        pending = Pending(None, len(dev_pages) * self.kv.page_size, flush=self.flush)
        self._queued.append((list(host_pages), list(dev_pages), pending))
        return pending

    def flush(self) -> None:
        """Issue every queued copy: the backups, then the loads, layer by layer (all of them for layer 0, then
        layer 1, ...)."""
        if self._lazy is not None:  # loads go out in order: whatever an earlier flush left to issue goes first
            self._lazy.finish()
            self._lazy = None
        if self._backups:
            self._issue_backups()
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        host_pages, dev_pages, seen = [], [], set()
        for hs, ds, _ in reversed(queued):  # a device page loaded twice (freed and reused meanwhile): the last wins
            for h, d in zip(reversed(hs), reversed(ds)):
                if d not in seen:
                    seen.add(d)
                    host_pages.append(h)
                    dev_pages.append(d)
        host_pages.reverse()
        dev_pages.reverse()
        tokens = len(dev_pages) * self.kv.page_size
        started = time.perf_counter()
        event = start = keep = finish = None
        if not self.cuda:
            self._scatter(self.host.data[torch.tensor(host_pages, dtype=torch.int64)], dev_pages)
        else:
            with torch.cuda.stream(self.load_stream):
                start = _timing_event(self.load_stream)
                if self.batched:
                    ready = self._lazy = _LayerLoads(self, host_pages, dev_pages, [p for _, _, p in queued])
                    finish = ready.finish
                elif self.dma:
                    ready, keep = self._load_direct(host_pages, dev_pages)
                elif self.direct:
                    ready = []

                    def layer_done(layer: int) -> None:
                        if layer < len(self.kv.k) - 1:  # the last layer's part ends with the flush (`event`)
                            ready.append(torch.cuda.Event())
                            ready[-1].record(self.load_stream)

                    keep = self._copy_layers(host_pages, dev_pages, False, LOAD_PROGRAMS, after_layer=layer_done)
                else:
                    keep = staged = torch.empty((len(host_pages), *self.host.shape), dtype=self.host.data.dtype,
                                                device=self.kv.k[0].device)
                    for i, first, n in _runs(host_pages):
                        staged[i:i + n].copy_(self.host.data[first:first + n], non_blocking=True)
                    self._scatter(staged, dev_pages)
                if self.batched:
                    event = ready.events[-1]  # recorded when the last layer is issued
                elif self.dma:
                    event = ready.pop()  # the last layer's scatter ends the flush
                else:
                    event = _timing_event(self.load_stream)
            if self.batched:
                self._ready = ready
            else:
                self._ready = ready + [event] if self.direct or self.dma else [event] * len(self.kv.k)
        seconds = time.perf_counter() - started
        for _, _, pending in queued:
            pending.event, pending.start_event, pending.keep = event, start, keep
            pending.tokens, pending.seconds, pending.flush = tokens, seconds, finish

    def _k_v(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """kernels.kv_pages' k and v of `layer` (v None: a latent cache's one buffer)."""
        return (self.kv.k[layer], self.kv.v[layer]) if self.kv.parts == 2 else (self.kv.k[layer], None)

    def _addresses(self, host_pages: list[int], dev_pages: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(host, device) byte addresses [layers, parts (K, V), pages] of each page's K and V of each layer."""
        layers, parts = self._ptrs.shape
        dev = np.asarray(dev_pages, dtype=np.uint64) * np.uint64(self._half)
        on_device = self._ptrs[:, :, None] + dev
        host = np.asarray(host_pages, dtype=np.uint64) * np.uint64(self._host_stride) \
            + np.uint64(self.host.data.data_ptr())
        blocks = (np.arange(parts * layers, dtype=np.uint64) * np.uint64(self._half)).reshape(layers, parts, 1)
        return host[None, None, :] + blocks, on_device

    def _backup_batched(self, dev_pages: list[int], host_pages: list[int]) -> None:
        """Backups over the copy engine (call on the backup stream): every layer's K and V of every page, device page
        to host page, in one batch."""
        self._batches(host_pages, dev_pages, False)(None)

    def _batches(self, host_pages: list[int], dev_pages: list[int], to_device: bool):
        """A function that queues the batch of copies between these pages for one layer (or, given None, every
        layer) on the stream in use: one copy per page's K and one per its V (one a page for a latent cache;
        dma.copy_batch). The driver takes
        ~0.45 us per copy (benchmarks.dma_issue), and a wave's loads of the 8B shape are ~66k page copies. (2-D copies
        per stretch of pages consecutive on both sides were measured and are slower here: the same benchmark's
        --runs.)"""
        from radixmesh.engine.cache import dma

        stream = torch.cuda.current_stream().cuda_stream
        layers = len(self.kv.k)
        host, dev = self._addresses(host_pages, dev_pages)
        host, dev = host.reshape(layers, -1), dev.reshape(layers, -1)
        src, dst = (host, dev) if to_device else (dev, host)
        sizes = np.full(host.shape[1], self._half, dtype=np.uint64)

        def queue(layer):
            if layer is None:
                dma.copy_batch(dst.reshape(-1), src.reshape(-1), np.tile(sizes, layers), stream)
            else:
                dma.copy_batch(dst[layer], src[layer], sizes, stream)

        return queue

    def _load_direct(self, host_pages: list[int], dev_pages: list[int]) -> tuple[list, tuple]:
        """Loads over the copy engine (call on the load stream): for each layer and group of up to STAGING_PAGES
        pages, one 2-D copy per run of consecutive host pages brings that layer's K and V into a staging slot, then
        two index copies on the scatter stream put them into the pool's pages. Slots are reused in a ring (a copy
        into a slot waits for the scatter that last read it). Returns the per-layer events (the last one's scatter
        ends the flush) and what must stay alive until then."""
        from radixmesh.engine.cache import dma

        kv, data = self.kv, self.host.data
        copy, scatter = self.load_stream, self.scatter_stream
        if not host_pages:
            done = torch.cuda.Event(enable_timing=True)
            done.record(copy)
            return [done] * len(kv.k), ()
        page_elems, parts = data[0, 0].numel(), kv.parts
        row = parts * page_elems * data.element_size()  # one page's K and V of one layer, adjacent in a host page
        host_stride = data.stride(0) * data.element_size()
        device = kv.k[0].device
        groups = [(g, host_pages[g:g + STAGING_PAGES]) for g in range(0, len(host_pages), STAGING_PAGES)]
        slots = torch.empty((STAGING_SLOTS, min(len(host_pages), STAGING_PAGES), parts, *data.shape[2:]),
                            dtype=data.dtype, device=device)
        idx = torch.tensor(dev_pages, dtype=torch.int64).to(device, non_blocking=True)
        scatter.wait_stream(copy)  # the page index is on the device
        handle, used, ready = copy.cuda_stream, [], []
        for layer in range(len(kv.k)):
            offset = data.data_ptr() + parts * layer * page_elems * data.element_size()
            for g, pages in groups:
                n = len(used)
                slot = slots[n % STAGING_SLOTS]
                if n >= STAGING_SLOTS:
                    copy.wait_event(used[n - STAGING_SLOTS])
                for i, first, count in _runs(pages):
                    dma.copy_2d(slot.data_ptr() + i * row, row, offset + first * host_stride, host_stride, row, count,
                                True, handle)
                arrived = torch.cuda.Event()
                arrived.record(copy)
                scatter.wait_event(arrived)
                with torch.cuda.stream(scatter):
                    where = idx[g:g + len(pages)]
                    for j, buf in enumerate(kv.layer_buffers(layer)):
                        self._device_pages(buf).index_copy_(0, where, slot[:len(pages), j])
                    done = torch.cuda.Event(enable_timing=True)  # the last one times the flush (Pending)
                    done.record(scatter)
                used.append(done)
            ready.append(used[-1])
        slots.record_stream(scatter)
        idx.record_stream(scatter)
        return ready, (slots, idx)

    def take_ready(self) -> list | None:
        """For a forward about to be launched: issue the queued loads and return, once, the CUDA events its layer l
        waits for before reading the KV of layer l (None: nothing to wait for). Loads run in order on one stream, so
        the last flush's events cover every earlier one."""
        self.flush()
        ready, self._ready = self._ready, None
        return ready


# Batched loads: layers issued ahead of the one the forward has reached (see _LayerLoads)
LOOKAHEAD = 2


class _LayerLoads:
    """One flush's loads over the copy engine (--hicache-io-backend direct with cuMemcpyBatchAsync): one batch per
    layer of that layer's K and V of every page, host page straight into device page, issued as the forward reaches
    the layer. `loads[l]` (the forward context's wait for layer l) issues every layer up to l + LOOKAHEAD not issued
    yet and returns layer l's event; `finish` issues the rest (a wait on the loads' Pending, the next flush). The
    driver takes ~0.45 us to queue a copy, so issuing every layer before the forward's first kernel (2 x ~1,000 pages
    x 32 layers for a wave's big extend of the 8B shape) kept the GPU idle 33-49 ms at the start of such a forward
    (H200 timeline); layer by layer, the next layers' copies are queued while this one computes. The loads' Pendings
    stay unfinished (`flush` set) until the last layer is issued."""

    def __init__(self, mover: KVMover, host_pages: list[int], dev_pages: list[int], pendings: list[Pending]):
        layers = len(mover.kv.k)
        self.stream, self.pendings, self.issued = mover.load_stream, pendings, 0
        # the last one is timed: it ends the flush (Pending.elapsed_s)
        self.events = [torch.cuda.Event(enable_timing=layer == layers - 1) for layer in range(layers)]
        # built on the load stream (KVMover.flush): each layer's batch goes there whenever it is issued
        self.queue = mover._batches(host_pages, dev_pages, True) if host_pages else None

    def __len__(self) -> int:
        return len(self.events)

    def __getitem__(self, layer: int):
        if layer < 0:
            layer += len(self.events)
        if layer >= self.issued:
            self._issue(min(layer + LOOKAHEAD, len(self.events) - 1))
        return self.events[layer]

    def finish(self) -> None:
        if self.issued < len(self.events):
            self._issue(len(self.events) - 1)

    def _issue(self, last: int) -> None:
        for layer in range(self.issued, last + 1):
            if self.queue is not None:
                self.queue(layer)
            self.events[layer].record(self.stream)
            self.issued = layer + 1
        if self.issued == len(self.events):
            self.queue = None
            for pending in self.pendings:
                pending.flush = None
