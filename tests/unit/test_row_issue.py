"""benchmarks.row_issue reads one-row decode products' sm_90 machine code on a machine without a GPU: the count it
reports must be the kernel's, so the multiply-adds it finds are the weights each thread multiplies (float32 products
of every weight: one FFMA a weight) and, for fp8 weights, one e4m3x2 -> f16x2 conversion a pair of them. A child
process compiles (this one's kernels are decorated for Triton's interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _costs(tmp_path, *args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    out = tmp_path / "rows.jsonl"
    done = subprocess.run([sys.executable, "-m", "radixmesh.benchmarks.row_issue", *args, "--result-file", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_the_counts_are_the_kernels_multiply_adds_and_conversions(tmp_path):
    fp8, bf16 = _costs(tmp_path, "--k", "4096", "--fp8-tiles", "2,4096,8", "--bf16-tiles", "2,2048,4")
    # fp8 (2, 4096, 8): 2 rows x 4096 weights over 256 threads, 32 a thread; bf16 (2, 2048, 4): 2 rows x 4096 over 128
    assert fp8["opcodes"]["FFMA"] == 32 and bf16["opcodes"]["FFMA"] == 64
    # the output's packing to bfloat16 is the same in both; fp8 adds one conversion a pair of weights
    assert fp8["opcodes"]["F2FP"] == 16 + bf16["opcodes"].get("F2FP", 0)
    for row, weight_bytes, threads in ((fp8, 2 * 4096, 256), (bf16, 2 * 4096 * 2, 128)):
        assert row["instructions_per_byte"] == round(row["instructions_per_thread"] * threads / weight_bytes, 2)
        assert 0 < row["registers"] <= 255 and row["stack_bytes"] == 0
        assert 1 <= row["programs_per_sm"] <= 64 // (threads // 32)


def test_grouped_products_keep_every_multiply_in_fewer_registers(tmp_path):
    """kernels.fp8_gemv's GROUP: each thread's 16 consecutive products summed before they join the accumulator: the
    same multiplies (one a weight, a multiply-add or a multiply), a narrower accumulator in fewer registers."""
    full, grouped = _costs(tmp_path, "--k", "4096", "--fp8-tiles", "8,1024,4", "8,1024,4,16", "--bf16-tiles")
    assert full["tile"] == [8, 1024, 4] and grouped["tile"] == [8, 1024, 4, 16]
    weights = 8 * 4096 // 128  # a thread's
    assert full["opcodes"]["FFMA"] == weights
    ops = grouped["opcodes"]
    # (Triton 3.6 chains a group's products, FMUL then 15 FFMA; 3.9 sums them as a tree, pairs then FADDs)
    assert ops["FFMA"] + ops["FMUL"] == weights + full["opcodes"].get("FMUL", 0)
    assert ops["F2FP"] == full["opcodes"]["F2FP"]  # the same conversions
    assert grouped["registers"] < full["registers"] and grouped["programs_per_sm"] > full["programs_per_sm"]
