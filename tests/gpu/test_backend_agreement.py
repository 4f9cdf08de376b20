"""Every attention backend against torch_native inside the whole engine on CUDA: the tiny models in float32 give the
same greedy tokens with CUDA graphs and overlap scheduling on or off; the Llama-3.1-8B shape (bfloat16, dummy
weights) stays within bf16 tolerance (the first 32 greedy tokens identical for most prompts, logprobs close)."""

from __future__ import annotations

import gc
import importlib.util

import pytest
import torch

from tests.conftest import TINY_MODELS, model_path
from tests.engine_utils import parity_prompts, running_engine

pytestmark = pytest.mark.gpu

LLAMA_8B = "benchmarks/configs/llama-3.1-8b"
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
GREEDY = {"max_new_tokens": 32, "temperature": 0}


def _outputs(path: str, prompts, **kwargs) -> list[dict]:
    with running_engine(path, device="cuda", mem_fraction_static=0.5, random_seed=0, **kwargs) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    del llm
    gc.collect()  # the next engine sizes its KV pool from the free memory
    torch.cuda.empty_cache()
    return outs


@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.parametrize("graphs,overlap", [(True, True), (False, False), (True, False)])
def test_tiny_float32_triton_equals_torch_native(name, graphs, overlap):
    path = model_path(name)
    prompts = parity_prompts(path)
    want = _outputs(path, prompts, dtype="float32", attention_backend="torch_native", page_size=16,
                    chunked_prefill_size=64)
    got = _outputs(path, prompts, dtype="float32", attention_backend="triton", page_size=16, chunked_prefill_size=64,
                   disable_cuda_graph=not graphs, disable_overlap_schedule=not overlap)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]


def _llama_prompts(n: int = 16, length: int = 200) -> list[list[int]]:
    gen = torch.Generator().manual_seed(8)
    return torch.randint(1000, 120000, (n, length), generator=gen).tolist()


BACKENDS_8B = ["triton"] + (["flashinfer"] if HAS_FLASHINFER else [])


@pytest.mark.parametrize("backend", BACKENDS_8B)
def test_llama8b_shape_bf16_agrees_with_torch_native(backend):
    prompts = _llama_prompts()
    common = dict(load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, max_running_requests=16,
                  context_length=512, page_size=16)
    want = _outputs(LLAMA_8B, prompts, attention_backend="torch_native", **common)
    got = _outputs(LLAMA_8B, prompts, attention_backend=backend, **common)
    same = sum(g["output_ids"] == w["output_ids"] for g, w in zip(got, want))
    assert same >= 0.75 * len(prompts), f"{backend}: {same}/{len(prompts)} prompts with identical 32 tokens"
    # Logprobs of the tokens both chose, up to the first divergence: bf16 attention and rounding differ by ~1e-2.
    diffs = []
    for g, w in zip(got, want):
        for (lg, tg, _), (lw, tw, _) in zip(g["meta_info"]["output_token_logprobs"],
                                            w["meta_info"]["output_token_logprobs"]):
            if tg != tw:
                break
            diffs.append(abs(lg - lw))
    assert max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.02, (max(diffs), sum(diffs) / len(diffs))
