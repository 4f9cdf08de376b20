"""On CUDA in bfloat16, the tiny models' first 16 greedy tokens match transformers run in bfloat16 on the same
device, with the prefix cache, paging and chunked prefill on."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY_MODELS, model_path
from tests.engine_utils import parity_prompts, running_engine
from tests.reference import hf_greedy, hf_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.parametrize("page", [1, 16])
def test_bf16_parity_on_cuda(name, page):
    path = model_path(name)
    prompts = parity_prompts(path)
    refs = hf_greedy(path, prompts, 16, dtype=torch.bfloat16, device="cuda")
    with running_engine(path, device="cuda", dtype="bfloat16", page_size=page, chunked_prefill_size=64,
                        mem_fraction_static=0.3) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": 16, "temperature": 0})
        assert [o["output_ids"] for o in outs] == refs
        again = llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": 16, "temperature": 0})
        assert [o["output_ids"] for o in again] == refs


def test_sampling_and_logprobs_on_cuda():
    """The device sampler (penalties, filters, seeds, logit_bias) and logprob paths run on CUDA, seeded
    outputs repeat, and prompt logprobs match transformers run in float32 on the same device."""
    path = model_path("tiny-llama")
    prompts = parity_prompts(path)[:6]
    params = {"max_new_tokens": 16, "temperature": 0.9, "top_p": 0.9, "top_k": 20, "min_p": 0.01,
              "frequency_penalty": 0.4, "repetition_penalty": 1.2, "sampling_seed": 11, "logit_bias": {"40": 1.5}}
    with running_engine(path, device="cuda", dtype="float32", mem_fraction_static=0.3) as llm:
        a = llm.generate(input_ids=prompts, sampling_params=params)
        b = llm.generate(input_ids=prompts[::-1], sampling_params=params)[::-1]
        scored = llm.generate(input_ids=prompts[2], sampling_params={"max_new_tokens": 0}, return_logprob=True,
                              logprob_start_len=1, top_logprobs_num=3)
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    with torch.inference_mode():
        ids = torch.tensor([prompts[2]], device="cuda")
        ref = torch.log_softmax(hf_model(path, torch.float32, "cuda")(ids).logits[0].float(), -1)
    want = [ref[i - 1, prompts[2][i]].item() for i in range(1, len(prompts[2]))]
    got = [lp for lp, _, _ in scored["meta_info"]["input_token_logprobs"]]
    assert got == pytest.approx(want, abs=1e-3)
