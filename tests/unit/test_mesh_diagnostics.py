"""The tools that say where a loaded mesh's time goes (issue 50): benchmarks.spy_summary sums a py-spy raw profile by
thread and function; benchmarks.load_timeline reads the launcher's Prometheus targets and the gauges that say where
requests wait (here against real prometheus_client endpoints)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from radixmesh.benchmarks import load_timeline, spy_summary
from radixmesh.services.launch import free_port

RAW = """\
thread (0x7f01): radixmesh-scheduler;Thread.run (threading.py:982);Scheduler.step (scheduler.py:141);forward (model.py:12) 60
thread (0x7f01): radixmesh-scheduler;Thread.run (threading.py:982);Scheduler.step (scheduler.py:141);sample (s.py:3) 20
thread (0x7f02): MainThread;run (runners.py:118);deliver (engine.py:300) 15
thread (0x7f03): radixmesh-prep_0;_worker (thread.py:89) 3
thread (0x7f04): radixmesh-prep_1;_worker (thread.py:89) 2
not a stack line
"""


def test_spy_summary_shares_by_thread_and_function(tmp_path):
    path = tmp_path / "gil.txt"
    path.write_text(RAW)
    rows = spy_summary.parse(str(path))
    assert len(rows) == 5 and rows[0][0] == "radixmesh-scheduler" and rows[0][2] == 60
    assert rows[0][1][-1] == "forward (model.py)"  # line numbers dropped: one function, one entry
    text = spy_summary.summarize(rows, top=4)
    lines = text.splitlines()
    assert lines[0] == "100 samples"
    assert lines[1] == " 80.0%  radixmesh-scheduler"
    assert "self  60.0%  forward (model.py)" in text and "self  20.0%  sample (s.py)" in text
    assert "incl  80.0%" not in text  # a frame on every one of the thread's samples (its root) is not listed
    assert "  5.0%  radixmesh-prep_*" in text  # a pool's threads under one name


def _serve(metrics: dict[str, float], labels: dict[str, str] | None = None) -> str:
    registry = CollectorRegistry()
    for name, value in metrics.items():
        g = Gauge(name, "test", list(labels or {}), registry=registry)
        (g.labels(**labels) if labels else g).set(value)
    port = free_port()
    start_http_server(port, "127.0.0.1", registry=registry)
    return f"127.0.0.1:{port}"


def test_load_timeline_samples_where_requests_wait(tmp_path):
    router = _serve({"sgl_router_running_requests": 7}, {"worker": "w0"})
    worker = _serve({"radixmesh:worker_active_requests": 7, "sglang:num_queue_reqs": 2, "sglang:num_running_reqs": 4})
    targets = tmp_path / "targets.json"
    targets.write_text(json.dumps([{"targets": [router], "labels": {"service": "router"}},
                                   {"targets": [worker], "labels": {"service": "worker-0"}},
                                   {"targets": ["127.0.0.1:1"], "labels": {"service": "launcher"}}]))
    row = load_timeline.sample(load_timeline.read_targets(str(targets)))
    assert row["in_flight"] == 7 and row["worker-0"] == {"held": 7, "queued": 2, "running": 4}
    summary = load_timeline.summary([row, {"t": 0, "in_flight": 0}])
    assert summary["busy_samples"] == 1 and summary["worker-0.before_scheduler"] == {"mean": 1.0, "max": 1}
    out = tmp_path / "load.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "radixmesh.benchmarks.load_timeline", "--targets", str(targets),
                             "--interval", "0.05", "--output", str(out)], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (out.exists() and len(out.read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(2)
    printed, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and json.loads(printed)["in_flight"] == {"mean": 7.0, "max": 7.0}

