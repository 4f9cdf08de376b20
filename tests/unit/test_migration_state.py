"""What the router keeps of a streaming request for a migration (services/router/migration.py): per sample, the
tokens and characters the client has and whether the sample ended; the continuation of a single request, and of
each unfinished sample of an n > 1 request as a request of its own (id <id>-<j>, seed + j, n unset), resuming after
that sample's own tokens. The end-to-end runs (a worker killed under load) are tests/e2e/test_chaos.py and
test_migration.py."""

from __future__ import annotations

from radixmesh.v1 import common_pb2, worker_pb2
from radixmesh.services.router.migration import Streamed


def _chunk(index: int, ids: list[int], text: str, last: bool = False) -> worker_pb2.GenerateResponse:
    chunk = worker_pb2.GenerateStreamChunk(token_ids=ids, text=text)
    if last:
        chunk.finish_reason.CopyFrom(common_pb2.FinishReason(length=len(ids)))
    return worker_pb2.GenerateResponse(request_id="r", index=index, chunk=chunk)


def test_a_single_request_resumes_after_what_the_client_got():
    request = worker_pb2.GenerateRequest(request_id="r", input_ids=[1, 2, 3], resume_output_ids=[7],
                                         resume_text_chars=2)
    stream = Streamed(request)
    stream.saw(_chunk(0, [8, 9], "abc"))
    assert stream.why_not_migrate(0, 3) is None
    cont = stream.continuation()
    assert list(cont.resume_output_ids) == [7, 8, 9] and cont.resume_text_chars == 5 and cont.request_id == "r"
    assert list(request.resume_output_ids) == [7]  # the original is left as it was
    assert stream.why_not_migrate(3, 3) == "after 3 of --max-migrations 3"
    assert stream.why_not_migrate(0, 0) == "migration is off (--max-migrations 0)"
    stream.saw(worker_pb2.GenerateResponse(request_id="r", complete=worker_pb2.GenerateComplete()))
    assert stream.finished and stream.completes() == []  # the worker sent its `complete`: nothing is missing


def test_an_n_request_continues_sample_by_sample():
    request = worker_pb2.GenerateRequest(request_id="r", input_ids=[1, 2, 3], stream=True)
    request.sampling_params.n = 3
    request.sampling_params.sampling_seed = 40
    stream = Streamed(request)
    stream.saw(_chunk(0, [5], "a"))
    stream.saw(_chunk(2, [6, 7], "bc"))
    stream.saw(_chunk(1, [8], "d"))
    stream.saw(worker_pb2.GenerateResponse(request_id="r", index=1, complete=worker_pb2.GenerateComplete()))
    assert stream.why_not_migrate(0, 3) is None and stream.unfinished() == [0, 2]
    sample = stream.sample_continuation(2)
    assert sample.request_id == "r-2" and not sample.sampling_params.HasField("n")
    assert sample.sampling_params.sampling_seed == 42
    assert list(sample.resume_output_ids) == [6, 7] and sample.resume_text_chars == 2
    assert list(sample.input_ids) == [1, 2, 3] and sample.stream
    stream.saw(_chunk(0, [9], "e", last=True))  # a last chunk ends its sample as a complete message does
    assert stream.unfinished() == [2]
    stream.saw(worker_pb2.GenerateResponse(request_id="r", index=2, complete=worker_pb2.GenerateComplete()))
    assert stream.unfinished() == [] and stream.finished
    # the worker failed before sample 0's `complete` (its last chunk had come): the router makes it from the chunks
    (made,) = stream.completes()
    assert made.index == 0 and made.request_id == "r" and list(made.complete.output_ids) == [5, 9]
    assert made.complete.text == "ae" and made.complete.finish_reason.length == 1


def test_a_stream_whose_worker_died_after_the_last_chunk_ends_with_its_own_totals():
    stream = Streamed(worker_pb2.GenerateRequest(request_id="q", input_ids=[1, 2, 3], stream=True))
    stream.saw(_chunk(0, [4, 5], "he"))
    assert not stream.finished
    last = _chunk(0, [6], "llo", last=True)
    last.chunk.prompt_tokens, last.chunk.completion_tokens, last.chunk.cached_tokens = 3, 3, 2
    stream.saw(last)
    (made,) = stream.completes()
    assert list(made.complete.output_ids) == [4, 5, 6] and made.complete.text == "hello"
    assert (made.complete.usage.prompt_tokens, made.complete.usage.completion_tokens,
            made.complete.usage.cached_tokens) == (3, 3, 2)
