"""The 2-D copy batches of engine.cache.dma (cuMemcpy3DBatchAsync) as this module writes them: the record layout
against the driver's struct, and each operation's fields, replayed here on a byte array the way the driver reads
them (the driver itself is exercised on a GPU: tests/gpu/test_hicache_cuda.py, and dma.check_2d_batch at start-up)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from engine.cache import dma, host_pool
from engine.cache.host_pool import KVMover, _runs


def replay(memory: np.ndarray, ops: np.ndarray) -> None:
    """Apply `ops` to `memory` (addresses are offsets into it): each row of `width` bytes, pitch apart."""
    for op in ops:
        src, dst, ext = op["src"], op["dst"], op["extent"]
        assert src["type"] == dst["type"] == 1 and ext["depth"] == 1
        for r in range(int(ext["height"])):
            s = int(src["ptr"]) + r * int(src["row_length"])
            d = int(dst["ptr"]) + r * int(dst["row_length"])
            memory[d:d + int(ext["width"])] = memory[s:s + int(ext["width"])]


def test_the_record_is_the_drivers_struct():
    # CUmemcpy3DOperand: a 4-byte type, then its union at 8 (pointer, row length, layer height, location hint);
    # CUDA_MEMCPY3D_BATCH_OP: source, destination, extent, access order, flags
    assert ctypes.sizeof(dma._Operand) == 40 and ctypes.sizeof(dma._Op3D) == 112 == dma.OP3D.itemsize
    assert [dma.OP3D.fields[f][1] for f in ("src", "dst", "extent", "src_access_order", "flags")] == \
        [0, 40, 80, 104, 108]
    assert [dma.OP3D["src"].fields[f][1] for f in ("type", "ptr", "row_length", "layer_height", "loc_hint")] == \
        [0, 8, 16, 24, 32]


def test_runs_of_strided_host_pages_land_packed_in_a_slot():
    # host pages of `stride` bytes; one layer's K and V (`row` bytes at `offset`) of each page of a group go into a
    # staging slot, packed in the group's order, one operation per run of consecutive host pages
    stride, row, offset, pages = 96, 16, 32, [5, 6, 7, 9, 2, 3]
    slot = 64 * stride
    memory = np.zeros(slot + len(pages) * row, dtype=np.uint8)
    memory[:slot] = np.arange(slot) % 251
    runs = np.array(_runs(pages), dtype=np.uint64).reshape(-1, 3)
    index, first, count = runs.T
    ops = dma.ops_2d(np.uint64(slot) + index * np.uint64(row), row, np.uint64(offset) + first * np.uint64(stride),
                     stride, row, count)
    assert len(ops) == 3  # 5-7, 9, 2-3
    assert list(ops["extent"]["height"]) == [3, 1, 2] and set(ops["extent"]["width"]) == {row}
    assert set(ops["src_access_order"]) == {1} and set(ops["flags"]) == {1}  # stream order, the copy engines
    replay(memory, ops)
    for i, p in enumerate(pages):
        got = memory[slot + i * row:slot + (i + 1) * row]
        assert np.array_equal(got, memory[p * stride + offset:p * stride + offset + row]), f"page {p}"


class _Mover:
    """What KVMover._segment_ops reads, over one byte array: the host pool at 0, then each layer's K and V buffer."""

    def __init__(self, layers: int, half: int, host_pages: int, dev_pages: int):
        self.kv = type("KV", (), {"k": [None] * layers})()
        self._half, self._host_stride = half, 2 * layers * half
        self.host = type("Host", (), {"data": type("D", (), {"data_ptr": lambda self: 0})()})()
        base = host_pages * self._host_stride
        self._k_ptrs = np.array([base + 2 * l * dev_pages * half for l in range(layers)], dtype=np.uint64)
        self._v_ptrs = self._k_ptrs + np.uint64(dev_pages * half)
        self.size = base + 2 * layers * dev_pages * half


