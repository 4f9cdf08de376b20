"""`python -m radixmesh.benchmarks.lora` with tiny counts on the bundled tiny model: the base engine and the
--enable-lora engine decode a batch of 2 with 0 and 2 of its random peft adapters, every figure and overhead
is recorded, --decode-split and --profile-steps run (a profile per base batch and per batch of the most adapters),
and the adapters were placed once and never evicted. Asserts no speed (benchmarks measure)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT, model_path


def test_bench_lora_smoke(tmp_path):
    out = tmp_path / "lora.json"
    proc = subprocess.run([sys.executable, "-m", "radixmesh.benchmarks.lora", "--model-path", model_path("tiny-llama"),
                           "--device", "cpu", "--dtype", "float32", "--batch-sizes", "2", "--adapters", "0,2",
                           "--input-len", "16", "--output-len", "6", "--repeats", "1", "--decode-split", "4",
                           "--profile-steps", "4", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rec = json.loads(out.read_text())
    assert rec["bench"] == "lora" and rec["decode_split"] == 4 and rec["device"] == "cpu"
    assert [(r["lora"], r["batch"], r["adapters"]) for r in rec["runs"]] == [(False, 2, 0), (True, 2, 0), (True, 2, 2)]
    assert all(r["ms_per_token"] > 0 for r in rec["runs"])
    assert all("overhead" in r for r in rec["runs"] if r["lora"])
    assert [(p["label"], p["batch"]) for p in rec["profiles"]] == [("base engine", 2), ("2 adapters", 2)]
    assert rec["adapter_loads"] == 2 and rec["adapter_evictions"] == 0 and rec["cuda_graphs"] is False
    assert "goal_met" not in rec  # the goal is 8 adapters at batch 64


def test_bench_lora_kernels_smoke(tmp_path):
    """`python -m radixmesh.benchmarks.lora_kernels` on tiny shapes (Triton's interpreter off CUDA): the shrinks with
    and without their sum, and each expand tiling, over parts or summed parts, adds the default tiling's sums."""
    from radixmesh.benchmarks.lora_kernels import main

    out = tmp_path / "kernels.json"
    rec = main(["--shape", "64,64,16,128", "--layers", "1", "--replays", "1", "--batch", "20", "--adapters", "3",
                "--slots", "4", "--expand", "128x1x4r", "128x4x4", "64x1x4r", "32x2x2", "--out", str(out)])
    assert json.loads(out.read_text()) == rec
    assert [(r["kernel"], r.get("variant")) for r in rec["runs"]] == [
        ("shrink", None), ("shrink+sum", None), ("expand", "128x1x4r"), ("expand", "128x4x4"), ("expand", "64x1x4r"),
        ("expand", "32x2x2")]
    assert all(r["ms_per_step"] > 0 for r in rec["runs"])
    assert all(r["same_sums"] and set(r["us_by_module"]) == {"qkv", "o", "gate_up", "down"}
               for r in rec["runs"] if r["kernel"] == "expand")
