"""On CUDA in bfloat16, the tiny models' first 16 greedy tokens match transformers run in bfloat16 on the same
device, with the prefix cache, paging and chunked prefill on."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY_MODELS, model_path
from tests.engine_utils import parity_prompts, running_engine
from tests.reference import hf_greedy

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