def test_segments_are_stretches_consecutive_on_both_sides():
    starts, lengths = host_pool.segments([5, 6, 7, 9, 10, 2, 3], [40, 41, 8, 9, 10, 11, 12])
    assert list(starts) == [0, 2, 3, 5] and list(lengths) == [2, 1, 2, 2]
    starts, lengths = host_pool.segments([], [])
    assert len(starts) == len(lengths) == 0


@pytest.mark.parametrize("to_device", [True, False])
def test_segment_copies_move_every_layers_k_and_v_between_host_and_device_pages(to_device):
    layers, half = 3, 8
    m = _Mover(layers, half, host_pages=12, dev_pages=16)
    memory = np.zeros(m.size, dtype=np.uint8)
    memory[:] = np.random.default_rng(0).integers(0, 256, m.size)
    before = memory.copy()
    host_pages, dev_pages = [5, 6, 7, 9, 10, 2, 3], [14, 15, 8, 9, 10, 11, 1]
    ops = KVMover._segment_ops(m, host_pages, dev_pages, to_device)
    assert ops.shape == (layers, 2 * 5)  # K and V of 5 segments: 5-6 -> 14-15, 7 -> 8, 9-10 -> 9-10, 2 -> 11, 3 -> 1
    replay(memory, ops.reshape(-1))
    for layer in range(layers):
        for kv, ptrs in ((0, m._k_ptrs), (1, m._v_ptrs)):
            for hp, dp in zip(host_pages, dev_pages):
                h = hp * m._host_stride + (2 * layer + kv) * half
                d = int(ptrs[layer]) + dp * half
                src = before[h:h + half] if to_device else before[d:d + half]
                got = memory[d:d + half] if to_device else memory[h:h + half]
                assert np.array_equal(got, src), (layer, kv, hp, dp)


def _batching(layers: int, monkeypatch) -> _Mover:
    """A _Mover that batches in 2-D, with KVMover's batch methods bound to it, on a stand-in CUDA stream (handle 7)."""
    m = _Mover(layers, 8, host_pages=12, dev_pages=16)
    m.batched_2d = True
    m._segment_ops = lambda *a: KVMover._segment_ops(m, *a)
    m._addresses = lambda *a: KVMover._addresses(m, *a)
    m._batches = lambda *a: KVMover._batches(m, *a)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("S", (), {"cuda_stream": 7})())
    return m


def test_a_refused_2d_batch_falls_back_to_page_copies(monkeypatch):
    m = _batching(2, monkeypatch)
    pages = []

    def refuse(ops, stream):
        raise RuntimeError("cuMemcpy3DBatchAsync failed: CUDA error 1")

    monkeypatch.setattr(dma, "copy_2d_batch", refuse)
    monkeypatch.setattr(dma, "copy_batch", lambda dsts, srcs, sizes, stream: pages.append((len(dsts), stream)))
    KVMover._batches(m, [5, 6], [14, 15], True)(1)  # layer 1: refused in 2-D, then its 4 page copies (K, V x 2)
    assert pages == [(4, 7)] and m.batched_2d is False


def test_after_a_refusal_the_other_layers_go_page_by_page_without_asking_again(monkeypatch):
    m = _batching(3, monkeypatch)
    asked, pages = [], []

    def refuse(ops, stream):
        asked.append(len(ops))
        raise RuntimeError("cuMemcpy3DBatchAsync failed: CUDA error 1")

    monkeypatch.setattr(dma, "copy_2d_batch", refuse)
    monkeypatch.setattr(dma, "copy_batch", lambda dsts, srcs, sizes, stream: pages.append(len(dsts)))
    queue = KVMover._batches(m, [5, 6, 9], [14, 15, 2], True)
    for layer in range(3):
        queue(layer)
    assert asked == [4] and pages == [6, 6, 6]  # one refused 2-D batch (K, V x 2 stretches), then 3 x 6 page copies
