"""Per-layer KV cache scales on CUDA: the checkpoint of tests/parity/test_fp8_kv_scales (keys and values far outside
e4m3's range, with their k_scale / v_scale) with --kv-cache-dtype fp8_e4m3 decodes in CUDA graphs on the Triton
kernels, applying the scales as the CPU engine does: the same greedy tokens, float32 on both."""

from __future__ import annotations

import pytest
import torch

from tests.engine_utils import running_engine
from tests.parity.test_fp8_kv_scales import GREEDY, _calibrate, _prompts, _write

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def scaled(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("kv-scales-cuda")
    bare = _write(str(root / "bare"), None)
    return _write(str(root / "scaled"), _calibrate(bare))


def test_scaled_fp8_cache_on_cuda_decodes_as_the_cpu_engine_does(scaled):
    prompts = _prompts(scaled)
    with running_engine(scaled, kv_cache_dtype="fp8_e4m3", skip_tokenizer_init=True) as cpu:
        want = [o["output_ids"] for o in cpu.generate(input_ids=prompts, sampling_params=GREEDY)]
        scales = cpu.runner.kv_pool.k_scale, cpu.runner.kv_pool.v_scale
    with running_engine(scaled, device="cuda", kv_cache_dtype="fp8_e4m3", skip_tokenizer_init=True,
                        max_total_tokens=4096) as llm:
        assert llm.args.decode_attention_backend == "triton" and llm.runner.graphs is not None
        pool = llm.runner.kv_pool
        assert pool.k[0].dtype == torch.float8_e4m3fn and (pool.k_scale, pool.v_scale) == scales
        assert set(scales[0]) != {1.0}
        got = [o["output_ids"] for o in llm.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert got == want
