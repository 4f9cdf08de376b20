"""benchmarks.thread_cpu: CPU per thread of a process tree, labelled by service (`python -m NAME`) and thread."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from radixmesh.benchmarks import thread_cpu


def _burn(seconds: float, burnt: threading.Event, release: threading.Event) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    burnt.set()
    release.wait()  # a thread that has exited is no longer in /proc: it stays until the last snapshot


def test_threads_and_children_are_found_and_labelled():
    before = thread_cpu.snapshot(os.getpid())
    # The child burns, then waits for a line on stdin, so it cannot exit before the loop below has seen it: while
    # `_burn` holds the GIL, one snapshot of a loaded machine's /proc can take longer than the child's whole run.
    child = subprocess.Popen([sys.executable, "-m", "timeit", "-n", "1", "-r", "1", "-s", "import sys",
                              "sum(range(3 * 10**7)); sys.stdin.readline()"],
                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    burnt, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=_burn, args=(0.3, burnt, release))
    worker.start()
    deadline = time.monotonic() + 20  # until the child has exec'd (on a loaded machine that can take a while)
    during = thread_cpu.snapshot(os.getpid())  # counted while it runs, labelled once it runs `-m timeit`
    while not any(label == "timeit" for label, _, _ in during) and time.monotonic() < deadline:
        time.sleep(0.02)
        during = thread_cpu.snapshot(os.getpid())
    burnt.wait()
    child.communicate(b"\n", timeout=60)
    rows = thread_cpu.per_token(before, thread_cpu.snapshot(os.getpid()), tokens=1000)
    release.set()
    worker.join()
    assert any(label == "timeit" for label, _, _ in during)
    mine = [r for r in rows if r["service"] != "timeit" and r["thread"] != "main"]
    assert mine and mine[0]["thread"] == "other1" and mine[0]["cpu_s"] >= 0.25
    assert abs(mine[0]["us_per_token"] - mine[0]["cpu_s"] / 1000 * 1e6) < 1.0
    assert rows == sorted(rows, key=lambda r: -r["cpu_s"])
