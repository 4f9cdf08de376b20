"""What `python -m radixmesh.benchmarks.soak` samples from outside the load: each service process's memory, file
descriptors and threads (Linux /proc), and each worker's KV pool from the router's /get_server_info.

Services are the launcher's children (named by their module: tokenizer, worker-0, worker-1, ..., router, kvstore,
in start order) and, where a service has processes of its own (router replicas of --router-workers, tensor-parallel
ranks), their children as `<service>.<i>`."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import aiohttp

MODULE_NAMES = {"radixmesh.services.tokenizer": "tokenizer", "radixmesh.services.worker": "worker",
                "radixmesh.services.router": "router", "radixmesh.services.kvstore": "kvstore"}


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # the fields after "pid (comm)": state, ppid, ...


def children(pid: int) -> list[int]:
    """The live children of `pid`, in start order (by start time, then pid)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            f = _stat_fields(int(entry))
            if f is not None and int(f[1]) == pid and f[0] != "Z":
                found.append((int(f[19]), int(entry)))  # field 22 of stat: starttime in clock ticks
    return [p for _, p in sorted(found)]


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _module(pid: int) -> str | None:
    argv = _cmdline(pid)
    return argv[argv.index("-m") + 1] if "-m" in argv[:-1] else None


def services(launcher: int) -> dict[str, int]:
    """{name: pid} of the launcher (as "launcher"), its service processes and their own children; given a service
    started alone instead of a launcher, that service and its children."""
    if _module(launcher) in MODULE_NAMES:
        name = MODULE_NAMES[_module(launcher)]
        return {name: launcher, **{f"{name}.{i}": sub for i, sub in enumerate(children(launcher))}}
    named, seen = {"launcher": launcher}, Counter()
    for pid in children(launcher):
        module = _module(pid) or f"pid{pid}"
        base = MODULE_NAMES.get(module, module.rsplit(".", 1)[-1])
        name = f"{base}-{seen[base]}" if base == "worker" or seen[base] else base
        seen[base] += 1
        named[name] = pid
        for i, sub in enumerate(children(pid)):
            named[f"{name}.{i}"] = sub
    return named


def process_stats(pid: int) -> dict | None:
    """{pid, rss_mib, fds, threads} of a live process; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kib = int(fields.get("VmRSS", "0 kB").split()[0])
    return {"pid": pid, "rss_mib": round(rss_kib / 1024, 1), "fds": fds, "threads": int(fields["Threads"])}


def listening_pid(port: int) -> int | None:
    """The process listening on TCP `port` (IPv4 or IPv6) among those this user may inspect."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    for entry in filter(str.isdigit, os.listdir("/proc")) if inodes else ():
        try:
            if any(os.readlink(f"/proc/{entry}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{entry}/fd")):
                return int(entry)
        except OSError:
            continue
    return None


def launcher_of(router_pid: int) -> int:
    """The launcher above a router process (through a --router-workers supervisor); the router itself when it
    was started alone."""
    pid = router_pid
    for _ in range(3):
        f = _stat_fields(pid)
        parent = int(f[1]) if f else 0
        if parent <= 1:
            break
        if _module(parent) == "radixmesh.services.launch" or any(a.endswith("radixmesh") for a in _cmdline(parent)[:2]):
            return parent
        pid = parent
    return router_pid


async def worker_kv(session: aiohttp.ClientSession, base_url: str) -> list[dict]:
    """Per worker: url, used_tokens (held by requests: the pool less free and evictable cached tokens, as
    sglang:num_used_tokens), total_tokens, running, waiting and evicted_tokens (cumulative); error for a worker
    that did not answer. Raises aiohttp.ClientError or ValueError when the router does not answer."""
    async with session.get(base_url + "/get_server_info", timeout=aiohttp.ClientTimeout(total=30)) as resp:
        resp.raise_for_status()
        info = await resp.json()
    out = []
    for w in info.get("workers") or []:
        if "error" in w:
            out.append({"url": w.get("url"), "error": w["error"]})
            continue
        state = (w.get("internal_states") or [{}])[0]
        total = w["max_total_num_tokens"]
        out.append({"url": w.get("url"), "used_tokens": total - w["available_kv_tokens"], "total_tokens": total,
                    "running": state.get("running"), "waiting": state.get("waiting"),
                    "evicted_tokens": state.get("evicted_tokens")})
    return out
