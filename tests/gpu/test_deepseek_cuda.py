"""DeepSeek-V2 and DeepSeek-V3 on CUDA: the tiny checkpoints of tests/parity/test_deepseek_parity.py in float32,
token-exact with transformers (logprobs within 1e-3), by default on Triton's latent kernels (kernels.mla_extend,
kernels.mla_decode in CUDA graphs), with the experts' kernels and kernels.moe.route_grouped (V2's single-best group
score, V3's two-best with the bias); and in plain torch too, eagerly."""

from __future__ import annotations

import pytest

from tests.engine_utils import assert_no_leak, greedy_like_transformers, running_engine

pytestmark = pytest.mark.gpu
MAX_NEW = 12


@pytest.mark.parametrize("backend", [None, "torch_native"])
@pytest.mark.parametrize("name", ["deepseek_v2_lite", "deepseek_v2", "deepseek_v3"])
def test_deepseek_on_cuda_matches_transformers(tmp_path, name, backend):
    from tests.parity.test_deepseek_parity import write_family
    from tests.parity.test_moe_parity import PROMPTS

    path = write_family(name, tmp_path)
    opts = {} if backend is None else {"attention_backend": backend}
    with running_engine(path, device="cuda", dtype="float32", skip_tokenizer_init=True, chunked_prefill_size=16,
                        **opts) as llm:
        assert llm.args.prefill_attention_backend == llm.args.decode_attention_backend == (backend or "triton")
        assert (llm.runner.graphs is not None) == (backend is None)
        for batch in (PROMPTS, PROMPTS[:1]):  # (batch 1: a graph of its own)
            greedy_like_transformers(llm, path, batch, MAX_NEW)
        assert_no_leak(llm)
