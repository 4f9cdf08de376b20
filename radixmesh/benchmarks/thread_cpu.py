"""CPU time per thread of a process tree, from Linux's /proc: which thread of which service spent what during a timed
run (benchmarks.serving --thread-cpu). A worker runs its event loop (gRPC, detokenization, protobuf) on the main
thread and the scheduler on another, under one GIL; the split shows what the serving path costs the scheduler's
process per token.
"""

from __future__ import annotations

import os
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _children_map() -> dict[int, list[int]]:
    """Parent pid -> its children's pids, for every process now."""
    out: dict[int, list[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out.setdefault(ppid, []).append(int(proc.name))
    return out


def _label(pid: int, root: int) -> str:
    """The service a process runs (`python -m radixmesh.services.worker ...` -> worker), else `root` or the pid."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return str(pid)
    for i, arg in enumerate(argv[:-1]):
        if arg == b"-m":
            return argv[i + 1].decode().removeprefix("radixmesh.services.")
    return "root" if pid == root else str(pid)


def snapshot(root: int) -> dict[tuple[str, int, int], float]:
    """(service, pid, tid) -> CPU seconds (user + system) so far, for `root` and all its descendants."""
    out: dict[tuple[str, int, int], float] = {}
    children = _children_map()
    todo = [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        label = _label(pid, root)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[(label, pid, int(task.name))] = (int(fields[11]) + int(fields[12])) * TICK_S
    return out


def per_token(before: dict, after: dict, tokens: int, min_share: float = 0.01) -> list[dict]:
    """Each thread's CPU between the snapshots, busiest first: `thread` is `main` (the process's first thread,
    where asyncio runs) or `other1`, `other2`, ... by CPU within its process. Threads under `min_share` of the
    total are left out."""
    rows = []
    for key, cpu in after.items():
        used = cpu - before.get(key, 0.0)
        if used > 0:
            rows.append((key, used))
    total = sum(u for _, u in rows) or 1.0
    rank: dict[int, int] = {}
    out = []
    for (label, pid, tid), used in sorted(rows, key=lambda r: -r[1]):
        if tid == pid:
            name = "main"
        else:
            rank[pid] = rank.get(pid, 0) + 1
            name = f"other{rank[pid]}"
        if used / total >= min_share:
            out.append({"service": label, "thread": name, "cpu_s": round(used, 3),
                        "us_per_token": round(used / max(tokens, 1) * 1e6, 1)})
    return out
