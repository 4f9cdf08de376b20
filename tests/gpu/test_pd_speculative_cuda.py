"""An EAGLE / EAGLE-3 head on the decode side of prefill/decode disaggregation on CUDA (two engines in one process,
the services' own functions carrying the head's state: tests/parity/test_pd_speculative.py): the prefill engine's
head catches up over the prompt on the GPU, its KV rows leave as device copies and reach the host in the sender's
thread, the decode engine writes them into its head's pool and drafts in CUDA graphs. Every draft equals the one a
colocated engine of the same options proposes, and the outputs are the plain engine's (float32, pages of 16 tokens:
the prefill side's token-granular hits against the decode side's page-aligned ones on the second round)."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine

pytestmark = pytest.mark.gpu
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_a_decode_worker_on_cuda_drafts_as_a_colocated_one(algorithm, tmp_path):
    from tests.parity.test_pd_speculative import Pair
    from tests.parity.test_speculative_eagle import record_proposals, write_head

    path = model_path("tiny-llama")
    base = parity_prompts(path)
    prompts = [base[1] * 3, base[2][:9] * 6, base[3], base[7]] * 2  # the second round from both sides' caches
    head = write_head(tmp_path / "head", path, algorithm.lower())
    common = dict(device="cuda", dtype="float32", page_size=16, attention_backend="triton", skip_tokenizer_init=True,
                  max_total_tokens=8192)
    spec = dict(speculative_algorithm=algorithm, speculative_draft_model_path=head, speculative_num_steps=3)
    with running_engine(path, **common) as plain:
        want = [plain.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] for ids in prompts]
    with running_engine(path, **common, **spec) as colocated:
        alone_seen = record_proposals(colocated)
        alone = [colocated.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] for ids in prompts]
    with running_engine(path, **common, **spec) as p, running_engine(path, **common, **spec) as d:
        assert d.draft_runner.graphs is not None
        pair = Pair(p, d)
        seen = record_proposals(d)

        async def run():
            return [await pair.generate(ids, GREEDY) for ids in prompts]
        got = [o["output_ids"] for o in asyncio.run(run())]
    assert got == want == alone
    assert all(read for *_, read in pair.sent), pair.sent
    assert seen == alone_seen and len(seen) > 10
