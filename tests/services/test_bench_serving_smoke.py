"""`python -m radixmesh.benchmarks.serving` with a tiny workload, as a subprocess: side by side against the in-process
engine and the mesh it launches itself (radixmesh backend), on CPU, over two concurrency levels. Every request
completes with exactly the drawn output length, both backends draw the identical workload per level, every JSON line is
complete, each timed run is profiled, no process is left behind, and bad input ends in one clear line with a non-zero
status. Asserts no speed (benchmarks measure; tests only guard the benchmark against rot)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from radixmesh.benchmarks.serving import make_workload, token_pool, workload_digest
from radixmesh.services.launch import free_port
from tests.conftest import ROOT, model_path
from tests.services.test_bench_router_smoke import Leftovers

# two levels, (max concurrency, prompts): one request at a time, then all at once. Few short requests: each timed run
# is profiled, and a profile's CPU grows with the steps it records.
SEED, LEVELS, INPUT_LEN, OUTPUT_LEN, RATIO = 3, ((1, 2), (4, 4)), 16, 4, 0.5
WORKLOAD = ["--num-prompts", *(str(n) for _, n in LEVELS), "--max-concurrency", *(str(c) for c, _ in LEVELS),
            "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN), "--random-range-ratio",
            str(RATIO), "--seed", str(SEED), "--disable-tqdm"]


def _bench(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "radixmesh.benchmarks.serving", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def _check_record(rec: dict, prompts: int, expected_output_tokens: int) -> None:
    assert rec["completed"] == prompts and rec["failed"] == 0, rec["errors"]
    assert rec["total_output_tokens"] == expected_output_tokens == rec["workload_output_tokens"]
    assert rec["total_input_tokens"] == rec["workload_input_tokens"]
    for stat in ("mean", "median", "p99"):
        assert 0 < rec[f"{stat}_ttft_ms"] <= rec[f"{stat}_e2e_latency_ms"], (stat, rec)
    assert rec["mean_tpot_ms"] > 0
    # A consumer that reads late gets a request's queued outputs in one chunk (the in-process engine's delivery
    # coalesces them, engine.delivery; the mesh's router corks them), and tokens that come with the first chunk get no
    # ITL sample: on a loaded machine every one of these short answers (2-4 tokens) can arrive that way, and then the
    # level has no ITL figures at all (a suite run on 2026-12-06 had none for the engine at concurrency 1). How the
    # samples are made is tests/unit/test_serving_timer.py's.
    if rec["mean_itl_ms"] is None:
        assert all(rec[f"{stat}_itl_ms"] is None for stat in ("median", "p99", "max")), rec
    else:
        assert rec["max_itl_ms"] >= rec["mean_itl_ms"] >= 0
    for key in ("request_throughput", "output_throughput", "total_throughput", "duration", "concurrency"):
        assert rec[key] > 0, key
    for key in ("device", "date", "commit", "command", "workload_digest"):
        assert rec[key], key
    # the worker's scheduler during the timed run, read from the engine or /get_server_info
    assert rec["scheduler"]["forward_extend"] >= 1 and rec["scheduler"]["forward_decode"] >= 1, rec["scheduler"]


def test_bench_serving_side_by_side(tmp_path):
    """`--backend engine radixmesh --launch --max-concurrency 1 4 --profile`: both backends over both levels on the
    same workload per level, a record each, the side-by-side table, and a trace per timed run. One run covers the
    engine and the mesh alike: a second one per backend would start the same engine and mesh again."""
    model = model_path("tiny-qwen2")
    pool = token_pool(model)
    # each level's workload as drawn here, in another process than the benchmark's (the seed alone decides it)
    drawn = {c: make_workload(n, INPUT_LEN, OUTPUT_LEN, RATIO, SEED, pool) for c, n in LEVELS}
    expected = {c: sum(item.output_len for item in items) for c, items in drawn.items()}
    out, prof = tmp_path / "serving.jsonl", tmp_path / "prof"
    engine = ["--model-path", model, "--device", "cpu", "--dtype", "float32", "--log-level", "warning"]
    left = Leftovers()
    # --profile (SGLang's): each timed run between /start_profile and /stop_profile, one trace per worker
    run = _bench("--backend", "engine", "radixmesh", "--launch", *engine, *WORKLOAD, "--output-file", str(out),
                 "--profile", "--profile-output-dir", str(prof), env=left.env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert not left.found(), "the benchmark left mesh processes behind"
    assert "Serving Benchmark Result" in run.stdout and "Mean TTFT (ms)" in run.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["backend"], r["max_concurrency"]) for r in records] == [
        ("engine", 1), ("engine", 4), ("radixmesh", 1), ("radixmesh", 4)]
    prompts = dict(LEVELS)
    for rec in records:
        _check_record(rec, prompts[rec["max_concurrency"]], expected[rec["max_concurrency"]])
    for level, _ in LEVELS:
        assert {r["workload_digest"] for r in records if r["max_concurrency"] == level} == {
            workload_digest(drawn[level])}
    assert records[0]["command"].startswith("python -m radixmesh.benchmarks.serving --backend engine radixmesh "
                                            "--launch")
    table = run.stdout.split("Side by side")[1].splitlines()
    assert table[1].split()[:4] == ["conc", "engine", "tok/s", "radixmesh"] and "radixmesh/engine" in table[1]
    assert [row.split()[0] for row in table[2:4]] == ["1", "4"]
    # a trace per timed run, named by the process that profiled it: two of the engine's (this benchmark's process),
    # then two of the mesh's worker
    traces = [str(t) for t in prof.glob("*-TP-0.trace.json.gz")]
    assert len(traces) == 4 and all(t in run.stdout for t in traces), (traces, run.stdout)
    pids = [re.search(r"-(\d+)(?:\.\d+)?-TP-0", t).group(1) for t in sorted(traces, key=run.stdout.index)]
    assert pids[0] == pids[1] != pids[2] == pids[3], (traces, run.stdout)


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
    bad = _bench("--backend", "engine", "engine", "--model-path", model_path("tiny-qwen2"))
    assert bad.returncode == 2 and "names each backend once" in bad.stderr
    bad = _bench("--backend", "engine", "--model-path", model_path("tiny-qwen2"), "--num-prompts", "1", "2",
                 "--max-concurrency", "1", "2", "3")
    assert bad.returncode == 2 and "one per --max-concurrency level" in bad.stderr
