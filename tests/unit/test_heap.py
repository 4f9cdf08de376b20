"""services.common.heap: a service process's collector is settled once it serves; other processes are untouched.
Each case runs in a fresh interpreter (freezing pytest's own heap would keep what the suite drops later)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_serving_without_opt_in_changes_nothing():
    out = _run("""
        import gc
        from radixmesh.services.common import heap
        before = gc.get_threshold()
        heap.serving()
        print(gc.get_freeze_count(), gc.get_threshold() == before)
    """)
    assert out == "0 True"


def test_opted_in_process_freezes_its_start_up_heap_once_and_still_collects_cycles():
    out = _run("""
        import gc, weakref
        from radixmesh.services.common import heap
        heap.opt_in()
        heap.serving()
        frozen = gc.get_freeze_count()
        heap.serving()  # a second call (the router's gRPC port after its HTTP site) changes nothing
        class Node: pass
        a, b = Node(), Node()
        a.other, b.other = b, a
        alive = weakref.ref(a)
        del a, b
        gc.collect()
        print(frozen > 1000, gc.get_freeze_count() == frozen, gc.get_threshold()[0], alive() is None)
    """)
    assert out == f"True True {20_000} True"
