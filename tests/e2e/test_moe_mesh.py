"""A mixture-of-experts model through the launched mesh: `radixmesh serve` on the tiny Qwen3-MoE answers as the
offline Engine does (the same text, logprobs within 1e-5), streamed and not, with a prompt that shares a cached
prefix with an earlier one."""

from __future__ import annotations

import pytest

from tests.conftest import model_path
from tests.e2e.mesh import openai_client, running_mesh
from tests.engine_utils import running_engine

NAME = model_path("tiny-qwen3-moe")
PROMPTS = ["The history of the lighthouse keepers", "Once upon a time", "The history of the lighthouse keepers is"]


@pytest.fixture(scope="module")
def moe_mesh(tmp_path_factory):
    with running_mesh(NAME, tmp_path_factory.mktemp("moe")) as m:
        yield m


def test_the_mesh_serves_a_mixture_of_experts_as_the_engine_does(moe_mesh):
    with running_engine(NAME) as llm:
        want = [llm.generate(p, {"max_new_tokens": 12, "temperature": 0}, return_logprob=True) for p in PROMPTS]
    with openai_client(moe_mesh) as client:
        for prompt, ref in zip(PROMPTS, want):
            out = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=1)
            choice = out.choices[0]
            assert choice.text == ref["text"]
            ref_lps = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
            assert choice.logprobs.token_logprobs == pytest.approx(ref_lps, abs=1e-5)
            streamed = "".join(c.choices[0].text for c in client.completions.create(
                model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True))
            assert streamed == ref["text"]
