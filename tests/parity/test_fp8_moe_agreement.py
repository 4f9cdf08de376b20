"""benchmarks.fp8_moe_agreement, the GPU diagnostic for fp8 experts held in fp8 against their dequantized twin, on CPU
(Triton's interpreter): the kernels' path agrees with the twin here, and the comparison names where two outputs part."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from radixmesh.benchmarks.fp8_moe_agreement import compare
from tests.conftest import model_path

REPO = Path(__file__).resolve().parents[2]


def test_the_comparison_names_the_step_where_outputs_part():
    twin = [{"ids": [5, 6, 7], "logprobs": [-0.1, -0.2, -0.3], "top2": [[-0.1, -2.0], [-0.2, -0.25], [-0.3, -1.0]]}]
    same = [{"ids": [5, 6, 7], "logprobs": [-0.1, -0.21, -0.3], "top2": twin[0]["top2"]}]
    parted = [{"ids": [5, 9, 7], "logprobs": [-0.12, -0.2, -0.3], "top2": twin[0]["top2"]}]
    ok = compare(same, twin)
    assert ok["equal"] and ok["prompts"][0]["apart_at"] is None
    assert abs(ok["prompts"][0]["largest_logprob_diff"] - 0.01) < 1e-9
    bad = compare(parted, twin)
    assert not bad["equal"] and bad["prompts"][0]["apart_at"] == 1
    assert abs(bad["prompts"][0]["twin_gap_there"] - 0.05) < 1e-9  # the twin's own top two were that close there
    assert abs(bad["prompts"][0]["largest_logprob_diff"] - 0.02) < 1e-9  # before the parting only


def test_fp8_experts_on_the_kernels_agree_with_the_twin_in_the_interpreter(tmp_path):
    out = tmp_path / "rows.jsonl"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "radixmesh.benchmarks.fp8_moe_agreement", "--model-path",
                           model_path("tiny-qwen3-moe"), "--device", "cpu", "--variants", "eager", "--prompt-lens",
                           "9", "17", "--max-new-tokens", "4", "--result-file", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    row, = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["variant"] == "eager" and row["equal"], row
    assert all(p["largest_logprob_diff"] < 1e-2 for p in row["prompts"])
