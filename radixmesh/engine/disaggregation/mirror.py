"""Host memory a transfer backend moves KV pages between: a "mirror" of the KV pool (the same buffers, the same page
numbers), and the copies between a pool and its mirror ("staging").

One device: on a GPU each KV buffer gets a pinned host twin (a CPU build of Mooncake cannot register device memory)
and pages are staged through it; a pool in host memory is its own mirror and staging does nothing.

Tensor parallelism: each rank's pool holds its shard of the KV heads, in its own process. The leader creates one
shared-memory file per rank, holding that rank's mirror; each rank maps its own and the leader maps all of them, so
the leader's one transfer backend reads or writes every rank's shard. The mirror's buffers are rank 0's, then rank
1's, ...; page p of every rank moves with page p, since the ranks' page tables are identical (engine.distributed).
Staging is a command on the group's CommandChannel: every rank copies the pages between its pool and its mirror,
and all agree it succeeded before the leader goes on. Ranks on other nodes cannot map node 0's memory: refused.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
from typing import Sequence

import torch

from radixmesh.engine.cache.kv_pool import KVPool
from radixmesh.engine.disaggregation.kv_pages import KvLayout, check_layouts, pages_digest
from radixmesh.engine.disaggregation.transfer import page_runs
from radixmesh.engine.distributed import CommandChannel
from radixmesh.engine.shared_memory import lasting_path, new_path, shared_tensor, unlink

log = logging.getLogger(__name__)


def _by_page(t: torch.Tensor, page_size: int) -> torch.Tensor:
    return t.view(-1, page_size * t[0].numel())


MAX_RUNS = 8  # pages in more runs than this are gathered (or scattered) on the device, one kernel per buffer


def _runs(pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first page, its position in `pages`, count) for each run of consecutive pages."""
    return page_runs(pages, range(len(pages)))


def _copy_pages(sources: list[torch.Tensor], targets: list[torch.Tensor], src_pages: Sequence[int],
                dst_pages: Sequence[int], size: int, stream: torch.cuda.Stream | None = None,
                after_queued: bool = False) -> None:
    """Page src_pages[i] of each source buffer into page dst_pages[i] of its target (a pool and its mirror, either
    way). Few runs of pages moving together: one direct copy each (DMA between device and pinned host memory).
    Scattered pages: gathered into one packed block where the source is on the device and copied out by the
    target's runs, or copied in by the source's runs and scattered on the device; both on the host: indexed. On a
    GPU the copies run on `stream`, beside the forward passes on the default stream; `after_queued`: first wait
    for the work queued there so far (a step in flight may still touch the pages). Waits for the copies to end."""
    runs = page_runs(src_pages, dst_pages)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        if stream is not None and after_queued:
            stream.wait_stream(torch.cuda.default_stream(stream.device))
        gather = len(runs) > MAX_RUNS and (sources[0].is_cuda or not targets[0].is_cuda)
        scatter = len(runs) > MAX_RUNS and not gather
        if gather:  # where the source is (the device, or both on the host), then copy out by the target's runs
            index, target_runs = torch.as_tensor(list(src_pages), device=sources[0].device), _runs(dst_pages)
        if scatter:  # a host source into the device: copy in by the source's runs, scatter on the device
            index, source_runs = torch.as_tensor(list(dst_pages), device=targets[0].device), _runs(src_pages)
        for src, dst in zip(sources, targets):
            s, d = _by_page(src, size), _by_page(dst, size)
            if gather:
                packed = s[index]
                for b, k, n in target_runs:
                    d[b:b + n].copy_(packed[k:k + n], non_blocking=True)
            elif scatter:
                packed = torch.empty((len(src_pages), s.shape[1]), dtype=s.dtype, device=dst.device)
                for a, k, n in source_runs:
                    packed[k:k + n].copy_(s[a:a + n], non_blocking=True)
                d[index] = packed
            else:
                for a, b, n in runs:
                    d[b:b + n].copy_(s[a:a + n], non_blocking=True)
    if stream is not None:
        stream.synchronize()


class Slots:
    """The mirror pages lent to transfers in flight. A mirror's page numbers do not follow the pool's: a request's
    pages, however scattered in the pool, are staged into one run of free mirror pages where there is one, so the
    transfer is one write per buffer and the device gathers or scatters the pool's pages on its side."""

    def __init__(self, num_pages: int):
        self._free = [(0, num_pages)]  # (first, count), sorted, merged
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return sum(n for _, n in self._free)

    def take(self, n: int) -> list[int]:
        """`n` free pages: the first run long enough, else pieces of several (first fit)."""
        with self._lock:
            for i, (first, count) in enumerate(self._free):
                if count >= n:
                    self._free[i:i + 1] = [(first + n, count - n)] if count > n else []
                    return list(range(first, first + n))
            if self.num_free < n:  # a mirror is as large as its pool: pages in flight never outnumber it
                raise RuntimeError(f"the KV mirror has {self.num_free} free pages, {n} asked for")
            taken: list[int] = []
            while len(taken) < n:
                first, count = self._free[0]
                use = min(count, n - len(taken))
                taken += range(first, first + use)
                self._free[0:1] = [(first + use, count - use)] if count > use else []
            return taken

    def give(self, pages: Sequence[int]) -> None:
        with self._lock:
            merged: list[tuple[int, int]] = []
            for first, count in sorted(self._free + [(p, n) for p, _, n in _runs(pages)]):
                if merged and merged[-1][0] + merged[-1][1] == first:
                    merged[-1] = (merged[-1][0], merged[-1][1] + count)
                else:
                    merged.append((first, count))
            self._free = merged


