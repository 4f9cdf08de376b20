"""On CUDA (Triton kernels: rotary over the scaled tables, attention with Granite's score scale; decode in CUDA
graphs) in float32, Phi-3, OLMo 2, Granite, Gemma 1, Gemma 3 served from Gemma3ForConditionalGeneration, Cohere,
StableLM, StarCoder2, Cohere 2 (global layers unrotated), Phi, GLM-4, OLMo and the RoPE scalings greedy-match
transformers' float32 reference, with logprobs within 1e-3, on the checkpoints the CPU parity tests build
(tests/parity/test_model_families.py, test_model_families_more.py, test_model_families_third.py,
test_rope_parity.py)."""

from __future__ import annotations

import pytest

from tests.engine_utils import running_engine
from tests.parity import test_model_families as families
from tests.parity import test_model_families_more as more
from tests.parity import test_model_families_third as third
from tests.parity import test_rope_parity as scalings
from tests.reference import hf_greedy, hf_token_logprobs

pytestmark = pytest.mark.gpu


def _check(path: str, prompts: list[list[int]], **serve) -> None:
    refs = hf_greedy(path, prompts, 16)
    with running_engine(path, device="cuda", dtype="float32", skip_tokenizer_init=True, page_size=16,
                        mem_fraction_static=0.3, **serve) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": 16, "temperature": 0},
                            return_logprob=True)
    assert [o["output_ids"] for o in outs] == refs
    for prompt, ref, out in zip(prompts, refs, outs):
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(hf_token_logprobs(path, prompt, ref), abs=1e-3)


@pytest.mark.parametrize("name", families.FAMILIES)
def test_families_on_cuda(tmp_path, name):
    seed = 100 + list(families.FAMILIES).index(name)
    _check(families.write_checkpoint(tmp_path, *families.FAMILIES[name], seed=seed), families.PROMPTS,
           **families.SERVE.get(name, {}))


@pytest.mark.parametrize("name", [*more.FAMILIES, more.MULTIMODAL])
def test_more_families_on_cuda(tmp_path, name):
    _check(more.build(name, tmp_path), more.PROMPTS)


@pytest.mark.parametrize("name", third.FAMILIES)
def test_third_families_on_cuda(tmp_path, name):
    _check(third.build(name, tmp_path), more.PROMPTS)


@pytest.mark.parametrize("name", scalings.SCALINGS)
def test_rope_scalings_on_cuda(tmp_path, name):
    seed = 200 + list(scalings.SCALINGS).index(name)
    _check(scalings.write_scaled(tmp_path, *scalings.SCALINGS[name], seed=seed), scalings.prompts_for(name),
           chunked_prefill_size=48)
