"""How `python -m radixmesh.benchmarks.serving` turns a stream's arrival times into TTFT and ITL samples (SGLang's
client's rules, benchmarks.serving_backends' docstring), with made-up clocks: exact numbers, no timing."""

from __future__ import annotations

import pytest

from radixmesh.benchmarks.serving import LatencyStats
from radixmesh.benchmarks.serving_backends import StreamTimer, WorkItem


def _timer(output_len: int) -> StreamTimer:
    timer = StreamTimer(WorkItem(input_ids=[1, 2, 3], output_len=output_len))
    timer.start = 10.0
    return timer


def test_a_chunk_of_k_new_tokens_is_k_equal_itl_samples():
    timer = _timer(6)
    for total, now in ((1, 10.5), (2, 10.6), (5, 10.9), (5, 10.95), (6, 11.0)):  # (a chunk without a new token)
        timer.reported = total
        timer.on_tokens(total, now)
    out = timer.finish(11.25)
    assert out.success and out.output_len == 6 and out.prompt_len == 3
    assert out.ttft_s == pytest.approx(0.5) and out.e2e_s == pytest.approx(1.25)
    assert out.itl_s == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.1])


def test_tokens_that_come_with_the_first_chunk_get_no_itl_sample():
    """A consumer that read late gets a short answer whole in its first chunk (the engine's delivery coalesces a
    request's queued outputs): a TTFT, no ITL, and a level of such answers has no ITL figures."""
    timer = _timer(3)
    timer.reported = 3
    timer.on_tokens(3, 10.2)
    out = timer.finish(10.2)
    assert out.success and out.ttft_s == pytest.approx(0.2) and out.itl_s == []
    assert LatencyStats.of(out.itl_s) == LatencyStats()
    stats = LatencyStats.of([0.001, 0.003])
    assert (stats.mean, stats.max) == pytest.approx((2.0, 3.0))


def test_a_stream_that_reports_other_than_asked_fails():
    timer = _timer(4)
    timer.reported = 3
    timer.on_tokens(3, 10.1)
    out = timer.finish(10.1)
    assert not out.success and "reported 3 completion tokens, 4 were asked for" in out.error
    silent = _timer(2)
    silent.reported = 2  # (a final usage that counts tokens no chunk carried)
    assert "the stream ended without a token" in silent.finish(10.0).error


def test_openai_chunks_are_one_itl_sample_each_after_the_first():
    timer = _timer(3)
    for now in (10.3, 10.5, 10.9):
        timer.on_chunk(now)
    timer.reported = 3
    out = timer.finish(11.0)
    assert out.success and out.ttft_s == pytest.approx(0.3) and out.itl_s == pytest.approx([0.2, 0.4])
