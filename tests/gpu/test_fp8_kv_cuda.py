"""--kv-cache-dtype fp8_e4m3 on CUDA: the default attention backend becomes Triton (FlashInfer's fp8 path is not
wired), decode runs in CUDA graphs reading the fp8 cache, and greedy outputs equal the CPU engine's with the same
fp8 cache (both attend over the same rounded bytes, in float32); the pool holds a quarter of float32's bytes a
token."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine

pytestmark = pytest.mark.gpu
GREEDY = {"max_new_tokens": 12, "temperature": 0}


def test_an_fp8_kv_cache_on_cuda_decodes_as_the_cpu_engine_does():
    path = model_path("tiny-llama")
    prompts = parity_prompts(path)[:3]
    with running_engine(path, kv_cache_dtype="fp8_e4m3", skip_tokenizer_init=True) as cpu:
        want = [o["output_ids"] for o in cpu.generate(input_ids=prompts, sampling_params=GREEDY)]
    with running_engine(path, device="cuda", kv_cache_dtype="fp8_e4m3", skip_tokenizer_init=True,
                        max_total_tokens=4096) as llm:
        assert llm.args.decode_attention_backend == "triton" and llm.runner.graphs is not None
        pool = llm.runner.kv_pool
        assert pool.k[0].dtype == torch.float8_e4m3fn and pool.page_bytes == pool.page_size * pool.k[0][0].numel()
        got = [o["output_ids"] for o in llm.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert got == want
