"""Speculative decoding under tensor parallelism on CPU (gloo): the draft runs on the leader alone, unsharded (only
the leader samples; the other ranks see the drafts as the verify's input tokens), an EAGLE head there with whole
copies of the target's embedding and output layer read from its checkpoint (engine.speculative.whole_vocab).

TP=2 with STANDALONE, EAGLE, EAGLE3 and NGRAM gives one process's greedy tokens (through chunked prefills and prefix
hits) and proposes, request by request, the drafts one process proposes (EAGLE: the reference head's, recomputed from
scratch with transformers). Draft trees under tensor parallelism, and an EAGLE-1 head whose target transforms its
logits, are refused at start, naming the flags. A TP=2 prefill/decode handoff carries an EAGLE-3 head's state."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine
from tests.parity.test_pd_speculative import drafts  # noqa: F401 - the fixture
from tests.parity.test_speculative_eagle import ReferenceHead, record_proposals

pytestmark = pytest.mark.timeout(300)
NAME = "tiny-llama"
OPTS = {"page_size": 16, "chunked_prefill_size": 64, "max_total_tokens": 4096}
GREEDY = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}


def _prompts() -> list[list[int]]:
    """Through chunked prefills (a 3x-repeated prompt past the 64-token chunk) and prefix hits."""
    base = parity_prompts(model_path(NAME))
    return [base[1] * 3, base[3], base[5], base[7]]


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    """One process's greedy output ids for _prompts() * 2 (no speculation): computed once for the file's tests."""
    with running_engine(model_path(NAME), **OPTS) as llm:
        return [o["output_ids"] for o in llm.generate(input_ids=_prompts() * 2, sampling_params=GREEDY)]


def _spec(algorithm: str, paths: dict[str, str]) -> dict:
    if algorithm == "NGRAM":
        return {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6}
    # STANDALONE: the target drafting for itself, so that most drafts are kept and the verifies differ in length
    path = model_path(NAME) if algorithm == "STANDALONE" else paths[algorithm]
    return {"speculative_algorithm": algorithm, "speculative_num_steps": 3, "speculative_draft_model_path": path}


def _run(llm, prompts: list[list[int]]) -> tuple[list[list[int]], list[tuple[list[int], list[int]]], list[int]]:
    """Outputs, every (fill, drafts) proposal, and the drafts each request kept; prompts one at a time, twice (the
    second time from the prefix cache)."""
    seen = record_proposals(llm) if llm.scheduler.spec.model is not None else []
    outs = [llm.generate(input_ids=ids, sampling_params=GREEDY) for _ in range(2) for ids in prompts]
    return [o["output_ids"] for o in outs], seen, [o["meta_info"]["spec_accept_token_num"] for o in outs]


@pytest.mark.parametrize("algorithm", ["STANDALONE", "EAGLE", "EAGLE3", "NGRAM"])
def test_tp2_drafts_and_decodes_as_one_process(algorithm, drafts, plain):  # noqa: F811 - the fixture
    path = model_path(NAME)
    prompts = _prompts()
    spec = _spec(algorithm, drafts)
    want = plain
    with running_engine(path, tp_size=2, **OPTS, **spec) as many:
        assert many.runner.tp.size == 2
        assert many.draft_runner is None or many.draft_runner.tp.size == 1  # the leader's, whole
        got, seen, kept = _run(many, prompts)
    assert got == want
    if algorithm.startswith("EAGLE"):
        reference = ReferenceHead(drafts[algorithm], path, algorithm.lower())
        assert len(seen) >= len(want)
        for fill, proposed in seen:
            assert proposed == reference.drafts(fill, len(proposed)), len(fill)
        return
    with running_engine(path, **OPTS, **spec) as one:
        _, alone, kept_alone = _run(one, prompts)
    assert seen == alone and kept == kept_alone
    assert sum(kept) > 0


def test_tp2_eagle_head_of_a_tied_target_drafts_as_the_reference(tmp_path):
    """tiny-qwen2 ties its output layer to its embedding: the leader's whole copy serves both."""
    from tests.parity.test_speculative_eagle import write_head

    path = model_path("tiny-qwen2")
    head = write_head(tmp_path / "head", path, "eagle")
    prompts = parity_prompts(path)[2:5]
    with running_engine(path, **OPTS) as plain:
        want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=GREEDY)]
    with running_engine(path, tp_size=2, **OPTS, speculative_algorithm="EAGLE", speculative_draft_model_path=head,
                        speculative_num_steps=3) as many:
        seen = record_proposals(many)
        got = [many.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] for ids in prompts]
    assert got == want
    reference = ReferenceHead(head, path, "eagle")
    assert len(seen) >= len(prompts)
    for fill, proposed in seen:
        assert proposed == reference.drafts(fill, len(proposed)), len(fill)


def test_a_tp2_handoff_carries_the_eagle_head_s_state(drafts, plain):  # noqa: F811 - the fixture
    """Prefill/decode disaggregation under TP=2 (one engine in both roles, the services' KvTransfer over every rank's
    mirror, tests.api.test_tp_disaggregation): the head's state of the prompt is the leader's alone, and the
    decode-role requests draft what the reference head drafts."""
    import asyncio

    from radixmesh.services.common.kv_transfer import KvTransfer
    from tests.api.test_tp_disaggregation import _handoff

    path = model_path(NAME)
    prompts = [_prompts()[i] for i in (0, 1, 3)]
    want = [plain[i] for i in (0, 1, 3)]
    with running_engine(path, tp_size=2, **OPTS, **_spec("EAGLE3", drafts)) as llm:
        seen = record_proposals(llm)
        transfer = KvTransfer(llm, "fake", "127.0.0.1")
        try:
            async def run():
                return [await _handoff(llm, llm, transfer, transfer, ids, GREEDY) for ids in prompts]
            got = asyncio.run(run())
        finally:
            transfer.close()
    assert [o["output_ids"] for o in got] == want
    reference = ReferenceHead(drafts["EAGLE3"], path, "eagle3")
    assert len(seen) >= len(prompts)
    for fill, proposed in seen:
        assert proposed == reference.drafts(fill, len(proposed)), len(fill)


def test_a_draft_tree_under_tp_is_refused_at_start(drafts):  # noqa: F811 - the fixture
    from radixmesh.engine import Engine

    with pytest.raises(ValueError, match=r"speculative_eagle_topk 2 \(a draft tree\) with tensor parallelism "
                                         r"\(tp_size 2\) is not implemented"):
        Engine(model_path=model_path(NAME), device="cpu", tp_size=2, decode_attention_backend="torch_native",
               speculative_algorithm="EAGLE", speculative_eagle_topk=2,
               speculative_draft_model_path=drafts["EAGLE"])


def test_an_eagle1_head_is_refused_for_a_target_transforming_its_logits():
    from radixmesh.engine.model_config import ModelConfig
    from radixmesh.engine.models.llama import LlamaForCausalLM
    from radixmesh.engine.speculative.whole_vocab import WholeVocab

    class Capped(LlamaForCausalLM):
        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return torch.tanh(super().compute_logits(hidden) / 30) * 30

    target = Capped.__new__(Capped)
    torch.nn.Module.__init__(target)
    target.config = ModelConfig.from_path(model_path(NAME))
    with pytest.raises(ValueError, match="use tp_size 1, or an EAGLE3 head"):
        WholeVocab(target, logits=True)
