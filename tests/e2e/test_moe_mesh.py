"""A mixture-of-experts model through the launched mesh: `radixmesh serve` on the tiny Qwen3-MoE answers as the
offline Engine does (the same text, logprobs within 1e-5), streamed and not, colocated, disaggregated (prefill and
decode workers, KV checksummed) and with the hierarchical cache (a device pool small enough that the prompts' pages
go to the host and the kvstore and come back)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import model_path
from tests.e2e.mesh import http_get, openai_client, running_mesh
from tests.engine_utils import running_engine

NAME = model_path("tiny-qwen3-moe")
SHARED = "The history of the lighthouse keepers on the northern coast is long and full of storms. "
PROMPTS = ["The history of the lighthouse keepers", "Once upon a time", SHARED * 3 + "Who kept them?",
           SHARED * 3 + "What did they eat?"]
MESHES = {
    "colocated": (),
    "pd": ("--disaggregation", "pd", "--disaggregation-transfer-backend", "shm", "--disaggregation-verify-kv"),
    "hicache": ("--kvstore", "--enable-hierarchical-cache", "--hicache-ratio", "4", "--page-size", "4",
                "--max-total-tokens", "160"),
}


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    with running_engine(NAME) as llm:
        return [llm.generate(p, {"max_new_tokens": 12, "temperature": 0}, return_logprob=True) for p in PROMPTS]


@pytest.mark.parametrize("kind", MESHES)
def test_the_mesh_serves_a_mixture_of_experts_as_the_engine_does(tmp_path, reference, kind):
    with running_mesh(NAME, tmp_path, *MESHES[kind]) as mesh, openai_client(mesh) as client:
        for _ in range(2):  # the second pass reads the prompts' cached pages (from the host or the kvstore)
            for prompt, ref in zip(PROMPTS, reference):
                out = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=1)
                choice = out.choices[0]
                assert choice.text == ref["text"], (kind, prompt)
                ref_lps = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
                assert choice.logprobs.token_logprobs == pytest.approx(ref_lps, abs=1e-5)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True))
        assert streamed == reference[0]["text"]
        if kind == "hicache":  # pages went to the host pool and the kvstore, and some came back from the host
            status, body = http_get(mesh.url + "/get_server_info")
            assert status == 200, body
            state = json.loads(body)["workers"][0]["internal_states"][0]
            assert state["evicted_tokens"] > 0 and state["host_hit_tokens"] > 0, state
            assert state["storage_written_pages"] > 0, state
