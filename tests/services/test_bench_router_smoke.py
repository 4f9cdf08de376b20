"""`python -m radixmesh.benchmarks.router` with tiny counts, as a subprocess: every scenario runs against the real
router and tokenizer service with fake workers, every answer checks out, the JSON record is complete, and no process is
left behind. Asserts no speed (benchmarks measure; tests only guard the benchmark against rot)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid

import pytest

from radixmesh.benchmarks.router_scenarios import SCENARIOS
from tests.conftest import ROOT, model_path
from tests.e2e.mesh import alive

# Requests per measured run (non-streaming, streaming) and per --trace-ab round: enough for every scenario's answers
# to be checked and every CPU figure to be non-zero; the counts differ so that each is seen to reach its scenarios.
REQUESTS, STREAM_REQUESTS, AB_REQUESTS = 8, 6, 6
# A benchmark run's processes carry this variable (a fresh value per run) in their environment. RADIXMESH_*: the
# suite's fork server (tests/conftest.py) forks the services of a mesh the benchmark launches only where the
# environment differs from its own in such variables; any other name makes every service start afresh (~3-7 CPU-s
# each, the imports the server has done once).
TAG_ENV = "RADIXMESH_TEST_TAG"


def _tagged(tag: str) -> list[int]:
    """Processes whose environment carries `tag` (the benchmark's children inherit it)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as fh:
                    if tag.encode() in fh.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def _children(pid: int) -> set[int]:
    """Children of `pid`, every thread's, from /proc (zombies left out: they have exited)."""
    kids: set[int] = set()
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as fh:
                kids.update(int(p) for p in fh.read().split())
    return {p for p in kids if alive(p)}


def _forked() -> set[int]:
    """The services this test process's fork server runs now (a forked service's /proc environ is the server's,
    so it does not carry a benchmark's tag)."""
    servers = set()
    for pid in _children(os.getpid()):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as fh:
            if b"radixmesh.services.forkserver" in fh.read():
                servers.add(pid)
    return {kid for server in servers for kid in _children(server)}


class Leftovers:
    """What one benchmark run leaves behind: processes carrying its tag (`env`, given to the benchmark), and
    services the fork server forked during the run that still live."""

    def __init__(self) -> None:
        self.env = {TAG_ENV: uuid.uuid4().hex}
        self.forked_before = _forked()

    def found(self) -> list[int]:
        return _tagged(f"{TAG_ENV}={self.env[TAG_ENV]}") + sorted(_forked() - self.forked_before)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the benchmark pins the router to its own core")
def test_bench_router_smoke(tmp_path):
    model_path("tiny-llama")  # builds the tiny models if missing
    out = tmp_path / "router.json"
    left = Leftovers()
    proc = subprocess.run([sys.executable, "-m", "radixmesh.benchmarks.router", "--requests", str(REQUESTS),
                           "--stream-requests", str(STREAM_REQUESTS), "--warmup", "2", "--repeats", "2",
                           "--concurrency", "4", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **left.env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    for key in ("device", "date", "commit", "command"):
        assert doc[key], key
    assert doc["command"].startswith(f"python -m radixmesh.benchmarks.router --requests {REQUESTS}")
    assert doc["router_rss_mb"] > 0
    by_name = {r["scenario"]: r for r in doc["results"]}
    assert set(by_name) == {s.name for s in SCENARIOS}
    for sc in SCENARIOS:
        r = by_name[sc.name]
        assert r["errors"] == 0, r["error_examples"]
        assert r["requests"] == (STREAM_REQUESTS if sc.stream else REQUESTS)
        assert r["tokens_per_request"] == sc.tokens
        assert len(r["runs"]) == 2
        for key in ("wall_s", "requests_per_s", "router_cpu_s", "router_cpu_ms_per_request",
                    "router_cpu_us_per_token", "router_cpu_utilization", "p50_ms", "p99_ms"):
            assert r[key] > 0, (sc.name, key, r[key])
    assert "router_cpu_us_per_extra_token" in by_name["generate_stream_64"]
    assert "router_cpu_us_per_extra_token" in by_name["chat_stream_64"]
    assert sc.name in proc.stdout  # the table was printed
    assert not left.found(), "the benchmark left processes behind"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the benchmark pins the router to its own core")
def test_bench_router_trace_ab_over_router_pairs_smoke(tmp_path):
    """--trace-ab --pairs 2: two sets of routers (untraced, and traced at the default ratio) one after the other,
    their rounds pooled. One traced router a set: a second ratio would be one more router per set through the same
    code (the side-by-side test runs both default ratios)."""
    out = tmp_path / "ab.json"
    proc = subprocess.run([sys.executable, "-m", "radixmesh.benchmarks.router", "--trace-ab", "--pairs", "2",
                           "--trace-ratios", "default", "--scenarios", "generate_1", "--requests", str(AB_REQUESTS),
                           "--warmup", "1", "--repeats", "2", "--concurrency", "2", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (r,) = json.loads(out.read_text())["results"]
    assert (r["scenario"], r["sets"], r["rounds"], r["errors"]) == ("generate_1", 2, 4, 0)
    assert len(r["per_set"]) == 2 and all(p["rounds"] == 2 for p in r["per_set"])
    assert r["cpu_ms_per_request_off"] > 0 and set(r["traced"]) == {"default"}
    for t in r["traced"].values():
        assert t["cpu_ms_per_request_on"] > 0 and len(t["rounds_ratio"]) == 4 and len(t["per_set_cpu_change_pct"]) == 2
    assert "over 2 router sets" in proc.stdout


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the benchmark pins the router to its own core")
def test_bench_router_trace_ab_side_by_side_smoke(tmp_path):
    """--trace-ab --side-by-side: the untraced and the traced routers (the default --trace-ratios: the default
    ratio and 1.0) loaded at once in each round; every request answered, each router's CPU (its exporter thread's
    included) read over the round, the spans delivered."""
    out = tmp_path / "ab.json"
    proc = subprocess.run([sys.executable, "-m", "radixmesh.benchmarks.router", "--trace-ab", "--side-by-side",
                           "--scenarios", "generate_1", "--requests", str(AB_REQUESTS),
                           "--warmup", "1", "--repeats", "2", "--concurrency", "2", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    (r,) = doc["results"]
    assert (r["scenario"], r["rounds"], r["errors"], r["side_by_side"]) == ("generate_1", 2, 0, True)
    assert set(r["traced"]) == {"default", "1.0"}
    for traced in r["traced"].values():
        assert len(traced["rounds_ratio"]) == 2 and all(x > 0 for x in traced["rounds_ratio"])
    assert set(r["threads_cpu_s"]) == {"router", "router_traced_default", "router_traced_1.0"}
    assert "main" in r["threads_cpu_s"]["router"]
    # ratio 1.0: every measured and warm-up request of the traced router is a trace (a span or more each)
    assert doc["trace_delivery"]["spans_received"] >= 2 * AB_REQUESTS + 1 and "ratio 1.0" in proc.stdout


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the benchmark pins the routers to their own core")
def test_bench_router_vs_sglang_smoke(tmp_path):
    """`python -m radixmesh.benchmarks.router_vs_sglang` (what `make bench-router` runs) with tiny counts: both routers
    answer every request of the four compared scenarios correctly, and the record pairs them."""
    model_path("tiny-llama")
    out = tmp_path / "vs.json"
    left = Leftovers()
    proc = subprocess.run([sys.executable, "-m", "radixmesh.benchmarks.router_vs_sglang", "--requests", str(REQUESTS),
                           "--stream-requests", str(STREAM_REQUESTS), "--warmup", "2", "--repeats", "1",
                           "--concurrency", "4", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=180, env={**os.environ, **left.env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["sglang_router"] and doc["command"].startswith("python -m radixmesh.benchmarks.router_vs_sglang")
    rows = {r["scenario"]: r for r in doc["comparison"]}
    assert set(rows) == {"generate_16", "generate_stream_16", "chat_stream_16", "generate_text_stream_16"}
    for name, row in rows.items():
        assert row["errors"] == 0, (name, doc)
        assert row["radixmesh_cpu_ms_per_request"] > 0 and row["sglang_cpu_ms_per_request"] > 0, row
    for side in ("radixmesh", "sglang"):
        for r in doc[side]["results"]:
            assert r["requests"] == (STREAM_REQUESTS if r["scenario"] != "generate_16" else REQUESTS), (side, r)
    assert not left.found(), "the benchmark left processes behind"


def test_bench_router_processes_smoke(tmp_path):
    """`python -m radixmesh.benchmarks.router_processes` with tiny counts: both settings answer every request, and the
    shared routes keep the prefix-heavy hit rate at its best with two processes."""
    model_path("tiny-llama")
    out = tmp_path / "procs.json"
    proc = subprocess.run([sys.executable, "-m", "radixmesh.benchmarks.router_processes", "--requests",
                           str(REQUESTS), "--warmup", "2", "--repeats", "1", "--concurrency", "4", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert [s["router_workers"] for s in doc["settings"]] == [1, 2]
    for s in doc["settings"]:
        assert [t["scenario"] for t in s["throughput"]] == ["generate_stream_16", "chat_stream_16"]
        assert all(t["requests_per_s"] > 0 and t["errors"] == 0 for t in s["throughput"]), s
        assert s["prefix_heavy"]["errors"] == 0
        assert s["prefix_heavy"]["hit_rate"] >= 0.8, s["prefix_heavy"]


def test_transport_cost_smoke(tmp_path):
    """`python -m radixmesh.benchmarks.transport_cost` with tiny counts: both transports answer every round trip and the
    JSON holds a row per transport and in-flight count; its echo servers are gone afterwards."""
    out = tmp_path / "transport.json"
    left = Leftovers()
    proc = subprocess.run([sys.executable, "-m", "radixmesh.benchmarks.transport_cost", "--round-trips", "100",
                           "--repeats", "1", "--inflight", "1", "4", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **left.env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["transport"], r["inflight"]) for r in rows] == [("grpc", 1), ("grpc", 4), ("tcp", 1), ("tcp", 4)]
    assert all(r["client_cpu_us_per_round_trip"] > 0 for r in rows), rows
    assert not left.found(), "an echo server was left behind"
