"""The processes of a tensor-parallel engine (engine.distributed): the leader (rank 0, inside the Engine) starts the
other ranks of its node; every other node starts all of its ranks with `serve_node` (same flags, its --node-rank).

A follower process runs its ModelRunner's `follow` loop. It dies with its parent (PR_SET_PDEATHSIG), and a rank
that fails or stops answering ends the collectives of the others within --dist-timeout, so a broken group never
leaves a process behind: the leader's scheduler fails, the worker reports unhealthy and exits."""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

from radixmesh.engine import forked as forked_client
from radixmesh.engine.config import EngineArgs
from radixmesh.engine.lifetime import die_with_parent

from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.distributed import TPConfig, free_local_addr, local_ranks, rank_device

log = logging.getLogger(__name__)

DEFAULT_DIST_TIMEOUT_S = 600.0
_JOIN_TIMEOUT_S = 30.0


def tp_config(args: EngineArgs, rank: int, addr: str) -> TPConfig:
    return TPConfig(size=args.tp_size, rank=rank, init_addr=addr,
                    timeout_s=float(args.dist_timeout or DEFAULT_DIST_TIMEOUT_S), expert_parallel=args.ep_size > 1)


def rank_args(args: EngineArgs, rank: int) -> EngineArgs:
    """`args` for global rank `rank`: its own GPU (base_gpu_id + local rank * gpu_id_step)."""
    return dataclasses.replace(args, device=rank_device(args.device, rank, args.tp_size, args.nnodes,
                                                        args.base_gpu_id, args.gpu_id_step))


class _ForkedRank:
    """A follower forked by the fork server (engine.forked), answering as the multiprocessing.Process it replaces
    does for what Followers uses. It dies with this process (the server's rule for its requester's services)."""

    def __init__(self, forked: forked_client.Forked, name: str):
        self.forked, self.name, self.pid = forked, name, forked.pid
        self.sentinel = forked.fileno()

    @property
    def exitcode(self) -> int | None:
        return self.forked.poll()

    def is_alive(self) -> bool:
        return self.forked.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.forked.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.forked.kill()


def _start_rank(args: EngineArgs, rank: int, addr: str, ctx):
    """Rank `rank`'s follower process: forked from the fork server RADIXMESH_FORK_SERVER names (engine.forked: it
    has imported torch already, most of a CPU rank's start) where there is one and the ranks run on the CPU (a
    server never touches CUDA, but a GPU rank is no place to try it); else a fresh `spawn` process."""
    server = os.environ.get(forked_client.ENV)
    if server and str(args.device).startswith("cpu"):
        payload = pickle.dumps((args, rank, addr)).hex()
        got = forked_client.spawn(server, ["radixmesh.engine.tp_worker", "--forked-rank", payload], dict(os.environ))
        if isinstance(got, forked_client.Forked):
            return _ForkedRank(got, f"radixmesh-tp{rank}")
        log.info("tensor parallel rank %d: not forked (%s); started afresh", rank, got)
    proc = ctx.Process(target=_follower_main, args=(args, rank, addr, os.getpid()), name=f"radixmesh-tp{rank}",
                       daemon=True)
    proc.start()
    return proc


class Followers:
    """This node's follower processes."""

    def __init__(self, args: EngineArgs, ranks: list[int], addr: str):
        ctx = mp.get_context("spawn")
        self.procs = [_start_rank(rank_args(args, r), r, addr, ctx) for r in ranks]
        self.stopping = False  # set before they are told to stop: their exit is then no failure

    def watch(self, on_exit: Callable[[str], None]) -> None:
        """Call `on_exit(reason)` (on a thread of its own) as soon as a follower exits unasked. A collective with a
        dead peer can wait out the whole --dist-timeout before it fails; the process's exit is known at once."""
        def wait() -> None:
            ended = mp_connection.wait([p.sentinel for p in self.procs])
            if self.stopping:
                return
            dead = next(p for p in self.procs if p.sentinel in ended)
            dead.join(1)
            deadline = time.monotonic() + 1  # another thread may be reaping it: its exit code lands there
            while dead.exitcode is None and time.monotonic() < deadline:
                time.sleep(0.01)
            on_exit(f"tensor parallel rank {dead.name.removeprefix('radixmesh-tp')} exited (code {dead.exitcode})")

        threading.Thread(target=wait, name="radixmesh-tp-watch", daemon=True).start()

    def join(self, timeout: float = _JOIN_TIMEOUT_S) -> None:
        """Wait for the followers to leave (after the leader's stop), killing any that do not."""
        self.stopping = True
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                log.warning("tensor parallel rank %s did not stop in %.0f s; killing it", p.name, timeout)
                p.kill()
                p.join(5)


def start_leader(args: EngineArgs) -> tuple[TPConfig, Followers | None]:
    """For the Engine (node 0, rank 0): start this node's other ranks; returns the leader's TPConfig."""
    if args.tp_size == 1:
        return TPConfig(), None
    if args.node_rank != 0:
        raise ValueError(f"node_rank {args.node_rank} runs tensor-parallel followers only: start it with the same "
                         "flags (a worker service or `python -m radixmesh.engine.tp_worker`) and it serves them")
    addr = args.dist_init_addr or free_local_addr()
    ranks = list(local_ranks(args.tp_size, args.nnodes, 0))
    if args.enable_p2p_check:
        from radixmesh.engine.distributed import check_peer_access

        check_peer_access([rank_args(args, r).device for r in ranks])
    return tp_config(args, 0, addr), Followers(args, ranks[1:], addr)


def serve_node(args: EngineArgs) -> int:
    """A node other than 0: run its ranks until the leader stops them (or the group fails). The exit code."""
    ranks = list(local_ranks(args.tp_size, args.nnodes, args.node_rank))
    followers = Followers(args, ranks, args.dist_init_addr)
    codes = []
    for p in followers.procs:
        p.join()
        codes.append(p.exitcode)
    return next((c for c in codes if c), 0)


def _follower_main(args: EngineArgs, rank: int, addr: str, parent: int | None) -> None:
    """A follower's life. `parent`: the leader's pid, whose death kills it (None when forked by the fork server,
    whose services die with their requester already)."""
    if parent is not None:
        die_with_parent(parent)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints where a stuck rank waits
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s")
    from radixmesh.engine.model_runner import ModelRunner

    runner = None
    try:
        runner = ModelRunner(args, ModelConfig.from_path(args.model_path, args.revision), tp_config(args, rank, addr))
        runner.follow()
    except Exception:
        log.exception("tensor parallel rank %d failed", rank)
        sys.exit(1)
    finally:
        if runner is not None:
            runner.tp.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m radixmesh.engine.tp_worker --model-path ... --tp 4 --nnodes 2 --node-rank 1
    --dist-init-addr host:port`."""
    import argparse

    from radixmesh.engine.config import resolve_args
    from radixmesh.settings import add_settings, resolve

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--forked-rank"]:  # a follower the fork server forked for a leader (_start_rank)
        _follower_main(*pickle.loads(bytes.fromhex(argv[1])), None)
        return 0
    parser = argparse.ArgumentParser(description="the tensor-parallel ranks of one node other than node 0")
    add_settings(parser, EngineArgs)
    kwargs = resolve(parser.parse_args(argv), EngineArgs)[0]
    args = EngineArgs.from_kwargs(**kwargs)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve_node(resolve_args(args, ModelConfig.from_path(args.model_path, args.revision)))


if __name__ == "__main__":
    sys.exit(main())
