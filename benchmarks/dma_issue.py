"""`python -m benchmarks.dma_issue`: what queuing a batch of copy-engine copies costs the host (issue 11).

A multi-turn wave's first big extend on an H200 waited 33-49 ms for its host to queue ~66k page copies
(cuMemcpyBatchAsync, engine.cache.dma.copy_batch: 2 x ~1,000 pages x 32 layers) before its first kernel (NOTES.md,
2026-11-28 evening). This times one batch call of `--copies` scattered 128 KB copies from the host's side, and the
copies themselves on the GPU, for copy attributes that may spare the driver work per copy: location hints (the
source is pinned host memory, the destination this device, or the reverse) instead of none, the access order, and
the prefer-overlap flag. The bytes of every variant are checked against the source.

    python -m benchmarks.dma_issue --copies 2048 --calls 8 [--runs 1 4 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from engine.cache import dma

_INVALID, _DEVICE, _HOST = 0, 1, 2  # CUmemLocationType
_ORDER_STREAM, _ORDER_ANY = 1, 3  # CUmemcpySrcAccessOrder
VARIANTS = {  # name: (access order, hint the source, hint the destination, prefer overlap with compute)
    "no hints (engine today)": (_ORDER_STREAM, False, False, 1),
    "location hints": (_ORDER_STREAM, True, True, 1),
    "location hints, no overlap flag": (_ORDER_STREAM, True, True, 0),
    "location hints, any order": (_ORDER_ANY, True, True, 1),
}


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
    if dma.batch_2d_available():
        results += runs_2d(a, host, dev, stream)
    else:
        print("no usable cuMemcpy3DBatchAsync: 2-D batches not timed")
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
            ops = dma.ops_2d(dsts, half, srcs, size, half, np.full(len(firsts), run, dtype=np.uint64))
            dev.zero_()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            t = time.perf_counter()
            for _ in range(a.calls):
                dma.copy_2d_batch(ops, stream.cuda_stream)
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
