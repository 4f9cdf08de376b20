"""`python -m radixmesh.benchmarks.serving` with a tiny workload, as a subprocess: against the mesh it launches itself
(radixmesh backend) and against the in-process engine, on CPU. Every request completes with exactly the drawn
output length, both backends draw the identical workload, the JSON line is complete, no process is left behind, and
bad input ends in one clear line with a non-zero status. Asserts no speed (benchmarks measure; tests only guard the
benchmark against rot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

from radixmesh.benchmarks.serving import make_workload, token_pool
from radixmesh.services.launch import free_port
from tests.conftest import ROOT, model_path
from tests.services.test_bench_router_smoke import _tagged

SEED, PROMPTS, INPUT_LEN, OUTPUT_LEN, RATIO = 3, 8, 32, 8, 0.5
WORKLOAD = ["--num-prompts", str(PROMPTS), "--random-input-len", str(INPUT_LEN), "--random-output-len",
            str(OUTPUT_LEN), "--random-range-ratio", str(RATIO), "--seed", str(SEED), "--max-concurrency", "4",
            "--disable-tqdm"]


def _bench(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "radixmesh.benchmarks.serving", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def _check_record(rec: dict, backend: str, expected_output_tokens: int) -> None:
    assert rec["backend"] == backend
    assert rec["completed"] == PROMPTS and rec["failed"] == 0, rec["errors"]
    assert rec["total_output_tokens"] == expected_output_tokens == rec["workload_output_tokens"]
    assert rec["total_input_tokens"] == rec["workload_input_tokens"]
    for stat in ("mean", "median", "p99"):
        assert 0 < rec[f"{stat}_ttft_ms"] <= rec[f"{stat}_e2e_latency_ms"], (stat, rec)
    assert rec["mean_tpot_ms"] > 0
    # the in-process engine yields each step's token as it comes; through the mesh, a client that reads late gets a
    # request's queued events in one write (the router's cork), and tokens that come with the first event get no
    # ITL sample: on a loaded machine every one of these short answers can arrive that way
    if backend == "engine":
        assert rec["mean_itl_ms"] > 0 and rec["max_itl_ms"] > 0
    else:
        assert rec["max_itl_ms"] >= rec["mean_itl_ms"] >= 0
    for key in ("request_throughput", "output_throughput", "total_throughput", "duration", "concurrency"):
        assert rec[key] > 0, key
    for key in ("device", "date", "commit", "command", "workload_digest"):
        assert rec[key], key


def test_bench_serving_mesh_and_engine(tmp_path):
    model = model_path("tiny-qwen2")
    pool = token_pool(model)
    expected = sum(item.output_len for item in make_workload(PROMPTS, INPUT_LEN, OUTPUT_LEN, RATIO, SEED, pool))
    out = tmp_path / "serving.jsonl"
    engine = ["--model-path", model, "--device", "cpu", "--dtype", "float32", "--log-level", "warning"]
    marker = uuid.uuid4().hex
    # --profile (SGLang's): the timed run between /start_profile and /stop_profile, one trace per worker
    mesh = _bench("--backend", "radixmesh", "--launch", *engine, *WORKLOAD, "--output-file", str(out),
                  "--profile", "--profile-output-dir", str(tmp_path / "prof-mesh"), env={"BENCH_SERVING_SMOKE": marker})
    assert mesh.returncode == 0, mesh.stdout + mesh.stderr
    assert not _tagged(f"BENCH_SERVING_SMOKE={marker}"), "the benchmark left mesh processes behind"
    offline = _bench("--backend", "engine", *engine, *WORKLOAD, "--output-file", str(out), "--profile",
                     "--profile-output-dir", str(tmp_path / "prof-engine"))
    assert offline.returncode == 0, offline.stdout + offline.stderr
    assert "Serving Benchmark Result" in mesh.stdout and "Mean TTFT (ms)" in offline.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["backend"] for r in records] == ["radixmesh", "engine"]
    for rec in records:
        _check_record(rec, rec["backend"], expected)
    assert records[0]["workload_digest"] == records[1]["workload_digest"]
    for r in records:  # the worker's scheduler during the timed run, read from the engine or /get_server_info
        assert r["scheduler"]["forward_extend"] >= 1 and r["scheduler"]["forward_decode"] >= 1, r["scheduler"]
    assert records[0]["command"].startswith("python -m radixmesh.benchmarks.serving --backend radixmesh --launch")
    for run, where in ((mesh, "prof-mesh"), (offline, "prof-engine")):
        traces = list((tmp_path / where).glob("*-TP-0.trace.json.gz"))
        assert len(traces) == 1 and str(traces[0]) in run.stdout, (where, run.stdout)


def test_bench_serving_bad_input():
    bad = _bench("--backend", "nope", timeout=60)
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines() == ["python -m radixmesh.benchmarks.serving: error: unknown backend 'nope' "
                                               "(choose from radixmesh, openai, engine)"]
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    down = _bench("--base-url", url, "--tokenizer", model_path("tiny-qwen2"), *WORKLOAD, timeout=60)
    assert down.returncode != 0
    lines = down.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot reach the server at {url}"), down.stderr


def test_bench_serving_side_by_side_sweep(tmp_path):
    """`--backend engine radixmesh --launch --max-concurrency 1 4`: both backends over both levels on the same
    workload per level, a record each, and the side-by-side table."""
    out = tmp_path / "sweep.jsonl"
    engine = ["--model-path", model_path("tiny-qwen2"), "--device", "cpu", "--dtype", "float32", "--log-level",
              "warning"]
    run = _bench("--backend", "engine", "radixmesh", "--launch", *engine, "--num-prompts", "4", "8",
                 "--max-concurrency", "1", "4", "--random-input-len", "16", "--random-output-len", "4",
                 "--disable-tqdm", "--output-file", str(out), timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["backend"], r["max_concurrency"], r["completed"]) for r in records] == [
        ("engine", 1, 4), ("engine", 4, 8), ("radixmesh", 1, 4), ("radixmesh", 4, 8)]
    assert all(r["failed"] == 0 for r in records)
    for level in (1, 4):
        assert len({r["workload_digest"] for r in records if r["max_concurrency"] == level}) == 1
    table = run.stdout.split("Side by side")[1].splitlines()
    assert table[1].split()[:4] == ["conc", "engine", "tok/s", "radixmesh"] and "radixmesh/engine" in table[1]
    assert [row.split()[0] for row in table[2:4]] == ["1", "4"]
    bad = _bench("--backend", "engine", "engine", "--model-path", model_path("tiny-qwen2"))
    assert bad.returncode == 2 and "names each backend once" in bad.stderr
    bad = _bench("--backend", "engine", "--model-path", model_path("tiny-qwen2"), "--num-prompts", "1", "2",
                 "--max-concurrency", "1", "2", "3")
    assert bad.returncode == 2 and "one per --max-concurrency level" in bad.stderr
