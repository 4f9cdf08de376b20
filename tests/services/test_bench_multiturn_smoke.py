"""`python -m radixmesh.benchmarks.multiturn` with a tiny workload, as a subprocess, against the mesh it launches itself
on CPU: every turn succeeds, prompts grow by one user turn and one answer per round, re-sent histories hit the radix
cache from round 2 on, the JSON line is complete, no process is left behind, and bad input ends in one clear line with a
non-zero status. Asserts no speed (benchmarks measure; tests only guard the benchmark against rot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from radixmesh.services.launch import free_port
from tests.conftest import ROOT, model_path
from tests.services.test_bench_router_smoke import Leftovers

CLIENTS, ROUNDS, REQUEST_LEN, OUTPUT_LEN, SYSTEM_LEN = 3, 3, 16, 4, 8
WORKLOAD = ["--num-clients", str(CLIENTS), "--num-rounds", str(ROUNDS), "--request-length", str(REQUEST_LEN),
            "--output-length", str(OUTPUT_LEN), "--shared-system-prompt-len", str(SYSTEM_LEN), "--max-parallel", "2",
            "--seed", "5", "--disable-tqdm"]


def _bench(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "radixmesh.benchmarks.multiturn", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def _prompt_len(round_: int) -> int:
    """Turn `round_` (1-based) re-sends the system prompt, every user turn so far and every earlier answer."""
    return SYSTEM_LEN + round_ * REQUEST_LEN + (round_ - 1) * OUTPUT_LEN


def test_bench_multiturn_mesh(tmp_path):
    model = model_path("tiny-qwen2")
    out = tmp_path / "multiturn.jsonl"
    left = Leftovers()
    # --device and friends are not the benchmark's flags: they reach the launcher unchanged. Two warm-up conversations
    # (default 8): side by side at --max-parallel 2, then the cache flush.
    proc = _bench("--launch", "--model-path", model, "--device", "cpu", "--dtype", "float32", "--log-level",
                  "warning", *WORKLOAD, "--warmup-requests", "2", "--output-file", str(out), env=left.env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not left.found(), "the benchmark left mesh processes behind"
    assert "Multi-turn Benchmark Result" in proc.stdout and "Cache hit rate" in proc.stdout
    [rec] = [json.loads(line) for line in out.read_text().splitlines()]

    assert rec["bench"] == "multiturn" and rec["num_requests"] == CLIENTS * ROUNDS
    assert rec["completed"] == CLIENTS * ROUNDS and rec["failed"] == 0 and rec["skipped"] == 0, rec["errors"]
    assert rec["total_output_tokens"] == CLIENTS * ROUNDS * OUTPUT_LEN
    assert rec["total_input_tokens"] == CLIENTS * sum(_prompt_len(r) for r in range(1, ROUNDS + 1))
    rounds = rec["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    assert [r["completed"] for r in rounds] == [CLIENTS] * ROUNDS
    assert [r["mean_prompt_len"] for r in rounds] == [_prompt_len(r) for r in range(1, ROUNDS + 1)]
    for r in rounds[1:]:  # the history sent last round (all but the last answer token) is in the radix cache
        assert r["cache_hit_rate"] >= (r["mean_prompt_len"] - REQUEST_LEN - 1) / r["mean_prompt_len"], rounds
    assert 0 < rec["cache_hit_rate"] < 1
    assert len(rec["round_mean_ttft_ms"]) == ROUNDS and all(t > 0 for t in rec["round_mean_ttft_ms"])

    for stat in ("mean", "median", "p90", "p99"):
        assert 0 < rec[f"{stat}_ttft_ms"] <= rec[f"{stat}_e2e_latency_ms"], (stat, rec)
    # No ITL of the mesh is asserted positive: tokens that share a network read get ITL samples of 0
    # (benchmarks.serving_backends), and on a loaded machine every one of these 4-token answers can reach the client
    # in one write (the router's cork), as test_bench_serving_smoke found for its short answers (a CI run here too)
    assert rec["max_itl_ms"] >= rec["mean_itl_ms"] >= 0
    for key in ("mean_e2e_latency_ms", "request_throughput", "input_throughput", "output_throughput", "duration"):
        assert rec[key] > 0, key
    final = _prompt_len(ROUNDS) + OUTPUT_LEN
    assert rec["working_set_tokens"] == CLIENTS * final
    assert rec["working_set_unique_tokens"] == CLIENTS * final - (CLIENTS - 1) * SYSTEM_LEN
    assert rec["kv_pool_tokens"] > 0 and rec["num_workers"] == 1
    assert rec["working_set_ratio"] == rec["working_set_tokens"] / rec["kv_pool_tokens"]
    assert rec["scheduler"]["forward_extend"] >= 1 and rec["scheduler"]["forward_decode"] >= 1, rec["scheduler"]
    assert rec["args"]["launch_flags"] == ["--device", "cpu", "--dtype", "float32", "--log-level", "warning"]
    for key in ("device", "date", "command", "workload_digest"):
        assert rec[key], key
    assert rec["command"].startswith("python -m radixmesh.benchmarks.multiturn --launch --model-path")


def test_bench_multiturn_bad_input():
    stray = _bench("--policy", "kv_index", timeout=60)
    assert stray.returncode == 2
    assert stray.stderr.strip().splitlines() == ["python -m radixmesh.benchmarks.multiturn: error: "
                                                 "unrecognized arguments: "
                                                 "--policy kv_index (flags for the mesh need --launch)"]
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    down = _bench("--base-url", url, "--tokenizer", model_path("tiny-qwen2"), *WORKLOAD, timeout=60)
    assert down.returncode == 1
    lines = down.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot reach the server at {url}"), down.stderr
