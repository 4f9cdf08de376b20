"""Multi-LoRA on CUDA (issue 54): the two peft adapters of tests/parity/test_lora.py and the base model in one batch on
the GPU, float32, with Triton and torch_native attention, token-exact with transformers + peft; the engine says CUDA
graphs are off while LoRA is on, and nothing leaks."""

from __future__ import annotations

import pytest

from tests.conftest import model_path
from tests.engine_utils import assert_no_leak, parity_prompts, running_engine
from tests.parity.test_lora import ADAPTERS, NAME, NEW, peft_greedy, write_adapter
from tests.reference import hf_greedy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["triton", "torch_native"])
def test_adapters_and_the_base_in_one_batch_on_cuda_match_peft(backend, tmp_path):
    base = model_path(NAME)
    paths = {name: write_adapter(base, tmp_path / name, r, a, t, rs, seed=i)
             for i, (name, r, a, t, rs) in enumerate(ADAPTERS)}
    prompts = parity_prompts(base)[:4]
    want = {None: hf_greedy(base, prompts, NEW), **{n: peft_greedy(base, p, prompts) for n, p in paths.items()}}
    with running_engine(base, device="cuda", dtype="float32", attention_backend=backend, enable_lora=True,
                        lora_paths=[f"{n}={p}" for n, p in paths.items()], max_total_tokens=8192) as llm:
        assert llm.runner.graphs is None
        names = [None, "sql", "chat"] * len(prompts)
        outs = llm.generate(input_ids=[p for p in prompts for _ in range(3)], lora_path=names,
                            sampling_params={"temperature": 0, "max_new_tokens": NEW})
        assert [o["output_ids"] for o in outs] == [want[n][i] for i in range(len(prompts))
                                                   for n in (None, "sql", "chat")]
        assert_no_leak(llm)
