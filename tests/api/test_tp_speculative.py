"""Speculative decoding under tensor parallelism on CPU (gloo): the draft runs on the leader alone, unsharded (only
the leader samples; the other ranks see the drafts as the verify's input tokens), an EAGLE head there with whole
copies of the target's embedding and output layer read from its checkpoint (engine.speculative.whole_vocab).

TP=2 with STANDALONE, EAGLE, EAGLE3 and NGRAM gives one process's greedy tokens (through chunked prefills and prefix
hits) and proposes, request by request, the drafts one process proposes (EAGLE: the reference head's, recomputed from
scratch with transformers). An EAGLE-1 head whose target transforms its logits is refused at start, naming the flags.
A TP=2 prefill/decode handoff carries an EAGLE-3 head's state. (Draft trees under tensor parallelism:
tests/api/test_tp_speculative_tree.py.)"""

from __future__ import annotations

import contextlib
import functools

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


@pytest.fixture(scope="module")
def eagle3_tp2(drafts):  # noqa: F811 - the fixture
    """The TP=2 engine with the EAGLE-3 head, shared by the parity test and the handoff test (each of its followers is
    a process that imports torch and loads the model: most of a TP test's CPU). Each test flushes its cache first, so
    it starts cold whichever ran before."""
    with running_engine(model_path(NAME), tp_size=2, **OPTS, **_spec("EAGLE3", drafts)) as llm:
        yield llm


@functools.cache
def _reference(head: str, target: str, kind: str) -> ReferenceHead:
    return ReferenceHead(head, target, kind)


@functools.cache
def _reference_drafts(head: str, target: str, kind: str, fill: tuple[int, ...], k: int) -> list[int]:
    """The reference head's k drafts after `fill`, computed once per fill: the second pass over the prompts (from the
    prefix cache) and the handoff test propose after the same fills as the first pass."""
    return _reference(head, target, kind).drafts(list(fill), k)


def _assert_reference_drafts(seen: list[tuple[list[int], list[int]]], head: str, target: str, kind: str) -> None:
    """Every proposal is the reference head's drafts for its fill (each distinct proposal checked once)."""
    for fill, proposed in dict.fromkeys((tuple(f), tuple(p)) for f, p in seen):
        assert list(proposed) == _reference_drafts(head, target, kind, fill, len(proposed)), len(fill)


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
    assert len(seen) >= len(prompts)
    _assert_reference_drafts(seen, head, path, "eagle")


# EAGLE3 last, and the handoff test right after it: they share the eagle3_tp2 engine, which lives to the end of the
# module, and a process holds one tensor-parallel group at a time (no other TP engine may start after it)
@pytest.mark.parametrize("algorithm", ["STANDALONE", "EAGLE", "NGRAM", "EAGLE3"])
def test_tp2_drafts_and_decodes_as_one_process(algorithm, drafts, plain, request):  # noqa: F811 - the fixture
    path = model_path(NAME)
    prompts = _prompts()
    spec = _spec(algorithm, drafts)
    want = plain
    with (contextlib.nullcontext(request.getfixturevalue("eagle3_tp2")) if algorithm == "EAGLE3" else
          running_engine(path, tp_size=2, **OPTS, **spec)) as many:
        assert many.flush_cache() is True  # cold, as a fresh engine would be
        assert many.runner.tp.size == 2
        assert many.draft_runner is None or many.draft_runner.tp.size == 1  # the leader's, whole
        got, seen, kept = _run(many, prompts)
    assert got == want
    if algorithm.startswith("EAGLE"):
        assert len(seen) >= len(want)
        _assert_reference_drafts(seen, drafts[algorithm], path, algorithm.lower())
        return
    with running_engine(path, **OPTS, **spec) as one:
        _, alone, kept_alone = _run(one, prompts)
    assert seen == alone and kept == kept_alone
    assert sum(kept) > 0


def test_a_tp2_handoff_carries_the_eagle_head_s_state(drafts, plain, eagle3_tp2):  # noqa: F811 - the fixture
    """Prefill/decode disaggregation under TP=2 (one engine in both roles, the services' KvTransfer over every rank's
    mirror, tests.api.test_tp_disaggregation): the head's state of the prompt is the leader's alone, and the
    decode-role requests draft what the reference head drafts."""
    import asyncio

    from radixmesh.services.common.kv_transfer import KvTransfer
    from tests.api.test_tp_disaggregation import _handoff

    path = model_path(NAME)
    prompts = [_prompts()[i] for i in (0, 1, 3)]
    want = [plain[i] for i in (0, 1, 3)]
    llm = eagle3_tp2
    assert llm.flush_cache() is True  # the prompts' KV all moves, as on a fresh engine
    seen = record_proposals(llm)
    transfer = KvTransfer(llm, "fake", "127.0.0.1")
    try:
        async def run():
            return [await _handoff(llm, llm, transfer, transfer, ids, GREEDY) for ids in prompts]
        got = asyncio.run(run())
    finally:
        transfer.close()
    assert [o["output_ids"] for o in got] == want
    assert len(seen) >= len(prompts)
    _assert_reference_drafts(seen, drafts["EAGLE3"], path, "eagle3")


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
