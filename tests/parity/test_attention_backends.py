"""The triton attention backend inside the engine (on CPU in Triton's interpreter, float32) gives transformers' greedy
tokens, with chunked prefill over cached prefixes and paging, alone or mixed with torch_native (SGLang's
--prefill-attention-backend / --decode-attention-backend)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine
from tests.reference import hf_greedy

MAX_NEW = 3  # a prefill and two decode steps a pass: the second decode step reads a key the first one stored
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("name,page,backends", [
    ("tiny-llama", 16, ("triton", "triton")),
    ("tiny-qwen3", 1, ("triton", "triton")),  # head_dim 48: masked head lanes
    ("tiny-qwen2", 4, ("triton", "torch_native")),
    ("tiny-qwen2", 1, ("torch_native", "triton")),
])
def test_greedy_parity(name, page, backends):
    path = model_path(name)
    shared = parity_prompts(path)[4:6]  # 120 shared tokens and 5 and 13 of their own
    # 33 and 41 tokens sharing 28: each still longer than a chunk of 32, so both are cut, in few tokens (the
    # interpreter's extend walks every cached block of every chunk)
    prompts = [p[:28] + p[120:] for p in shared]
    refs = hf_greedy(path, prompts, MAX_NEW)
    prefill, decode = backends
    with running_engine(path, device=DEVICE, page_size=page, chunked_prefill_size=32, attention_backend=prefill,
                        decode_attention_backend=decode, disable_cuda_graph=True) as llm:
        assert llm.runner.attn_backend.name in (prefill, f"{prefill}+{decode}")
        first = llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0})
        again = llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0})
    assert [o["output_ids"] for o in first] == refs
    assert [o["output_ids"] for o in again] == refs
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)
