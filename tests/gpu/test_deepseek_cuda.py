"""DeepSeek-V2 and DeepSeek-V3 on CUDA: the tiny checkpoints of tests/parity/test_deepseek_parity.py in float32,
token-exact with transformers (logprobs within 1e-3). On Triton the latent (40 wide here) attends in CUDA graphs
with the experts' kernels and kernels.moe.route_grouped (V2's single-best group score, V3's two-best with the bias);
on torch_native, the backend a published checkpoint's 576-wide latent gets by default (wider than Triton's tiles),
eagerly. The published shape's default is checked too."""

from __future__ import annotations

import pytest

from tests.engine_utils import assert_no_leak, running_engine
from tests.reference import hf_greedy, hf_token_logprobs

pytestmark = pytest.mark.gpu
MAX_NEW = 12


@pytest.mark.parametrize("backend", ["triton", "torch_native"])
@pytest.mark.parametrize("name", ["deepseek_v2_lite", "deepseek_v2", "deepseek_v3"])
def test_deepseek_on_cuda_matches_transformers(tmp_path, name, backend):
    from tests.parity.test_deepseek_parity import write_family
    from tests.parity.test_moe_parity import PROMPTS

    path = write_family(name, tmp_path)
    refs = hf_greedy(path, PROMPTS, MAX_NEW)
    with running_engine(path, device="cuda", dtype="float32", skip_tokenizer_init=True,
                        attention_backend=backend) as llm:
        assert (llm.runner.graphs is not None) == (backend == "triton")
        for batch in (PROMPTS, PROMPTS[:1]):
            outs = llm.generate(input_ids=batch, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0},
                                return_logprob=True)
            assert [o["output_ids"] for o in outs] == refs[:len(batch)]
            for p, out, ref in zip(batch, outs, refs):
                got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
                assert got == pytest.approx(hf_token_logprobs(path, p, ref), abs=1e-3)
        assert_no_leak(llm)


def test_a_published_latent_attends_in_plain_torch_by_default():
    from radixmesh.engine.attention.registry import default_backend

    assert default_backend("cuda", "bfloat16", 576) == "torch_native"
    assert default_backend("cuda", "bfloat16", 128) in ("flashinfer", "triton")
