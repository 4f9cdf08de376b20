"""engine.bench_one_batch --extend-over (issue 11's next measurement): one forward extending a batch over cached
prefixes, against the same forward over none, on the tiny model on CPU."""

from __future__ import annotations

import json
import subprocess
import sys

from radixmesh.engine.model_config import ModelConfig
from tests.conftest import model_path


def test_extend_over_a_cached_prefix_is_timed_against_none(tmp_path):
    out = tmp_path / "rows.jsonl"
    subprocess.run([sys.executable, "-m", "radixmesh.engine.bench_one_batch", "--model-path", model_path("tiny-llama"),
                    "--device", "cpu", "--dtype", "float32", "--batch-size", "1", "--input-len", "8",
                    "--output-len", "2", "--extend-over", "48", "16", "3", "--result-file", str(out)],
                   check=True, capture_output=True, timeout=300)
    row = json.loads(out.read_text().splitlines()[0])
    assert (row["extend_batch"], row["extend_prefix"], row["extend_new"]) == (3, 48, 16)
    assert row["extend_over_prefix_s"] > 0 and row["extend_no_prefix_s"] > 0
    cfg = ModelConfig.from_path(model_path("tiny-llama"))  # QK^T and PV of each new token against the prefix
    assert row["prefix_attention_flops"] == 4 * 3 * 16 * 48 * cfg.num_heads * cfg.head_dim * cfg.num_layers
