"""`--router-workers N`: router processes on one port under a supervisor, with the tokenizer service and fake
workers as real processes. What one process learns the others know (workers added or removed at run time, health,
cache-aware routes); /metrics answers for all of them; a killed process is replaced with the shared registry, and
clients of the other process see nothing."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
import time
import urllib.request

import pytest

from radixmesh.services.router.supervisor import merge_expositions
from tests.services.metrics_utils import http_get, scrape, stop
from tests.services.test_router_resilience import KEY, Mesh, generate, mesh, post, tokenizer  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")


def children(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.add(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found


def routers(m: Mesh) -> set[int]:
    """The supervisor's router processes."""
    return children(m.procs[-1].pid)


DYING_MARGIN_S = 0.05


def _exited(pid: int) -> bool:
    """The process's sockets are closed: it is gone, or every thread of it is a zombie. Not "/proc/PID/fd is empty":
    an exiting process's file table is detached (and shows empty) before the files in it are closed, and for the
    few ms its sockets take to close, a connection the kernel hands its listening socket is reset."""
    try:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                states.append(fh.read().rpartition(")")[2].split()[0])
    except OSError:
        return True
    return all(state in "ZX" for state in states)


def serving(m: Mesh) -> int:
    """How many router processes serve and answer scrapes, by the supervisor's count (a forked process takes a while
    to import, bind and say hello; a test that starts before would see only one)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{m.metrics_port}/metrics", timeout=10) as r:
            return int(r.headers["X-Router-Processes"])
    except OSError:
        return 0


def readiness(base: str, times: int = 12) -> list[int]:
    """Colocated workers each of `times` fresh connections sees (each may land on either process)."""
    out = []
    for _ in range(times):
        status, body = http_get(base + "/readiness")
        out.append(__import__("json").loads(body)["healthy_workers"]["colocated"])
    return out


def wait_until(check, timeout_s: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_registry_health_and_metrics_are_shared(mesh):
    first = mesh.worker(wait=False)
    second_port_worker = mesh.worker(wait=False)
    mesh.workers.remove(second_port_worker)  # the router starts with the first only
    base = mesh.router("--router-workers", "2", "--health-check-interval-secs", "0.3",
                       "--health-failure-threshold", "1", "--health-success-threshold", "1")
    wait_until(lambda: serving(mesh) == 2, what="two router processes serving")
    req = urllib.request.Request(f"{base}/add_worker?url={second_port_worker}", method="POST",
                                 headers={"Authorization": f"Bearer {KEY}"})
    assert urllib.request.urlopen(req, timeout=30).status == 200
    wait_until(lambda: readiness(base) == [2] * 12, what="both processes to have the added worker")
    # a dead worker: process 0 probes it and tells process 1, so no process routes to it
    victim = mesh.procs[1]
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    wait_until(lambda: readiness(base) == [1] * 12, what="both processes to see the worker down")
    for _ in range(10):
        status, body, _ = generate(base)
        assert status == 200, body
    # removal reaches both
    req = urllib.request.Request(f"{base}/remove_worker?url={second_port_worker}", method="POST",
                                 headers={"Authorization": f"Bearer {KEY}"})
    assert urllib.request.urlopen(req, timeout=30).status == 200
    wait_until(lambda: readiness(base) == [1] * 12, what="removal")
    assert first in mesh.workers
    # /metrics on the API port and on --metrics-port: both processes' samples, each labelled
    for s in (scrape(int(base.rsplit(":", 1)[1]), headers={"Authorization": f"Bearer {KEY}"}),
              scrape(mesh.metrics_port)):
        # (which process took the 10 requests is the kernel's choice: only the sum is certain)
        assert s.labels("process_cpu_seconds_total", "router_process") == {"0", "1"}, s.text[:2000]
        assert s.value("sgl_router_requests_total") >= 10, s.text[:2000]
    if shutil.which("promtool"):
        text = http_get(f"http://127.0.0.1:{mesh.metrics_port}/metrics")[1]
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True)
        assert b"error" not in check.stderr.lower(), check.stderr.decode()


def test_cache_aware_routes_are_shared(mesh):
    """A prefix-heavy workload over fresh connections (spread over both processes): after each prefix's first
    request, every later one is a prefix hit on whichever process it lands, and goes to the same worker."""
    a, b = mesh.worker(wait=False), mesh.worker(wait=False)
    base = mesh.router("--router-workers", "2", "--policy", "cache_aware")
    wait_until(lambda: serving(mesh) == 2, what="two router processes serving")
    prefixes = [f"conversation {i}: " + " ".join(f"word{i}x{j}" for j in range(60)) for i in range(6)]
    for rnd in range(5):
        for p in prefixes:
            status, body, _ = post(base, "/generate", {"text": p + f" turn {rnd}",
                                                       "sampling_params": {"max_new_tokens": 2}})
            assert status == 200, body
            time.sleep(0.1)  # routes reach the sibling within a few ms (more on a loaded CI machine)
    s = scrape(mesh.metrics_port)
    hits, misses = s.value("sgl_router_cache_hits_total"), s.value("sgl_router_cache_misses_total")
    assert s.labels("sgl_router_cache_hits_total", "router_process") == {"0", "1"}
    served = {p: s.value("sgl_router_cache_hits_total", router_process=p) +
              s.value("sgl_router_cache_misses_total", router_process=p) for p in ("0", "1")}
    assert min(served.values()) > 0, served  # both processes took requests
    # each conversation's first request misses; without shared routes about half the later ones would too (the
    # process they land on never saw it): a slack of 2 for a route still in flight on a loaded machine
    assert misses <= len(prefixes) + 2 and hits >= 4 * len(prefixes) - 2, (hits, misses, served)
    calls = [mesh.calls(a), mesh.calls(b)]
    assert sum(calls) == 30 and min(calls) > 0, calls


def test_killed_process_is_replaced(mesh):
    mesh.worker(wait=False)
    extra = mesh.worker(wait=False)
    mesh.workers.remove(extra)
    base = mesh.router("--router-workers", "2")
    wait_until(lambda: serving(mesh) == 2, what="two router processes serving")
    req = urllib.request.Request(f"{base}/add_worker?url={extra}", method="POST",
                                 headers={"Authorization": f"Bearer {KEY}"})
    assert urllib.request.urlopen(req, timeout=30).status == 200
    wait_until(lambda: readiness(base) == [2] * 12, what="both processes to have the added worker")
    before = routers(mesh)
    victim = max(before)
    stop_at = time.monotonic() + 4.0
    results: list[tuple[float, int]] = []  # (when the request started, its status or -1)

    def client() -> None:  # keep-alive-free requests, as many as fit, from before the kill to after the restart
        while time.monotonic() < stop_at:
            started = time.monotonic()
            try:
                results.append((started, generate(base)[0]))
            except OSError:
                results.append((started, -1))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client) for _ in range(4)]
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: _exited(victim), timeout_s=10, what="the killed process to exit")
        gone = time.monotonic()  # its listening socket is closed: new connections go to the other process
        for f in futures:
            f.result()
    wait_until(lambda: len(routers(mesh)) == 2 and victim not in routers(mesh) and serving(mesh) == 2,
               what="a replacement process")
    assert "exited with status -9; starting another" in mesh.log.read_text()
    # Requests in flight on the killed process fail (their connections die), and so may connections that reached
    # its accept queue while it was dying; a request started after it exited may not. "After" with a margin: runs
    # saw connections reset up to ~10 ms after every thread of the victim was a zombie (the kernel still handed
    # them to its closing socket), never later.
    late = [(round(t - gone, 3), r) for t, r in results if r != 200 and t > gone + DYING_MARGIN_S]
    assert not late and len(results) > 20, (len(results), late)
    assert any(t > gone + DYING_MARGIN_S for t, r in results), "no request after the kill: nothing was tested"
    # the replacement has the worker added at run time before it was born, and serves
    wait_until(lambda: readiness(base) == [2] * 12, what="the replacement to have the added worker")
    for _ in range(10):
        assert generate(base)[0] == 200
    assert stop(mesh.procs.pop()) == 0  # the supervisor drains both and exits cleanly
    assert not (before | routers(mesh)) & {int(p) for p in os.listdir("/proc") if p.isdigit()}


def test_merge_expositions_groups_families():
    merged = merge_expositions({
        1: '# HELP a_total A\n# TYPE a_total counter\na_total{x="1"} 2.0\n# HELP b B\n# TYPE b gauge\nb 3.0\n',
        0: '# HELP a_total A\n# TYPE a_total counter\na_total{x="1"} 5.0\n# HELP b B\n# TYPE b gauge\nb 1.0\n'})
    assert merged.decode().splitlines() == [
        "# HELP a_total A", "# TYPE a_total counter", 'a_total{router_process="0",x="1"} 5.0',
        'a_total{router_process="1",x="1"} 2.0', "# HELP b B", "# TYPE b gauge", 'b{router_process="0"} 1.0',
        'b{router_process="1"} 3.0']
