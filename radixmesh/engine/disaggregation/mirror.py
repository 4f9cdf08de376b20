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
import logging
import threading
from typing import Sequence

import torch

from radixmesh.engine.cache.kv_pool import KVPool
from radixmesh.engine.disaggregation.kv_pages import pages_digest
from radixmesh.engine.disaggregation.transfer import page_runs
from radixmesh.engine.distributed import CommandChannel
from radixmesh.engine.shared_memory import lasting_path, new_path, shared_tensor, unlink

log = logging.getLogger(__name__)


def _by_page(t: torch.Tensor, page_size: int) -> torch.Tensor:
    return t.view(-1, page_size * t[0].numel())


MAX_RUNS = 8  # pages in more runs than this are gathered by index instead, one copy per buffer


def _copy_pages(sources: list[torch.Tensor], targets: list[torch.Tensor], pages: Sequence[int], size: int) -> None:
    """Page p of each source buffer into page p of its target (a pool and its mirror, either way). A request's pages
    are mostly a few runs of consecutive pages: each run is one direct copy between device and pinned host memory
    (DMA, no host-side gather). Waits for the device's copies to end."""
    runs = page_runs(pages, pages)
    if len(runs) <= MAX_RUNS:
        for src, dst in zip(sources, targets):
            src_pages, dst_pages = _by_page(src, size), _by_page(dst, size)
            for first, _, n in runs:
                dst_pages[first:first + n].copy_(src_pages[first:first + n], non_blocking=True)
    else:
        idx = torch.as_tensor(list(pages), dtype=torch.int64)
        for src, dst in zip(sources, targets):
            _by_page(dst, size)[idx.to(dst.device)] = _by_page(src, size)[idx.to(src.device)].to(dst.device)
    device = next((t.device for t in (*sources[:1], *targets[:1]) if t.is_cuda), None)
    if device is not None:
        torch.cuda.current_stream(device).synchronize()


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

    def stage_out(self, pages: Sequence[int]) -> None:
        """Copy the pool's `pages` into the mirror (no-op unless staged); returns once they are there."""
        if self.staged and len(pages):
            _copy_pages(self.pool.buffers(), self.local, pages, self.pool.page_size)

    def stage_in(self, pages: Sequence[int]) -> None:
        """Copy `pages` from the mirror into the pool (no-op unless staged); returns once they are there."""
        if self.staged and len(pages):
            _copy_pages(self.local, self.pool.buffers(), pages, self.pool.page_size)

    def checksum(self, pages: Sequence[int]) -> str:
        """A digest of the mirror's `pages` (what a transfer moves), every rank's."""
        return pages_digest(self.buffers, self.pool.page_size, pages)

    def close(self) -> None:
        unlink(self.paths)


class RankMirrors(KvMirror):
    """The leader's view under tensor parallelism: its own mirror plus every follower's, staged together."""

    def __init__(self, pool: KVPool, per_rank: list[list[torch.Tensor]], channel: CommandChannel):
        super().__init__(pool, per_rank[0])
        self.per_rank, self.channel = per_rank, channel
        self.tp_size = len(per_rank)

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [t for rank in self.per_rank for t in rank]

    def stage_out(self, pages: Sequence[int]) -> None:
        self.channel.run(("out", list(pages)), lambda: super(RankMirrors, self).stage_out(pages))

    def stage_in(self, pages: Sequence[int]) -> None:
        self.channel.run(("in", list(pages)), lambda: super(RankMirrors, self).stage_in(pages))


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
    paths = [new_path(f"kv-mirror-tp{r}") for r in range(runner.tp.size)]
    like = runner.kv_pool.buffers()
    try:
        per_rank = [_shared_buffers(p, like, create=True) for p in paths]
        runner.tp.broadcast_object(("kv_mirror", paths, None))
        channel = CommandChannel(runner.tp)
        runner.tp.all_min(0)  # every follower mapped its file: the names can go
    finally:
        unlink(paths)
    log.info("KV transfer mirrors for %d tensor parallel ranks (%.1f MiB each)", len(paths),
             sum(t.numel() * t.element_size() for t in like) / 2**20)
    return RankMirrors(runner.kv_pool, per_rank, channel)


def follow(runner, paths: list[str]) -> CommandChannel:
    """Follower: map this rank's mirror and serve the leader's staging commands on a thread of its own."""
    mirror = KvMirror(runner.kv_pool, _shared_buffers(paths[runner.tp.rank], runner.kv_pool.buffers(), False))
    channel = CommandChannel(runner.tp)
    runner.tp.all_min(0)

    def handle(command: tuple) -> None:
        op, pages = command
        with torch.inference_mode():  # the mapping was made inside the step loop's inference mode
            (mirror.stage_out if op == "out" else mirror.stage_in)(pages)
    def serve() -> None:
        if runner.device.type == "cuda":
            torch.cuda.set_device(runner.device)  # per thread: copies go to this rank's GPU's default stream
        channel.serve(handle)
    threading.Thread(target=serve, name="radixmesh-kv-stage", daemon=True).start()
    return channel
