"""`python -m radixmesh.benchmarks.dma_issue`: what queuing a batch of copy-engine copies costs the host (issue 11).

A multi-turn wave's first big extend on an H200 waited 33-49 ms for its host to queue ~66k page copies
(cuMemcpyBatchAsync, engine.cache.dma.copy_batch: 2 x ~1,000 pages x 32 layers) before its first kernel (NOTES.md,
2026-11-28 evening). This times one batch call of `--copies` scattered 128 KB copies from the host's side, and the
copies themselves on the GPU, for copy attributes that may spare the driver work per copy: location hints (the
source is pinned host memory, the destination this device, or the reverse) instead of none, the access order, and
the prefer-overlap flag. The bytes of every variant are checked against the source. `--runs` also times 2-D batches
(cuMemcpy3DBatchAsync), one operation per run of host pages: on an H200 the driver took 3.5 / 5.5 / 1.3 us an
operation for runs of 1 / 4 / 16 pages, and the copies ran at 17.6 / 35.9 / 48.6 GB/s against 54 GB/s for page
copies, so the engine keeps page copies (its stretches are 1.3-1.6 pages).

    python -m radixmesh.benchmarks.dma_issue --copies 2048 --calls 8 [--runs 1 4 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

import numpy as np
import torch

from radixmesh.engine.cache import dma

_INVALID, _DEVICE, _HOST = 0, 1, 2  # CUmemLocationType
_ORDER_STREAM, _ORDER_ANY = 1, 3  # CUmemcpySrcAccessOrder
VARIANTS = {  # name: (access order, hint the source, hint the destination, prefer overlap with compute)
    "no hints (engine today)": (_ORDER_STREAM, False, False, 1),
    "location hints": (_ORDER_STREAM, True, True, 1),
    "location hints, no overlap flag": (_ORDER_STREAM, True, True, 0),
    "location hints, any order": (_ORDER_ANY, True, True, 1),
}


# 2-D copies in batches (cuMemcpy3DBatchAsync, CUDA 12.8+): one operation per run of pages, where dma.copy_batch
# needs one per page. Measured here only: the engine does not use them (engine/cache/dma.py says why).


class _Operand(ctypes.Structure):  # CUmemcpy3DOperand, its union's pointer member
    _fields_ = [("type", ctypes.c_uint), ("ptr", ctypes.c_uint64), ("row_length", ctypes.c_size_t),
                ("layer_height", ctypes.c_size_t), ("loc_hint", dma._Location)]


class _Extent(ctypes.Structure):  # CUextent3D
    _fields_ = [("width", ctypes.c_size_t), ("height", ctypes.c_size_t), ("depth", ctypes.c_size_t)]


class _Op3D(ctypes.Structure):  # CUDA_MEMCPY3D_BATCH_OP
    _fields_ = [("src", _Operand), ("dst", _Operand), ("extent", _Extent), ("src_access_order", ctypes.c_uint),
                ("flags", ctypes.c_uint)]


OP3D = np.dtype(_Op3D)  # the same layout as a numpy record, so a batch's operations are filled as arrays
_OPERAND_POINTER = 1  # CU_MEMCPY_OPERAND_TYPE_POINTER
_batch_3d = None  # (function, takes a failure-index argument); False where the driver lacks it


def _batch_3d_fn():
    """cuMemcpy3DBatchAsync of the driver (_driver_entry)."""
    global _batch_3d
    if _batch_3d is None:
        _batch_3d = dma._driver_entry("cuMemcpy3DBatchAsync", [ctypes.c_size_t, ctypes.c_void_p],
                                  [ctypes.c_ulonglong, ctypes.c_void_p])
    return _batch_3d


def ops_2d(dsts: np.ndarray, dst_pitch: int, srcs: np.ndarray, src_pitch: int, width: int,
           rows: np.ndarray) -> np.ndarray:
    """The batch's operations: copy i moves rows[i] rows of `width` bytes from srcs[i] (rows `src_pitch` bytes
    apart) to dsts[i] (`dst_pitch` apart). Pointer operands count their rows in bytes."""
    n = len(dsts)
    ops = np.zeros(n, dtype=OP3D)
    for side, addr, pitch in (("src", srcs, src_pitch), ("dst", dsts, dst_pitch)):
        operand = ops[side]
        operand["type"] = _OPERAND_POINTER
        operand["ptr"] = addr
        operand["row_length"] = pitch
        operand["layer_height"] = rows
    ops["extent"]["width"] = width
    ops["extent"]["height"] = rows
    ops["extent"]["depth"] = 1
    ops["src_access_order"] = dma._ORDER_STREAM
    ops["flags"] = dma._PREFER_OVERLAP_WITH_COMPUTE
    return ops


def copy_2d_batch(ops: np.ndarray, stream: int) -> None:
    """Queue the operations of `ops` (from ops_2d) on CUDA stream handle `stream` as one batch: in stream order as a
    whole, in any order among themselves. RuntimeError with the CUDA error code (and the failed operation's index,
    where the driver gives it) when the driver refuses the batch."""
    n = len(ops)
    if not n:
        return
    assert ops.dtype == OP3D and ops.flags.c_contiguous
    dma._not_null(stream)
    fn, legacy = _batch_3d_fn()
    failed = ctypes.c_size_t(n)
    err = fn(n, ops.ctypes.data, ctypes.byref(failed), 0, stream) if legacy else fn(n, ops.ctypes.data, 0, stream)
    if err:
        where = f" at operation {failed.value} of {n}" if legacy and failed.value < n else f" ({n} operations)"
        raise RuntimeError(f"cuMemcpy3DBatchAsync failed{where}: CUDA error {err}")


def attributes(order: int, hint_src: bool, hint_dst: bool, flags: int, to_device: bool, device: int):
    host, dev = dma._Location(_HOST, 0), dma._Location(_DEVICE, device)
    none = dma._Location(_INVALID, 0)
    src, dst = (host, dev) if to_device else (dev, host)
    return dma._CopyAttributes(order, src if hint_src else none, dst if hint_dst else none, flags)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--copies", type=int, default=2048, help="copies per batch call (a layer's K and V of 1,024 pages)")
    p.add_argument("--calls", type=int, default=8, help="batch calls per measurement (layers)")
    p.add_argument("--page-kb", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, nargs="*", default=[16],
                   help="also time 2-D batches (cuMemcpy3DBatchAsync): one operation per run of this many strided "
                        "host pages into packed device pages, as the engine's loads through staging")
    p.add_argument("--out")
    a = p.parse_args()
    if not dma.batch_available():
        raise SystemExit("this driver has no cuMemcpyBatchAsync")
    size, n = a.page_kb * 1024, a.copies
    device = torch.cuda.current_device()
    host = torch.empty(n * size, dtype=torch.uint8, pin_memory=True)
    host.copy_(torch.randint(0, 256, (n * size,), dtype=torch.uint8))
    dev = torch.zeros(n * size, dtype=torch.uint8, device="cuda")
    rng = np.random.default_rng(0)
    perm = rng.permutation(n).astype(np.uint64)  # scattered: page i goes to page perm[i]
    host_addr = np.uint64(host.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(size)
    dev_addr = np.uint64(dev.data_ptr()) + perm * np.uint64(size)
    sizes = np.full(n, size, dtype=np.uint64)
    stream = torch.cuda.Stream()
    results = []
    for rnd in range(a.rounds):
        for name, v in VARIANTS.items():
            for to_device in (True, False):
                attrs = attributes(*v, to_device, device)
                dsts, srcs = (dev_addr, host_addr) if to_device else (host_addr, dev_addr)
                if to_device:
                    dev.zero_()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    start.record(stream)
                    t = time.perf_counter()
                    for _ in range(a.calls):
                        dma.copy_batch(dsts, srcs, sizes, stream.cuda_stream, attrs)
                    host_s = time.perf_counter() - t
                    end.record(stream)
                end.synchronize()
                gpu_ms = start.elapsed_time(end)
                if to_device:  # every page where the permutation put it
                    ok = torch.equal(dev.view(n, size)[torch.from_numpy(perm.astype(np.int64)).cuda()].cpu(),
                                     host.view(n, size))
                else:
                    ok = None  # not checked: the host already holds these bytes
                moved = a.calls * n * size
                row = dict(round=rnd, variant=name, direction="h2d" if to_device else "d2h",
                           host_us_per_copy=round(host_s / (a.calls * n) * 1e6, 3),
                           host_ms_per_call=round(host_s / a.calls * 1e3, 3), gpu_ms=round(gpu_ms, 2),
                           gb_per_s=round(moved / gpu_ms / 1e6, 1), bytes_ok=ok)
                results.append(row)
                print(json.dumps(row), flush=True)
    if _batch_3d_fn():
        results += runs_2d(a, host, dev, stream)
    else:
        print("this driver has no cuMemcpy3DBatchAsync: 2-D batches not timed")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copies=n, calls=a.calls, page_bytes=size,
                           results=results), f, indent=1)


def runs_2d(a, host: torch.Tensor, dev: torch.Tensor, stream) -> list[dict]:
    """Each page's first half (a layer's K and V of a host page whose other half stands for other layers) from
    runs of consecutive host pages into packed device memory: one 2-D operation per run."""
    size, n = a.page_kb * 1024, a.copies
    half = size // 2
    out = []
    for rnd in range(a.rounds):
        for run in a.runs:
            firsts = np.arange(0, n - run + 1, run, dtype=np.uint64)
            srcs = np.uint64(host.data_ptr()) + firsts * np.uint64(size)
            dsts = np.uint64(dev.data_ptr()) + firsts * np.uint64(half)
            ops = ops_2d(dsts, half, srcs, size, half, np.full(len(firsts), run, dtype=np.uint64))
            dev.zero_()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            t = time.perf_counter()
            for _ in range(a.calls):
                copy_2d_batch(ops, stream.cuda_stream)
            host_s = time.perf_counter() - t
            end.record(stream)
            end.synchronize()
            gpu_ms = start.elapsed_time(end)
            pages = int(firsts[-1]) + run
            ok = torch.equal(dev[:pages * half].view(pages, half).cpu(), host.view(n, size)[:pages, :half])
            row = dict(round=rnd, variant=f"2-D operations, runs of {run} pages", direction="h2d",
                       host_us_per_op=round(host_s / (a.calls * len(ops)) * 1e6, 3),
                       host_ms_per_call=round(host_s / a.calls * 1e3, 3), gpu_ms=round(gpu_ms, 2),
                       gb_per_s=round(a.calls * pages * half / gpu_ms / 1e6, 1), bytes_ok=ok)
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


if __name__ == "__main__":
    main()
