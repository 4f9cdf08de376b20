"""fp8 checkpoints of the families whose MLP up-projection is a plain column-parallel layer (Phi's fc1, StarCoder2's
c_fc, biases on every projection) held in fp8 and run by the fp8 kernels (--fp8-gemm-backend triton, Triton's
interpreter on CPU), float32: token-exact with the checkpoint's dequantized twin in transformers, logprobs within 1e-4
(products of at most 16 rows read the fp8 weights with float32 activations: tests/parity/test_fp8_weights_kernels.py).
Every projection of every layer is held, not only the fused ones."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.quantization import fp8
from radixmesh.engine.quantization.fp8_load import _held_parts
from tests.engine_utils import running_engine
from tests.parity import test_model_families_more as more
from tests.parity import test_model_families_third as third
from tests.parity.test_model_families_more import GREEDY, PROMPTS
from tests.reference import hf_greedy, hf_token_logprobs

CASES = {"phi": (third.build, {}, "fc1"), "starcoder2": (more.build, dict(block=(32, 64)), "c_fc")}


@pytest.mark.parametrize("name", CASES)
def test_every_projection_is_held_in_fp8_and_matches_the_twin(tmp_path, name):
    build, how, up = CASES[name]
    q = fp8.write_checkpoint(build(name, tmp_path / "float"), str(tmp_path / "fp8"), **how)
    twin = fp8.dequantized_checkpoint(q, str(tmp_path / "twin"))
    refs = hf_greedy(twin, PROMPTS, GREEDY["max_new_tokens"])
    with running_engine(q, skip_tokenizer_init=True, chunked_prefill_size=16, page_size=4,
                        fp8_gemm_backend="triton") as llm:
        modules = dict(llm.runner.model.named_modules())
        projections = {n for n, m in modules.items() if _held_parts(m)}
        held = {n for n, m in modules.items() if getattr(m, "fp8", None) is not None}
        outs = llm.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    assert held == projections and any(n.endswith(up) for n in held)
    assert all(modules[n].weight.dtype == torch.float8_e4m3fn for n in held)
    assert [o["output_ids"] for o in outs] == refs
    for p, out, ref in zip(PROMPTS, outs, refs):
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(hf_token_logprobs(twin, p, ref), abs=1e-4)
