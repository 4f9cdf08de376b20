"""--kv-cache-dtype fp8_e4m3 / fp8_e5m2 (SGLang's flag), float32 models on CPU: keys and values are stored rounded
to fp8 (scale 1) and read back to the model's dtype. The generated tokens' logprobs stay within a stated distance of
transformers' (teacher-forced, full precision); the Triton kernels (Triton's interpreter) read the fp8 cache as
torch_native does; the hierarchical cache moves the fp8 pages and brings them back unchanged."""

from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine
from tests.reference import hf_token_logprobs

GREEDY = {"max_new_tokens": 12, "temperature": 0}
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_native: dict[str, list[dict]] = {}


def _torch_native(kv: str) -> list[dict]:
    """torch_native's greedy outputs (with logprobs) on the parity prompts over an fp8 cache, run once per module: the
    near-precision test's and the Triton kernels' reference."""
    if kv not in _native:
        path = model_path("tiny-llama")
        with running_engine(path, kv_cache_dtype=kv, attention_backend="torch_native",
                            skip_tokenizer_init=True) as llm:
            assert all(t.dtype == FP8[kv] for t in llm.runner.kv_pool.buffers())
            _native[kv] = llm.generate(input_ids=parity_prompts(path)[:3], sampling_params=GREEDY,
                                       return_logprob=True)
    return _native[kv]


@pytest.mark.parametrize("kv", FP8)
def test_an_fp8_kv_cache_stays_near_the_full_precision_model(kv):
    """Stated tolerance: over the generated tokens, the engine's logprob of its choice is within 0.05 of
    transformers' (the mean absolute difference for e4m3; the median for e5m2, whose two mantissa bits moved one
    token of 36 here by 4.6 nats)."""
    path = model_path("tiny-llama")
    prompts = parity_prompts(path)[:3]
    outs = _torch_native(kv)
    gaps = []
    for p, o in zip(prompts, outs):
        mine = [x[0] for x in o["meta_info"]["output_token_logprobs"]]
        gaps += [abs(a - b) for a, b in zip(mine, hf_token_logprobs(path, p, o["output_ids"]))]
    typical = sum(gaps) / len(gaps) if kv == "fp8_e4m3" else sorted(gaps)[len(gaps) // 2]
    assert 0 < typical < 0.05, gaps  # (0: the cache was not fp8)


def test_the_triton_kernels_read_an_fp8_cache_as_torch_native_does():
    """Six tokens on the Triton kernels (Triton's interpreter: a prefill and five decode steps, each reading the fp8
    cache) against the first six of torch_native's twelve (greedy: a shorter run is the longer one's start)."""
    path = model_path("tiny-llama")
    prompts = parity_prompts(path)[:3]
    n = 6
    want = _torch_native("fp8_e4m3")
    with running_engine(path, kv_cache_dtype="fp8_e4m3", attention_backend="triton", skip_tokenizer_init=True) as llm:
        got = llm.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": n}, return_logprob=True)
    assert [o["output_ids"] for o in got] == [o["output_ids"][:n] for o in want]
    for a, b in zip(got, want):
        assert [x[0] for x in a["meta_info"]["output_token_logprobs"]] == pytest.approx(
            [x[0] for x in b["meta_info"]["output_token_logprobs"]][:n], abs=1e-4)


def test_the_hierarchical_cache_brings_fp8_pages_back_unchanged():
    """Conversations turn by turn on an engine whose device pool is too small for them (pages go to host memory and
    come back) and on one that holds them all: every prefix is cached on both, so both read the same fp8 bytes and
    answer alike, token for token."""
    path = model_path("tiny-llama")
    rng = random.Random(0)
    convs = [[rng.randrange(5, 900) for _ in range(60)] for _ in range(6)]
    common = dict(kv_cache_dtype="fp8_e4m3", skip_tokenizer_init=True, page_size=4)
    with running_engine(path, max_total_tokens=4096, **common) as roomy, \
            running_engine(path, max_total_tokens=192, enable_hierarchical_cache=True, hicache_ratio=8,
                           **common) as tiered:
        for _ in range(3):
            for i, conv in enumerate(convs):
                want = roomy.generate(input_ids=conv, sampling_params=GREEDY)
                got = tiered.generate(input_ids=conv, sampling_params=GREEDY)
                assert got["output_ids"] == want["output_ids"]
                assert got["meta_info"]["cached_tokens"] == want["meta_info"]["cached_tokens"]
                convs[i] = conv + want["output_ids"] + [rng.randrange(5, 900) for _ in range(8)]
        assert tiered.get_load()["host_hit_tokens"] > 0  # pages did come back from host memory
