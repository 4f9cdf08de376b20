"""`python -m radixmesh.benchmarks.soak` for 6 s against the mesh it launches (2 colocated tiny-qwen2 workers on CPU),
as a subprocess: every request kind ran and none failed, the samples hold every service's RSS and fds and every worker's
KV, the KV is empty after the drain and free after the flush, and no process is left behind. The failure rule is
checked on made-up samples. Asserts no speed (benchmarks measure; tests only guard the benchmark against rot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from radixmesh.benchmarks.soak_load import KINDS
from radixmesh.benchmarks.soak_report import growth
from radixmesh.services.launch import free_port
from tests.conftest import ROOT, model_path
from tests.e2e.mesh import NOT_FORKED
from tests.services.test_bench_router_smoke import Leftovers

SERVICES = {"launcher", "tokenizer", "worker-0", "worker-1", "router"}


def _soak(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "radixmesh.benchmarks.soak", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_soak_smoke(tmp_path):
    out = tmp_path / "soak.json"
    left = Leftovers()
    # 6 s, a sample every 2 s: t=0 (idle) and three under load, the fewest the growth check judges (thirds); every
    # sample 2 s apart leaves a late one (a loaded machine) 1 s of slack. A 0.5 s timed warm-up: every client
    # starts a request in it (each checks the clock before its first). Services started afresh (NOT_FORKED): the
    # soak samples the launcher's children, and a forked service is the fork server's.
    proc = _soak("--model-path", model_path("tiny-qwen2"), "--duration", "6s", "--sample-interval", "2s",
                 "--concurrency", "4", "--warmup-requests", "1", "--warmup-time", "0.5s", "--out", str(out),
                 "--launch-args=--log-level warning", env={**NOT_FORKED, **left.env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not left.found(), "the soak left mesh processes behind"
    assert "PASSED" in proc.stdout
    rec = json.loads(out.read_text())
    assert rec["bench"] == "soak" and rec["passed"] and rec["failures"] == []
    assert rec["command"].startswith("python -m radixmesh.benchmarks.soak --model-path")
    totals = rec["totals"]
    assert totals["failed"] == 0 and totals["invalid_outputs"] == 0 and rec["warmup"]["failed"] == 0, rec["errors"]
    assert rec["warmup"]["requests"] > len(KINDS)  # one of each kind, then the timed warm-up
    assert set(totals["kinds"]) == set(KINDS), totals["kinds"]
    assert all(k["ok"] == k["requests"] > 0 for k in totals["kinds"].values())
    assert totals["requests"] == sum(s["requests"]["requests"] for s in rec["samples"] + [rec["final"]])

    samples = rec["samples"]
    assert [round(s["t_s"] / 2) for s in samples] == [0, 1, 2, 3], [s["t_s"] for s in samples]
    for s in samples + [rec["final"]]:
        assert set(s["procs"]) == SERVICES, s["procs"]
        assert all(p["rss_mib"] > 0 and p["fds"] > 0 and p["threads"] > 0 for p in s["procs"].values())
        assert len(s["kv"]) == 2 and all(w["total_tokens"] > 0 and w["used_tokens"] >= 0 for w in s["kv"]), s["kv"]
    assert sum(s["requests"]["requests"] for s in samples[1:]) > 0
    checks = rec["checks"]
    assert checks["kv_drained"] and checks["kv_free_after_flush"] and checks["restarted"] == []
    assert all(w["used_tokens"] == 0 for w in checks["kv_after_drain"] + checks["kv_after_flush"])
    assert set(checks["growth"]) == SERVICES and all(g["ok"] for g in checks["growth"].values())
    assert not any(g["rss_judged"] for g in checks["growth"].values())  # 6 s: RSS still settling, fds judged
    assert checks["mesh_exit_status"] == 0


def _samples(rss: list[float], fds: list[int]) -> list[dict]:
    return [{"t_s": 60.0 * i, "procs": {"router": {"pid": 1, "rss_mib": r, "fds": f, "threads": 4}}}
            for i, (r, f) in enumerate(zip(rss, fds))]


def test_soak_growth_rule():
    # warm-up growth in the first third settles: fine; a steady climb or one leaked fd per sample: not
    settled = growth(_samples([100, 160, 160, 161, 160, 161, 160, 161, 161], [20] * 9), 24, 5, 4)["router"]
    assert settled["ok"] and settled["rss_growth_mib"] == 1.0, settled
    climbing = growth(_samples([100 + 5 * i for i in range(9)], [20] * 9), 24, 5, 4)["router"]
    assert not climbing["ok"] and climbing["rss_growth_mib"] == 30.0
    fd_leak = growth(_samples([100] * 9, [20 + i for i in range(9)]), 24, 5, 4)["router"]
    assert not fd_leak["ok"] and fd_leak["fds_growth"] == 6
    assert growth(_samples([100, 200], [1, 9]), 24, 5, 4) == {}  # too few samples to judge
    # a run shorter than min_rss_span_s: RSS not judged (still settling), fds still are
    short = growth(_samples([100 + 5 * i for i in range(9)], [20] * 9), 24, 5, 4, min_rss_span_s=600)["router"]
    assert short["ok"] and not short["rss_judged"] and short["rss_growth_mib"] == 30.0
    short_fd_leak = growth(_samples([100] * 9, [20 + i for i in range(9)]), 24, 5, 4, min_rss_span_s=600)["router"]
    assert not short_fd_leak["ok"]
    assert growth(_samples([100 + 5 * i for i in range(11)], [20] * 11), 24, 5, 4, min_rss_span_s=600)["router"][
        "rss_judged"] is True


def test_soak_bad_input():
    bad = _soak("--duration", "soon", timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip() == ("python -m radixmesh.benchmarks.soak: error: not a duration: 'soon' "
                                  "(e.g. 90s, 30m, 1h)")
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    down = _soak("--url", url, "--duration", "5s", "--out", os.devnull, timeout=60)
    assert down.returncode == 2
    assert down.stderr.strip().startswith(f"error: cannot reach the mesh at {url}"), down.stderr