def _shared_twin(t: torch.Tensor, path: str) -> torch.Tensor:
    """A host twin of `t` in the shared-memory file `path`, whose name stays while the mirror is open (a peer maps it
    by name); page-locked for the GPU's copies when `t` is on one."""
    twin = shared_tensor(path, t.numel(), t.dtype, create=True).view(t.shape)
    if t.is_cuda:
        rc = torch.cuda.cudart().cudaHostRegister(twin.data_ptr(), twin.numel() * twin.element_size(), 0)
        if int(rc) != 0:  # still correct, only slower to stage
            log.warning("cudaHostRegister of the shared KV mirror failed (%s): staging copies are not pinned", rc)
    return twin


class KvMirror:
    """One rank's mirror: `buffers` the transfer backend registers, and the staging copies of `pool`'s pages."""

    tp_size = 1

    def __init__(self, pool: KVPool, buffers: list[torch.Tensor] | None):
        """`buffers`: host twins of the pool's buffers; None: the pool is its own mirror (host memory)."""
        self.pool = pool
        self.paths: list[str] = []  # the shared-memory files of a shared mirror, unlinked at close
        self.staged = buffers is not None
        self.local = buffers if buffers is not None else pool.buffers()
        # the mirror pages lent to transfers (made here: two writer threads may ask at once)
        self.slots = Slots(self.local[0].shape[0] // pool.page_size) if self.staged else None
        device = pool.buffers()[0].device
        # the staging copies' own stream: a transfer does not queue behind the forward passes (a long prefill)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @classmethod
    def for_pool(cls, pool: KVPool, staged: bool | None = None, shared: bool = False) -> "KvMirror":
        """Staged through pinned twins when the pool is on a GPU (or `staged` says so: a forced CPU test). `shared`:
        the twins are shared-memory files another process of this host can map (the shm transfer backend), always
        staged, pinned on a GPU."""
        device = pool.buffers()[0].device
        if shared:
            paths = [lasting_path("kv-mirror") for _ in pool.buffers()]
            atexit.register(unlink, paths)  # and at close()
            mirror = cls(pool, [_shared_twin(t, p) for t, p in zip(pool.buffers(), paths)])
            mirror.paths = paths
            return mirror
        if not (device.type != "cpu" if staged is None else staged):
            return cls(pool, None)
        return cls(pool, [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in pool.buffers()])

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every buffer the backend moves pages of (every rank's, under tensor parallelism)."""
        return self.local

    def hold(self, pages: Sequence[int]) -> list[int]:
        """Mirror pages for a transfer of the pool's `pages`: the pages themselves when the pool is its own mirror,
        else free pages of the mirror (one run where there is one), lent until `release`."""
        if not self.staged:
            return list(pages)
        return self.slots.take(len(pages))

    def release(self, slots: Sequence[int]) -> None:
        if self.staged and len(slots):
            self.slots.give(slots)

    def stage_out(self, pages: Sequence[int], slots: Sequence[int]) -> None:
        """Copy the pool's `pages` into the mirror's `slots` (no-op unless staged); returns once they are there.
        Called for a request whose prefill has sampled its token, so the forward that wrote its KV has ended:
        nothing to wait for on the default stream, where other prefills may be queued for hundreds of ms."""
        if self.staged and len(pages):
            _copy_pages(self.pool.buffers(), self.local, pages, slots, self.pool.page_size, self.stream)

    def stage_in(self, slots: Sequence[int], pages: Sequence[int]) -> None:
        """Copy the mirror's `slots` into the pool's `pages` (no-op unless staged); returns once they are there."""
        if self.staged and len(pages):
            _copy_pages(self.local, self.pool.buffers(), slots, pages, self.pool.page_size, self.stream,
                        after_queued=True)

    def pieces(self, pages: Sequence[int], dest: KvLayout, dst_pages: Sequence[int]):
        """This mirror's `pages` as (source bytes, destination address) pieces for the peer's `dst_pages` in the
        layout `dest`, for a backend that copies tensors into its peer's memory: views of the buffers (the pool
        itself when unstaged, on the GPU then) where the pages run together, else a block gathered per buffer, one
        buffer at a time (on the staging stream: iterate inside `copying`)."""
        check_layouts(KvLayout(tuple(t.data_ptr() for t in self.buffers), self.pool.page_bytes), dest)
        nbytes = self.pool.page_bytes
        runs = page_runs(pages, dst_pages)
        gather = len(runs) > MAX_RUNS
        if gather:
            index = torch.as_tensor(list(pages), device=self.buffers[0].device)
            runs = [(k, b, n) for b, k, n in _runs(dst_pages)]  # (position in the gathered block, dest page, n)
        for t, base in zip(self.buffers, dest.bases):
            by_page = t.view(-1).view(torch.uint8).view(-1, nbytes)
            if gather:
                by_page = by_page[index]
            for a, b, n in runs:
                yield by_page[a:a + n].view(-1), base + b * nbytes

    def copying(self):
        """A context in which device copies run on the staging stream (nothing off a GPU)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def checksum(self, pages: Sequence[int]) -> str:
        """A digest of the mirror's `pages` (what a transfer moves), every rank's."""
        return pages_digest(self.buffers, self.pool.page_size, pages)

    def close(self) -> None:
        unlink(self.paths)


class RankMirrors(KvMirror):
    """The leader's view under tensor parallelism: its own mirror plus every follower's, staged together. Where
    every rank holds the same KV (a latent cache: engine.cache.build.replicated_kv) there is one mirror every rank
    maps: the leader alone stages pages out of its pool into it, a transfer moves it once, and every rank stages it
    into its own pool."""

    def __init__(self, pool: KVPool, per_rank: list[list[torch.Tensor]], channel: CommandChannel, tp_size: int):
        super().__init__(pool, per_rank[0])
        self.per_rank, self.channel = per_rank, channel
        self.tp_size = tp_size
        self.replicated = len(per_rank) == 1

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [t for rank in self.per_rank for t in rank]

    def stage_out(self, pages: Sequence[int], slots: Sequence[int]) -> None:
        if self.replicated:  # (the followers' pages are the leader's)
            super().stage_out(pages, slots)
            return
        self.channel.run(("out", list(pages), list(slots)), lambda: super(RankMirrors, self).stage_out(pages, slots))

    def stage_in(self, slots: Sequence[int], pages: Sequence[int]) -> None:
        self.channel.run(("in", list(slots), list(pages)), lambda: super(RankMirrors, self).stage_in(slots, pages))


def _shared_buffers(path: str, like: list[torch.Tensor], create: bool) -> list[torch.Tensor]:
    """Host buffers shaped like `like`, laid one after another in the shared file `path` (created when asked)."""
    flat = shared_tensor(path, sum(t.numel() for t in like), like[0].dtype, create)
    out, at = [], 0
    for t in like:
        out.append(flat[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out


def lead(runner) -> RankMirrors:
    """Leader (on the scheduler thread, between steps): make every rank's mirror and the staging channel."""
    if runner.args.nnodes > 1:
        raise ValueError("prefill/decode disaggregation with nnodes > 1 is not supported: every rank's KV shard is "
                         "staged through node 0's memory; run a PD worker's ranks on one node")
    from radixmesh.engine.cache.build import replicated_kv

    replicated = replicated_kv(runner.args, runner.model_config)  # (one mirror every rank maps)
    paths = [new_path(f"kv-mirror-tp{r}") for r in range(1 if replicated else runner.tp.size)]
    like = runner.kv_pool.buffers()
    try:
        per_rank = [_shared_buffers(p, like, create=True) for p in paths]
        runner.tp.broadcast_object(("kv_mirror", paths, None))
        channel = CommandChannel(runner.tp)
        runner.tp.all_min(0)  # every follower mapped its file: the names can go
    finally:
        unlink(paths)
    log.info("KV transfer mirrors for %d tensor parallel ranks (%d of %.1f MiB)", runner.tp.size, len(paths),
             sum(t.numel() * t.element_size() for t in like) / 2**20)
    return RankMirrors(runner.kv_pool, per_rank, channel, runner.tp.size)


def follow(runner, paths: list[str]) -> CommandChannel:
    """Follower: map this rank's mirror and serve the leader's staging commands on a thread of its own."""
    mine = paths[runner.tp.rank] if len(paths) > 1 else paths[0]  # (one mirror: every rank's KV is the same)
    mirror = KvMirror(runner.kv_pool, _shared_buffers(mine, runner.kv_pool.buffers(), False))
    channel = CommandChannel(runner.tp)
    runner.tp.all_min(0)

    def handle(command: tuple) -> None:
        op, first, second = command  # ("out", pool pages, mirror pages) or ("in", mirror pages, pool pages)
        with torch.inference_mode():  # the mapping was made inside the step loop's inference mode
            (mirror.stage_out if op == "out" else mirror.stage_in)(first, second)
    def serve() -> None:
        if runner.device.type == "cuda":
            torch.cuda.set_device(runner.device)  # per thread: copies go to this rank's GPU's default stream
        channel.serve(handle)
    threading.Thread(target=serve, name="radixmesh-kv-stage", daemon=True).start()
    return channel
