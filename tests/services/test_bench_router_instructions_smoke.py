"""`python -m radixmesh.benchmarks.router_instructions` with tiny counts, as a subprocess: the router runs under
valgrind's callgrind untraced and traced, every answer checks out, each variant gets a count, and the JSON record is
complete. The traced router must execute more instructions than the untraced one (the same code plus its spans:
instruction counts do not drift with the machine's load, so this holds on any run). Skipped where valgrind is not
installed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, model_path


@pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("callgrind_control") is None,
                    reason="valgrind is not installed")
def test_bench_router_instructions_smoke(tmp_path):
    model_path("tiny-llama")  # builds the tiny models if missing
    out = tmp_path / "instructions.json"
    proc = subprocess.run([sys.executable, "-m", "radixmesh.benchmarks.router_instructions", "--requests", "40",
                           "--warmup", "40", "--annotate", "5", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    counts = {r["variant"]: r["instructions_per_request"] for r in doc["results"]}
    assert set(counts) == {"off", "trace"} and counts["off"] > 100_000, counts
    assert counts["trace"] > counts["off"], counts
    assert doc["tool"] == "valgrind callgrind" and doc["annotate"]["trace - off, generate_1"]
    assert doc["hash_seed"] == "0"  # the seed every process it started ran with
