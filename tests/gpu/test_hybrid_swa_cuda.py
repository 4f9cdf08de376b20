"""Hybrid SWA memory on CUDA (engine.cache.swa_pool): Gemma 2 and Gemma 3's sliding layers in a pool of their own, read
through their own page table by the Triton kernels (and FlashInfer's window page lists) and written through the
full-slot -> SWA-slot map inside captured CUDA graphs, with a pool small enough that cached pages lose their SWA
partners and hits are cut back (tests/parity/test_hybrid_swa_memory.py is the CPU twin).

float32 (Triton, torch_native): transformers' greedy tokens and teacher-forced logprobs within 1e-3, and a rerun over
the cached prefixes gives the same tokens. bfloat16 (Triton, FlashInfer): both runs within bfloat16 noise of
transformers' float32 logprobs (tests.sliding_models.check_runs). Both pools whole after every run.

On an H100 (2026-12-05) every float32 case and the bfloat16 Triton cases passed, and (2026-12-06) the FlashInfer
ones: CUDA engines with FlashInfer backends have the hybrid pool since. An H200's Gemma 2 failures earlier that day
were the reference's: transformers 5.17 runs Gemma 2 through SDPA, which drops the soft-cap (tests.reference.hf_model
asks for eager attention wherever scores are capped)."""

from __future__ import annotations

import pytest
import torch

from tests.engine_utils import running_engine
from tests.reference import hf_greedy
from tests.sliding_models import BF16_BACKENDS, build, check_runs, logprob_errors, prompts

pytestmark = pytest.mark.gpu

GREEDY = {"max_new_tokens": 40, "temperature": 0}
# a 2048-token full pool and a 192-token SWA pool: every prompt's cached window competes for it
SMALL = dict(max_total_tokens=2048, swa_full_tokens_ratio=0.09375, page_size=16, chunked_prefill_size=32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrid-swa-cuda")
    return {kind: build(kind, root / kind, head_dim=64) for kind in ("gemma2", "gemma3")}


def _generate(path: str, dtype: str, **kwargs) -> list[dict]:
    with running_engine(path, device="cuda", skip_tokenizer_init=True, mem_fraction_static=0.3, dtype=dtype, **SMALL,
                        **kwargs) as llm:
        assert llm.cache.hybrid is not None and llm.cache.hybrid.swa.num_pages == 12
        first = llm.generate(input_ids=prompts(), sampling_params=GREEDY, return_logprob=True)
        again = llm.generate(input_ids=prompts(), sampling_params=GREEDY, return_logprob=True)
        torch.cuda.synchronize()
        assert llm.cache.hybrid.freed_tokens > 0 and llm.cache.hybrid.evicted_tokens > 0
    check_runs(path, first, again, dtype)
    return first


@pytest.mark.parametrize("kind", ("gemma2", "gemma3"))
@pytest.mark.parametrize("backend,graphs", [("triton", True), ("triton", False), ("torch_native", False)])
def test_float32_matches_transformers(checkpoints, kind, backend, graphs):
    path = checkpoints[kind]
    outs = _generate(path, "float32", attention_backend=backend, disable_cuda_graph=not graphs)
    assert [o["output_ids"] for o in outs] == hf_greedy(path, prompts(), GREEDY["max_new_tokens"])
    assert max(logprob_errors(path, outs)) < 1e-3


@pytest.mark.parametrize("prefill,decode", BF16_BACKENDS)
@pytest.mark.parametrize("graphs", [True, False])
def test_bfloat16_within_noise_of_transformers(checkpoints, prefill, decode, graphs):
    _generate(checkpoints["gemma2"], "bfloat16", attention_backend=prefill, decode_attention_backend=decode,
              disable_cuda_graph=not graphs)  # (both runs within noise: check_runs)
