"""Tensor parallelism: one engine spread over `tp_size` ranks (processes), each holding a slice of every weight.

Design: rank 0 is the leader. It owns the scheduler, the radix cache, sampling, grammars and every decision; the
other ranks are followers that only run forwards. Before each forward the leader publishes the batch (its int64
fields, after overlap scheduling filled in the tokens still on the device) and its step journal: the
request-to-token table writes and the host-tier copies (hierarchical cache) made since the last one (ModelRunner
`_publish`); each follower replays them on its own table and its own host pool, so its page table and its KV
shard's pages equal the leader's, and runs the same forward on its slice of the heads and of the MLP. Only the leader
samples: logits are all-gathered to every rank (the gather is part of the forward), so nothing else needs to agree.
Why not every rank scheduling identically: arrivals, aborts, KV transfers and cache I/O finish at times no two
processes see alike, and one divergent decision corrupts the KV cache; a broadcast batch cannot diverge.

Two process groups: `group` on the device (NCCL on GPUs, gloo on CPU) for the collectives inside the forward and
the batch tensors, `cpu_group` (gloo) for the small pickled step headers. Ranks are numbered node by node:
node k runs ranks k*tp/nnodes .. (k+1)*tp/nnodes - 1, on GPUs base_gpu_id + local_rank * gpu_id_step.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class GroupFailed(RuntimeError):
    """A collective of the tensor-parallel group failed (a rank died, hung past the timeout, or failed): the ranks
    no longer agree on anything, so the engine stops (its scheduler raises this instead of going on)."""


def _collective(fn):
    def run(self, *args, **kwargs):
        if self.size == 1:
            return fn(self, *args, **kwargs)
        try:
            return fn(self, *args, **kwargs)
        except Exception as e:  # gloo/NCCL errors: RuntimeError, DistBackendError, DistNetworkError, ...
            raise GroupFailed(f"tensor parallel rank {self.rank} of {self.size}: {e}") from e
    run.__name__, run.__doc__ = fn.__name__, fn.__doc__
    return run


@dataclass(frozen=True, slots=True)
class TPConfig:
    """Where one rank stands: its rank and the group's size, the rendezvous address, and the collectives' bound."""

    size: int = 1
    rank: int = 0
    init_addr: str | None = None  # host:port of rank 0's TCP store
    timeout_s: float = 600.0
    expert_parallel: bool = False  # mixture-of-experts layers: whole experts per rank, not shares of every one


RENDEZVOUS_MIN_S = 60.0


def forget_group() -> None:
    """After a failed init_process_group, or a start that failed after it (the leader's model did not load): the
    default group is destroyed, or, where none formed, its name counter reset. torch names the default group from a
    per-process counter that it bumps before the rendezvous, so a later group of this process would be named "1"
    where its fresh followers name theirs "0", and both would wait for keys the other never writes."""
    if dist.is_initialized():
        dist.destroy_process_group()
        return
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0


class TensorParallel:
    """One rank's view of its group; size 1 (no group at all) makes every collective a no-op."""

    @classmethod
    def single(cls) -> "TensorParallel":
        return cls(TPConfig(), torch.device("cpu"))

    def __init__(self, config: TPConfig, device: torch.device):
        self.config = config
        self.size, self.rank = config.size, config.rank
        self.group = self.cpu_group = None
        if self.size == 1:
            return
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=config.timeout_s)
        host, port = split_addr(config.init_addr)
        # The ranks meet through rank 0's TCP store, waiting for each other at least RENDEZVOUS_MIN_S: a follower can
        # take many seconds to start on a busy machine, and --dist-timeout bounds the collectives (a hung rank), not
        # that. A failed start resets what torch keeps per process, so a later group here can still form.
        join = datetime.timedelta(seconds=max(config.timeout_s, RENDEZVOUS_MIN_S))
        try:
            store = dist.TCPStore(host, int(port), self.size, is_master=self.rank == 0, timeout=join,
                                  wait_for_workers=True, multi_tenant=True)
            dist.init_process_group(backend, store=store, world_size=self.size, rank=self.rank, timeout=timeout,
                                    device_id=device if device.type == "cuda" else None)
        except BaseException:
            forget_group()
            raise
        self.group = dist.group.WORLD
        self.cpu_group = self.group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        log.info("tensor parallel rank %d of %d (%s) joined at %s:%s", self.rank, self.size, backend, host, port)

    # ---- collectives inside the forward --------------------------------------------------------------------------
    @_collective
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    @_collective
    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dimension (rank order)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    @_collective
    def all_min(self, value: int) -> int:
        """The smallest of every rank's `value` (sizes that must agree, such as the KV pool's)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    # ---- the leader's step messages --------------------------------------------------------------------------------
    @_collective
    def broadcast_object(self, obj: Any = None) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    @_collective
    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        dist.broadcast(x, src=0, group=self.group)
        return x

    @property
    def heartbeat_s(self) -> float:
        """How often an idle leader tells the followers it is alive. A follower waits for the next step in a
        collective bound by the timeout: an idle spell longer than that would otherwise fail the group."""
        return min(30.0, max(0.2, self.config.timeout_s / 4))

    def side_group(self):
        """A gloo group of the same ranks, for traffic beside the step loop (collective: every rank calls it at
        the same point of its step sequence)."""
        return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.config.timeout_s))

    def shard(self, n: int, what: str) -> tuple[int, int]:
        """(start, size) of this rank's equal share of `n` items; ValueError when they do not divide evenly."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) must be divisible by the tensor parallel size ({self.size})")
        size = n // self.size
        return self.rank * size, size

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


