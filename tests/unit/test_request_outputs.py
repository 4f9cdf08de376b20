"""Typed engine outputs (engine.outputs.RequestOutput): the SGLang dicts the public API makes of them, the worker's
protos made from them, and a finish reason's way over the wire back into the router's typed FinishReason."""

from __future__ import annotations

import pytest

from radixmesh.engine.outputs import Logprobs, RequestOutput
from radixmesh.engine.request import FinishKind, FinishReason, LogprobSpec, StepOutput
from radixmesh.engine.results import BatchCollector, RequestSpec, ResultBuilder
from radixmesh.engine.sampling.params import SamplingParams
from radixmesh.services.router import convert as router_convert
from radixmesh.services.worker import convert as worker_convert
from radixmesh.v1 import common_pb2

REASONS = [FinishReason(FinishKind.STOP, matched=7), FinishReason(FinishKind.STOP, matched="END"),
           FinishReason(FinishKind.STOP), FinishReason(FinishKind.LENGTH, length=16),
           FinishReason(FinishKind.ABORT, message="the client stopped listening")]


def _step(ids, done=False, reason=None, logprobs=None, tops=None, by_id=None, inputs=None) -> StepOutput:
    return StepOutput("r", ids, logprobs, tops, by_id, done, reason, 3, len(ids), 1, input_logprobs=inputs)


def test_to_dict_is_sglangs_shape():
    out = RequestOutput("r", "hi", [5, 6], 3, 2, 1, REASONS[3])
    assert out.to_dict() == {"text": "hi", "output_ids": [5, 6], "meta_info": {
        "id": "r", "prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 1,
        "finish_reason": {"type": "length", "length": 16}}}
    out.index, out.finish_reason = 1, None
    assert out.to_dict()["index"] == 1 and out.to_dict()["meta_info"]["finish_reason"] is None
    assert not out.finished


@pytest.mark.parametrize("spec, keys", [
    (LogprobSpec(), ["input_token_logprobs", "input_top_logprobs", "output_token_logprobs"]),
    (LogprobSpec(top_logprobs_num=2), ["input_token_logprobs", "input_top_logprobs", "output_token_logprobs",
                                       "output_top_logprobs"]),
    (LogprobSpec(token_ids_logprob=(4,), start=0), ["input_token_logprobs", "input_top_logprobs",
                                                    "input_token_ids_logprobs", "output_token_logprobs",
                                                    "output_token_ids_logprobs"]),
])
def test_meta_info_keys_follow_what_the_request_asked(spec, keys):
    builder = ResultBuilder(RequestSpec("r", [1, 2, 3], SamplingParams(), spec), None, stream=False)
    builder.push(_step([9], True, REASONS[0], [-0.5], [[(-0.5, 9), (-1.0, 4)]], [[(-2.0, 4)]],
                       ([-0.1, -0.2], [[(-0.1, 2)], [(-0.2, 3)]], [[(-0.3, 4)], [(-0.4, 4)]])))
    meta = builder.result().to_dict()["meta_info"]
    assert list(meta) == ["id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", *keys]
    assert meta["output_token_logprobs"] == [(-0.5, 9, None)]
    if spec.top_logprobs_num:
        assert meta["output_top_logprobs"] == [[(-0.5, 9, None), (-1.0, 4, None)]]
    if spec.start == 0:
        assert meta["input_token_logprobs"] == [(None, 1, None), (-0.1, 2, None), (-0.2, 3, None)]
        assert meta["input_token_ids_logprobs"] == [None, [(-0.3, 4, None)], [(-0.4, 4, None)]]


def test_batch_collector_tags_deltas_and_returns_dicts_at_the_edge():
    specs = [RequestSpec(f"r{i}", [1, 2], SamplingParams(), None) for i in range(2)]
    streamed = BatchCollector(specs, None, stream=True, is_batch=True)
    delta = streamed.record(1, _step([4]))
    assert isinstance(delta, RequestOutput) and delta.index == 1 and delta.output_ids == [4]
    whole = BatchCollector(specs, None, stream=False, is_batch=True)
    assert whole.record(0, _step([4], True, REASONS[3])) is None
    whole.record(1, _step([5, 6], True, REASONS[0]))
    assert [o.output_ids for o in whole.outputs] == [[4], [5, 6]]
    assert whole.results[1] == {"text": "", "output_ids": [5, 6], "meta_info": {
        "id": "r1", "prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 1,
        "finish_reason": {"type": "stop", "matched": 7}}}


@pytest.mark.parametrize("reason", REASONS, ids=lambda r: f"{r.kind.value}-{r.matched}")
def test_a_finish_reason_crosses_the_wire_typed(reason):
    msg = worker_convert.finish_reason(reason)
    back = router_convert.finish_reason(common_pb2.FinishReason.FromString(msg.SerializeToString()))
    assert back.to_dict() == reason.to_dict()
    assert back.kind is reason.kind


def test_an_unspecified_finish_reason_reads_as_an_abort():
    assert router_convert.finish_reason(common_pb2.FinishReason()).to_dict() == {"type": "abort", "message": ""}


def test_worker_messages_from_typed_outputs():
    lp = Logprobs(output=[(-0.5, 9, "a")], input=[(None, 1, "x"), (-0.1, 2, "y")], input_top=[None, [(-0.1, 2, "y")]],
                  output_top=[[(-0.5, 9, "a"), (-1.5, 4, "b")]])
    out = RequestOutput("r", "a", [9], 2, 1, 0, REASONS[1], lp, index=0)
    chunk = worker_convert.chunk(out, with_input_logprobs=True)
    assert (list(chunk.token_ids), chunk.text, chunk.prompt_tokens, chunk.completion_tokens) == ([9], "a", 2, 1)
    assert chunk.finish_reason.matched_stop_str == "END"
    assert list(chunk.output_logprobs.top_logprobs[0].token_ids) == [9, 4]
    assert list(chunk.input_logprobs.token_ids) == [1, 2] and len(chunk.input_logprobs.top_logprobs[0].token_ids) == 0
    assert not worker_convert.chunk(out, with_input_logprobs=False).HasField("input_logprobs")
    done = worker_convert.complete([9], "a", out, with_logprobs=True)
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (2, 1)
    assert done.HasField("output_logprobs") and done.HasField("input_logprobs")
    plain = worker_convert.chunk(RequestOutput("r", "", [], 2, 0, 0), with_input_logprobs=True)
    assert not plain.HasField("output_logprobs") and not plain.HasField("finish_reason")
