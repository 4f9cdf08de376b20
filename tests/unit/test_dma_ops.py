"""Copy-engine copies as written for the driver, replayed here on a byte array the way the driver reads them: the
page copies of KVMover's batches (engine.cache.dma.copy_batch), and the 2-D operations benchmarks.dma_issue times
(cuMemcpy3DBatchAsync: the record layout against the driver's struct). The driver itself is exercised on a GPU:
tests/gpu/test_hicache_cuda.py."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from radixmesh.benchmarks import dma_issue
from radixmesh.engine.cache import dma, host_pool
from radixmesh.engine.cache.host_pool import KVMover, _runs


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
    assert ctypes.sizeof(dma_issue._Operand) == 40 and ctypes.sizeof(dma_issue._Op3D) == 112 == dma_issue.OP3D.itemsize
    assert [dma_issue.OP3D.fields[f][1] for f in ("src", "dst", "extent", "src_access_order", "flags")] == \
        [0, 40, 80, 104, 108]
    assert [dma_issue.OP3D["src"].fields[f][1] for f in ("type", "ptr", "row_length", "layer_height", "loc_hint")] == \
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
    ops = dma_issue.ops_2d(np.uint64(slot) + index * np.uint64(row), row, np.uint64(offset) + first * np.uint64(stride),
                     stride, row, count)
    assert len(ops) == 3  # 5-7, 9, 2-3
    assert list(ops["extent"]["height"]) == [3, 1, 2] and set(ops["extent"]["width"]) == {row}
    assert set(ops["src_access_order"]) == {1} and set(ops["flags"]) == {1}  # stream order, the copy engines
    replay(memory, ops)
    for i, p in enumerate(pages):
        got = memory[slot + i * row:slot + (i + 1) * row]
        assert np.array_equal(got, memory[p * stride + offset:p * stride + offset + row]), f"page {p}"


class _Mover:
    """What KVMover._batches reads, over one byte array: the host pool at 0, then each layer's K and V buffer (a
    latent pool's one buffer a layer with `parts` 1)."""

    def __init__(self, layers: int, half: int, host_pages: int, dev_pages: int, parts: int = 2):
        self.kv = type("KV", (), {"k": [None] * layers})()
        self._half, self._host_stride = half, parts * layers * half
        self.host = type("Host", (), {"data": type("D", (), {"data_ptr": lambda self: 0})()})()
        base = host_pages * self._host_stride
        self._ptrs = np.array([[base + (parts * l + j) * dev_pages * half for j in range(parts)]
                               for l in range(layers)], dtype=np.uint64)
        self.size = base + parts * layers * dev_pages * half


def test_segments_are_stretches_consecutive_on_both_sides():
    starts, lengths = host_pool.segments([5, 6, 7, 9, 10, 2, 3], [40, 41, 8, 9, 10, 11, 12])
    assert list(starts) == [0, 2, 3, 5] and list(lengths) == [2, 1, 2, 2]
    starts, lengths = host_pool.segments([], [])
    assert len(starts) == len(lengths) == 0


@pytest.mark.parametrize("parts", [2, 1], ids=["k-and-v", "latent"])
@pytest.mark.parametrize("to_device", [True, False])
@pytest.mark.parametrize("layer", [1, None])
def test_page_copies_move_each_layers_k_and_v_between_host_and_device_pages(monkeypatch, to_device, layer, parts):
    """KVMover's batch for one layer (a forward's wait is per layer) or for every layer (a step's backups): one copy
    per page's K and one per its V (one per page of a latent pool's one buffer a layer), each between its host page's
    part and its device page, on the stream in use."""
    layers, half = 3, 8
    m = _Mover(layers, half, host_pages=12, dev_pages=16, parts=parts)
    m._addresses = lambda *a: KVMover._addresses(m, *a)
    memory = np.random.default_rng(0).integers(0, 256, m.size).astype(np.uint8)
    before = memory.copy()
    streams = []

    def copy_batch(dsts, srcs, sizes, stream):
        streams.append(stream)
        for d, s, n in zip(dsts, srcs, sizes):
            memory[int(d):int(d) + int(n)] = before[int(s):int(s) + int(n)]

    monkeypatch.setattr(dma, "copy_batch", copy_batch)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("S", (), {"cuda_stream": 7})())
    host_pages, dev_pages = [5, 6, 7, 9, 10, 2, 3], [14, 15, 8, 9, 10, 11, 1]
    KVMover._batches(m, host_pages, dev_pages, to_device)(layer)
    assert streams == [7]
    for each in range(layers):
        for kv in range(parts):
            for hp, dp in zip(host_pages, dev_pages):
                h = hp * m._host_stride + (parts * each + kv) * half
                d = int(m._ptrs[each, kv]) + dp * half
                src = before[h:h + half] if to_device else before[d:d + half]
                got = memory[d:d + half] if to_device else memory[h:h + half]
                if layer is None or layer == each:
                    assert np.array_equal(got, src), (each, kv, hp, dp)
                else:  # another layer's batch: untouched
                    assert np.array_equal(got, before[d:d + half] if to_device else before[h:h + half])


def test_batches_refuse_the_null_stream():
    with pytest.raises(ValueError, match="NULL stream"):
        dma.copy_batch(np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.ones(1, np.uint64), 0)
