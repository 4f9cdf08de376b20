"""Host tensors in shared-memory files: under tensor parallelism the leader creates one, each follower maps it too,
and the leader then reads and writes its followers' host buffers directly (the KV transfer mirrors of
engine.disaggregation.mirror; the host KV pool when an L3 store is on, engine.cache.host_pool). The leader unlinks the
name once every rank mapped it, so nothing is left in /dev/shm whichever process dies first."""

from __future__ import annotations

import os
import tempfile
import uuid

import torch


def _folder() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def new_path(what: str) -> str:
    """A fresh file name in /dev/shm (or the temporary directory where there is none)."""
    return os.path.join(_folder(), f"radixmesh-{what}-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def ours(path: str) -> bool:
    """Whether `path` names a file `new_path` or `lasting_path` made (in this process or another)."""
    return os.path.dirname(path) == _folder() and os.path.basename(path).startswith("radixmesh-")


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid").removeprefix("pid:[").removesuffix("]")
    except OSError:
        return "0"


def lasting_path(what: str) -> str:
    """A fresh file name in /dev/shm for a file whose name must last while its creator runs (a peer opens it by
    name: the shm KV transfer backend's mirror and index). A creator that is killed cannot unlink it; the name says
    which process (and pid namespace) made it, so `sweep_orphans` can remove it later."""
    return new_path(f"lasting-{_pid_namespace()}-{what}")


def sweep_orphans() -> list[str]:
    """Unlink the lasting files whose creator, a process of this pid namespace, is gone; returns their paths. Files
    of other namespaces (another container sharing /dev/shm) are left alone: their pids mean nothing here."""
    where = _folder()
    prefix = f"radixmesh-lasting-{_pid_namespace()}-"
    removed = []
    for name in os.listdir(where):
        if not name.startswith(prefix):
            continue
        try:
            pid = int(name.rsplit("-", 2)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            unlink([os.path.join(where, name)])
            removed.append(os.path.join(where, name))
        except (ValueError, IndexError, PermissionError):  # not ours to judge: another user's live process
            continue
    return removed


_CREATED: set[str] = set()  # files this process created and has not unlinked yet


def created() -> set[str]:
    """The files this process created and has not unlinked yet (a failed start unlinks those it made)."""
    return set(_CREATED)


def shared_tensor(path: str, numel: int, dtype: torch.dtype, create: bool) -> torch.Tensor:
    """A flat tensor over the file `path` (created, with its memory reserved, when `create`)."""
    if create:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        _CREATED.add(path)
        with open(path, "wb") as f:
            try:  # reserved now: a sparse file on a full tmpfs would fail later, with SIGBUS mid-copy
                os.posix_fallocate(f.fileno(), 0, nbytes)
            except OSError as e:
                raise RuntimeError(f"cannot reserve {nbytes / 2**20:.0f} MiB of shared memory in "
                                   f"{os.path.dirname(path)} ({e.strerror}): give the worker more (docker "
                                   "--shm-size, a Memory emptyDir at /dev/shm in Kubernetes)") from None
    return torch.from_file(path, shared=True, size=numel, dtype=dtype)


def unlink(paths) -> None:
    for p in paths:
        _CREATED.discard(p)
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
