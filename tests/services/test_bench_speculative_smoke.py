"""`python -m radixmesh.benchmarks.speculative` with tiny counts on the bundled tiny model (drafting for itself
under STANDALONE): the workload is built, the plain, NGRAM and STANDALONE engines run both workloads at batch 1 and
two streams, every speculative output is token-exact with the plain engine's, the verify-cost ceiling is measured,
and the JSON record is complete. Asserts no speed (benchmarks measure)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT, model_path


def test_bench_speculative_smoke(tmp_path):
    out = tmp_path / "spec.json"
    # one --draft-tokens value: each value is one more engine per algorithm through the same loop; 5 (verify cost
    # of k = 1..4). 12 new tokens: a few verify steps per request, each keeping up to 5 drafts.
    proc = subprocess.run([sys.executable, "-m", "radixmesh.benchmarks.speculative", "--model-path",
                           model_path("tiny-llama"), "--dtype", "float32", "--prompts", "2", "--max-new-tokens", "12",
                           "--draft-tokens", "5", "--streams", "1,2", "--verify-cost", "--context", "64",
                           "--draft-model-path", model_path("tiny-llama"),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rec = json.loads(out.read_text())
    assert rec["bench"] == "speculative" and rec["command"].startswith("python -m radixmesh.benchmarks.speculative")
    runs = rec["runs"]
    work = ("repeat", "quote")
    assert [(r["algorithm"], r.get("num_draft_tokens"), r["workload"], r["streams"]) for r in runs] == [
        *[(None, None, w, s) for w in work for s in (1, 2)],
        *[(a, 5, w, s) for a in ("NGRAM", "STANDALONE") for w in work for s in (1, 2)]]
    spec = [r for r in runs if r["algorithm"]]
    assert all(r["token_exact"] and r["matching"] == 1.0 and r["accept_length"] >= 1.0 and r["decode_tokens"] > 0
               for r in spec), spec
    # a repeated prompt's continuation is in the n-gram corpus: nearly every draft is kept
    assert all(r["accept_length"] > 2.0 for r in spec if r["algorithm"] == "NGRAM" and r["workload"] == "repeat")
    assert set(rec["verify_cost_s"]) == {"decode", "verify_k1", "verify_k2", "verify_k3", "verify_k4"}
