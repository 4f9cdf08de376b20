"""The SiLU-and-mul inside the one-row gate/up product's launch on a GPU (kernels.activation.row_block): the compiled
kernels under programmatic dependent launch in a CUDA graph give the two launches' result bit for bit at the 8B
shape, and engines whose plan takes it (engine.decode_products.gated_plan, forced on) generate what they generate
without it: bf16 weights on gemv_row exactly, fp8 per-row weights (with the norm in the product too) token-exact with
their dequantized twin."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.quantization import fp8
from radixmesh.kernels.activation import GATED_SHAPES, set_gated_shapes, silu_and_mul
from radixmesh.kernels.fp8_gemv import fp8_gemv_row
from radixmesh.kernels.gemv import gemv_row
from radixmesh.kernels.runtime import pdl_supported
from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine
from tests.reference import hf_greedy, hf_token_logprobs

pytestmark = pytest.mark.gpu


def _in_graph(run):
    """run() eagerly, then captured and replayed: both outputs."""
    eager = run().clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    torch.cuda.synchronize()
    return eager, out


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_the_gated_product_is_the_two_launches_at_the_8b_shape_in_a_graph(weights):
    if not pdl_supported():
        pytest.skip("programmatic dependent launch needs Hopper")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((1, 4096), device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn((2 * 14336, 4096), device="cuda", dtype=torch.bfloat16, generator=g) / 64
    if weights == "bf16":
        def product(gated):
            return gemv_row(x, w, pdl=True, gated=gated)
    else:
        q, s = fp8.quantize(w.float(), None)
        s = s.reshape(-1).contiguous()

        def product(gated):
            return fp8_gemv_row(x, q, s, None, pdl=True, gated=gated)
    two_eager, two = _in_graph(lambda: silu_and_mul(product(False)))
    one_eager, one = _in_graph(lambda: product(True))
    assert one.shape == (1, 14336)
    assert torch.equal(one, two) and torch.equal(one_eager, two_eager) and torch.equal(one, one_eager)


def _forced(monkeypatch):
    from radixmesh.engine import decode_products

    monkeypatch.setattr(decode_products, "GATED_ON", True)
    monkeypatch.setattr(decode_products, "NORM_MARGIN", 1e9)  # taken whatever the timing says
    monkeypatch.setattr(decode_products, "ROW_GUARD", 1e9)  # every one-row bf16 product on gemv_row


def test_a_bf16_engine_with_the_activation_in_the_product_generates_the_same_tokens_and_logprobs(monkeypatch):
    if not pdl_supported():
        pytest.skip("the one-row plan runs under programmatic dependent launch (Hopper)")
    path = model_path("tiny-llama")
    prompts = parity_prompts(path)[:3]
    sp = {"max_new_tokens": 12, "temperature": 0}

    def generate():
        with running_engine(path, device="cuda", dtype="bfloat16", skip_tokenizer_init=True,
                            mem_fraction_static=0.3) as llm:
            shapes = set(GATED_SHAPES)
            outs = llm.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
        return shapes, [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]

    try:
        _forced(monkeypatch)
        shapes, gated = generate()
        from radixmesh.engine import decode_products

        monkeypatch.setattr(decode_products, "GATED_ON", False)
        none, plain = generate()
    finally:
        set_gated_shapes(())
    assert len(shapes) == 1 and not none  # tiny-llama's one gate/up shape, then none
    assert gated == plain  # bit for bit: the same products, the same rounding


def test_fp8_per_row_weights_with_the_norm_and_the_activation_in_the_product_match_the_twin(tmp_path, monkeypatch):
    from radixmesh.engine import decode_products
    from radixmesh.kernels import fp8_gemv_norm

    _forced(monkeypatch)
    monkeypatch.setattr(decode_products, "NORM_IN_PRODUCT", True)
    q = fp8.write_checkpoint(model_path("tiny-llama"), str(tmp_path / "fp8"), block=None)
    twin = fp8.dequantized_checkpoint(q, str(tmp_path / "twin"))
    prompts = parity_prompts(q)[:2]
    refs = hf_greedy(twin, prompts, 12)
    try:
        with running_engine(q, device="cuda", dtype="float32", skip_tokenizer_init=True, chunked_prefill_size=16,
                            fp8_gemm_backend="triton") as llm:
            assert len(GATED_SHAPES) == 1 and len(fp8_gemv_norm.NORM_PLAN) == 2 and llm.runner.graphs is not None
            outs = llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": 12, "temperature": 0},
                                return_logprob=True)
    finally:
        set_gated_shapes(())
        fp8_gemv_norm.set_norm_plan({})
    assert [o["output_ids"] for o in outs] == refs
    for p, out, ref in zip(prompts, outs, refs):
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(hf_token_logprobs(twin, p, ref), abs=1e-3)
