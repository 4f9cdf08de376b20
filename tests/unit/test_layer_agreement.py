"""benchmarks.layer_agreement on CPU: two engines on the same options agree at every module; fp8 weights (an
engine option that changes the products) part at the first projection they quantize, and the tool names it."""

from __future__ import annotations

from radixmesh.benchmarks.layer_agreement import compare, record
from tests.conftest import model_path

PROMPTS = [[1, 17, 42, 99, 3, 8, 21], [1, 60, 61, 62]]


def test_the_same_options_agree_and_fp8_weights_part_at_their_first_projection():
    path = model_path("tiny-qwen3")
    ref = record(path, "cpu", "float32", PROMPTS, {})
    same = compare(ref, record(path, "cpu", "float32", PROMPTS, {}), 1e-6)
    assert same and all(r.get("rel_err") == 0.0 for r in same), same
    fp8 = compare(ref, record(path, "cpu", "float32", PROMPTS, {"quantization": "fp8"}), 1e-3)
    first = next(r for r in fp8 if r.get("apart"))
    assert first["module"] == "model.layers.0.self_attn.qkv_proj", first
    assert all(not r.get("apart") for r in fp8[:fp8.index(first)])  # the embedding and the first norm agree