class CommandChannel:
    """Commands from the leader to every follower outside the step loop, on a gloo group of their own (staging KV
    pages for a transfer, engine.disaggregation.mirror, runs on the services' threads while steps go on). One at a
    time: the leader sends a command, every rank does its part, and all agree whether every rank succeeded.
    Followers serve it on a thread of their own (`serve`); an idle channel is pinged (`ping`) within the timeout."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp
        self.group = tp.side_group()
        self.lock = threading.Lock()
        self.last_used = time.monotonic()

    def _send(self, command: tuple | None) -> None:
        dist.broadcast_object_list([command], src=0, group=self.group)
        self.last_used = time.monotonic()

    def _agree(self, failed: bool) -> bool:
        """Whether any rank failed."""
        t = torch.tensor([int(failed)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def run(self, command: tuple, mine: Callable[[], None]) -> None:
        """Leader: every follower handles `command` while this rank runs `mine`; raises when any rank failed."""
        with self.lock:
            try:
                self._send(command)
                error = None
                try:
                    mine()
                except Exception as e:  # noqa: BLE001 - the others must still hear of it
                    error = e
                failed = self._agree(error is not None)
            except Exception as e:
                raise GroupFailed(f"tensor parallel command {command[0]!r}: {e}") from e
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"a tensor parallel rank failed command {command[0]!r} (see its log)")

    def ping(self) -> None:
        """Leader: keep an idle channel's followers from timing out (skipped while a command runs)."""
        if self.lock.acquire(blocking=False):
            try:
                self._send(("ping",))
                self._agree(False)
            finally:
                self.lock.release()

    def close(self) -> None:
        """Leader: end every follower's `serve`."""
        with self.lock:
            self._send(None)

    def serve(self, handle: Callable[[tuple], None]) -> None:
        """Follower: handle each command until the leader closes the channel or the group fails."""
        try:
            while True:
                box = [None]
                dist.broadcast_object_list(box, src=0, group=self.group)
                if box[0] is None:
                    return
                failed = False
                if box[0][0] != "ping":
                    try:
                        handle(box[0])
                    except Exception:  # noqa: BLE001 - reported to the leader, which fails the transfer
                        log.exception("tensor parallel rank %d: command %r failed", self.tp.rank, box[0][0])
                        failed = True
                self._agree(failed)
        except Exception as e:  # noqa: BLE001 - the step loop fails too and stops this process
            log.warning("tensor parallel rank %d: command channel closed: %r", self.tp.rank, e)


def split_addr(addr: str | None) -> tuple[str, int]:
    if not addr or ":" not in addr:
        raise ValueError(f"dist_init_addr must be host:port, got {addr!r}")
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def free_local_addr() -> str:
    """127.0.0.1:<a free port> for a group that lives on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def local_ranks(tp_size: int, nnodes: int, node_rank: int) -> range:
    """The global ranks node `node_rank` runs."""
    if tp_size % nnodes:
        raise ValueError(f"tp_size ({tp_size}) must be divisible by nnodes ({nnodes})")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank ({node_rank}) must be in [0, nnodes={nnodes})")
    per = tp_size // nnodes
    return range(node_rank * per, (node_rank + 1) * per)


def rank_device(device: str, rank: int, tp_size: int, nnodes: int, base_gpu_id: int, gpu_id_step: int) -> str:
    """The device of global rank `rank`: cpu, or the GPU base_gpu_id + local_rank * gpu_id_step of its node."""
    if not device.startswith("cuda"):
        return device
    local = rank % (tp_size // nnodes)
    return f"cuda:{base_gpu_id + local * gpu_id_step}"


def check_peer_access(devices: list[str]) -> None:
    """--enable-p2p-check: every pair of this node's GPUs can reach each other directly (NVLink or PCIe P2P)."""
    ids = [torch.device(d).index for d in devices if d.startswith("cuda")]
    bad = [(a, b) for a in ids for b in ids if a != b and not torch.cuda.can_device_access_peer(a, b)]
    if bad:
        raise RuntimeError(f"GPUs without peer access: {bad} (tensor parallelism would go through host memory)")
