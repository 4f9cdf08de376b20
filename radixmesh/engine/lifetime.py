"""A process tied to the one that started it: killed (SIGKILL) when that process dies, however it dies (Linux's
PR_SET_PDEATHSIG; a no-op where libc has no prctl). Tensor-parallel followers, the launcher's services (as a Popen
preexec_fn), the fork server's children and the serving benchmark's launched mesh use it."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> None:
    """Be killed when the parent dies. `parent`: its pid, checked after the prctl: a parent that died before it
    would never signal this process, so it exits at once instead."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if parent is not None and os.getppid() != parent:
        os._exit(1)
