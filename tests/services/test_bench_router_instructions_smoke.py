"""`python -m radixmesh.benchmarks.router_instructions` with tiny counts, as a subprocess: the router runs under
valgrind's callgrind untraced and traced, every answer checks out, each variant gets a count, and the JSON record is
complete. Skipped where valgrind is not installed. It asserts no comparison of the two counts: they move with the
machine's load (the event loop and gRPC's pollers wake more or less often), and a loaded run once counted the traced
router 3% below the untraced one; the benchmark measures, the test guards it against rot."""

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
    # most of the run is each router's start under valgrind (~50x slower than natively): a few requests suffice to
    # count one's instructions
    proc = subprocess.run([sys.executable, "-m", "radixmesh.benchmarks.router_instructions", "--requests", "3",
                           "--warmup", "2", "--annotate", "5", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    counts = {r["variant"]: r["instructions_per_request"] for r in doc["results"]}
    assert set(counts) == {"off", "trace"} and min(counts.values()) > 100_000, counts
    assert doc["tool"] == "valgrind callgrind" and doc["annotate"]["trace - off, generate_1"]
    assert doc["hash_seed"] == "0"  # the seed every process it started ran with
