"""Copy-engine loads issued layer by layer as the forward reaches them (engine.cache.host_pool._LayerLoads), with
the driver's batch call, the current stream and CUDA events replaced by recorders (the bytes are checked on a GPU:
tests/gpu/test_hicache_cuda.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixmesh.engine.cache import dma
from radixmesh.engine.cache.host_pool import LOOKAHEAD, KVMover, Pending, _LayerLoads


class _Event:
    def __init__(self, enable_timing: bool = False):
        self.timed, self.stream = enable_timing, None

    def record(self, stream) -> None:
        assert self.stream is None, "an event recorded twice"
        self.stream = stream

    def query(self) -> bool:
        return self.stream is not None

    def synchronize(self) -> None:
        assert self.stream is not None, "waited on an event never recorded"
        self.waited = True


class _Stream:
    cuda_stream = 1234
    device = "cuda:0"


class _Mover:
    """What _LayerLoads reads of a KVMover: the layers, the load stream and the byte addresses."""

    def __init__(self, layers: int):
        self.kv = type("KV", (), {"k": [None] * layers})()
        self.load_stream, self._half = _Stream(), 4096
        self._addresses = lambda host, dev: KVMover._addresses(self, host, dev)  # noqa: E731
        self._batches = lambda *a: KVMover._batches(self, *a)  # noqa: E731
        k = np.arange(layers, dtype=np.uint64) * np.uint64(1 << 30) + np.uint64(1 << 40)
        self._ptrs = np.stack([k, k + np.uint64(1 << 29)], axis=1)  # [layers, K and V]
        self._host_stride = 2 * layers * self._half
        self.host = type("Host", (), {"data": torch.zeros(1)})()


@pytest.fixture
def issued(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _Stream())  # KVMover.flush: the load stream
    monkeypatch.setattr(dma, "copy_batch", lambda dsts, srcs, sizes, stream: calls.append(
        (dsts.copy(), srcs.copy(), sizes.copy(), stream)))
    return calls


def test_layers_go_out_as_the_forward_reaches_them(issued):
    mover = _Mover(8)
    pendings = [Pending(None, 0, flush="queued"), Pending(None, 0, flush="queued")]
    loads = _LayerLoads(mover, [5, 6, 9], [2, 40, 7], pendings)
    assert len(loads) == 8 and issued == [] and all(e.stream is None for e in loads.events)
    assert loads[0] is loads.events[0]  # layer 0 and the next LOOKAHEAD layers
    assert len(issued) == 1 + LOOKAHEAD and loads.issued == 1 + LOOKAHEAD
    loads[1]
    assert len(issued) == 1 + LOOKAHEAD  # already out: nothing more
    loads[4]
    assert len(issued) == min(5 + LOOKAHEAD, 8)
    assert all(p.flush == "queued" for p in pendings), "the loads' Pendings finished before every layer was issued"
    assert loads[-1] is loads.events[7] and loads.issued == 8 and len(issued) == 8
    assert all(p.flush is None for p in pendings)
    assert [e.timed for e in loads.events] == [False] * 7 + [True]  # the last one times the flush
    assert all(e.stream is mover.load_stream for e in loads.events)
    # each batch: that layer's K and V of every page, host page -> device page, in one call on the load stream
    for layer, (dsts, srcs, sizes, stream) in enumerate(issued):
        assert stream == 1234 and list(sizes) == [4096] * 6
        want_dst = [int(mover._ptrs[layer, 0]) + 4096 * p for p in (2, 40, 7)] + \
                   [int(mover._ptrs[layer, 1]) + 4096 * p for p in (2, 40, 7)]
        base = mover.host.data.data_ptr()
        want_src = [base + mover._host_stride * p + 4096 * 2 * layer for p in (5, 6, 9)] + \
                   [base + mover._host_stride * p + 4096 * (2 * layer + 1) for p in (5, 6, 9)]
        assert list(dsts) == want_dst and list(srcs) == want_src
    loads.finish()  # nothing left: no second issue
    assert len(issued) == 8


def test_finish_issues_the_rest_and_a_load_of_nothing_still_gives_every_layer_an_event(issued):
    pending = Pending(None, 0, flush="queued")
    loads = _LayerLoads(_Mover(4), [3], [1], [pending])
    loads[0]
    pending.flush = loads.finish  # as KVMover.flush sets it: a wait on the Pending issues what is left
    pending.flush()
    assert len(issued) == 4 and pending.flush is None
    empty = _LayerLoads(_Mover(4), [], [], [])
    empty[-1]
    assert len(issued) == 4 and all(e.stream is not None for e in empty.events)


def test_a_forward_that_fails_part_way_issues_and_waits_for_the_loads_of_every_layer(issued):
    """The failed requests' device pages are freed next: no load into them may still be queued or running."""
    from radixmesh.engine.model_runner import ModelRunner

    loads = _LayerLoads(_Mover(6), [3, 4], [1, 9], [])

    def hidden(batch, ready):
        ready[0]  # layer 0 and the next LOOKAHEAD go out; the launch fails before layer 1
        raise RuntimeError("kernel launch failed")

    runner = object.__new__(ModelRunner)
    runner._publish, runner.graphs = (lambda *a: None), None
    runner._kv_ready, runner._hidden = (lambda: loads), hidden
    with pytest.raises(RuntimeError, match="kernel launch failed"):
        ModelRunner.forward(runner, object())
    assert loads.issued == 6 and len(issued) == 6 and getattr(loads.events[-1], "waited", False)
