"""Copy-engine loads issued layer by layer as the forward reaches them (engine.cache.host_pool._LayerLoads), and
backups queued by a thread of their own (_BackupIssuer), with the driver's batch call and CUDA events replaced by
recorders (the bytes are checked on a GPU: tests/gpu/test_hicache_cuda.py)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from engine.cache import dma
from engine.cache.host_pool import LOOKAHEAD, KVMover, Pending, _BackupIssuer, _LayerLoads


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


class _Stream:
    cuda_stream = 1234
    device = "cuda:0"


class _Mover:
    """What _LayerLoads reads of a KVMover: the layers, the load stream and the byte addresses."""

    def __init__(self, layers: int):
        self.kv = type("KV", (), {"k": [None] * layers})()
        self.load_stream, self._half = _Stream(), 4096
        self._addresses = lambda host, dev: KVMover._addresses(self, host, dev)  # noqa: E731
        self._k_ptrs = np.arange(layers, dtype=np.uint64) * np.uint64(1 << 30) + np.uint64(1 << 40)
        self._v_ptrs = self._k_ptrs + np.uint64(1 << 29)
        self._host_stride = 2 * layers * self._half
        self.host = type("Host", (), {"data": torch.zeros(1)})()


@pytest.fixture
def issued(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "Event", _Event)
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
        want_dst = [int(mover._k_ptrs[layer]) + 4096 * p for p in (2, 40, 7)] + \
                   [int(mover._v_ptrs[layer]) + 4096 * p for p in (2, 40, 7)]
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



def test_backups_are_queued_by_their_thread_and_finish_only_then(monkeypatch):
    release, calls = threading.Event(), []

    def copy_batch(dsts, srcs, sizes, stream):
        release.wait(5)
        calls.append((list(dsts), list(srcs), list(sizes), stream, threading.current_thread().name))

    monkeypatch.setattr(dma, "copy_batch", copy_batch)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    issuer = _BackupIssuer(_Stream())
    pendings, event, start = [Pending(None, 64), Pending(None, 64)], _Event(), _Event()
    host, dev = np.array([100, 200], dtype=np.uint64), np.array([7, 8], dtype=np.uint64)
    issuer.submit(host, dev, 4096, event, start, pendings)
    assert not any(p.done() for p in pendings), "a backup counted as done before its copies were queued"
    release.set()
    pendings[0].wait()  # waits for the thread, then for the event
    assert calls == [([100, 200], [7, 8], [4096, 4096], 1234, "kv-backup-issuer")]
    assert all(p.done() and p.start_event is start for p in pendings) and event.stream is not None


def test_a_failed_backup_batch_is_raised_on_the_callers_thread(monkeypatch):
    def copy_batch(dsts, srcs, sizes, stream):
        raise RuntimeError("cuMemcpyBatchAsync failed: CUDA error 1")

    monkeypatch.setattr(dma, "copy_batch", copy_batch)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    issuer = _BackupIssuer(_Stream())
    pending = Pending(None, 64)
    issuer.submit(np.array([1], dtype=np.uint64), np.array([2], dtype=np.uint64), 4096, _Event(), _Event(), [pending])
    with pytest.raises(RuntimeError, match="KV backups failed.*CUDA error 1"):
        pending.wait()
    assert not pending.done()  # never counted as copied: its host pages are not used
    with pytest.raises(RuntimeError, match="KV backups failed"):
        issuer.check()  # and the next flush raises it too
