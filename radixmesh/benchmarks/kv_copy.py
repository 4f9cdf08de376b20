"""Host <-> device KV page copies of the hierarchical cache (issue 11), 8B-shaped pages (32 layers, 8 KV heads of 128,
bf16, 64 tokens a page: 8 MB): the staged path (whole pages over the copy engine into a device buffer, then an index
scatter per layer and K/V) against kernels.kv_pages (one launch per layer reading or writing the pinned host pool in
place; several launch widths), alone and while a stream of bf16 GEMMs runs beside them on the compute stream (how much each slows the
GEMMs, and how long the copy takes under them). Also: how long a prefill-like chain of 32 GEMM "layers" takes when
it waits for the whole load before starting against waiting per layer.

    python -m radixmesh.benchmarks.kv_copy [--pages 35] [--repeats 5] [--result-file F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from radixmesh.engine.cache import host_pool
from radixmesh.engine.cache.host_pool import HostKVPool, KVMover
from radixmesh.engine.cache.kv_pool import KVPool

LAYERS, HEADS, DIM, PAGE = 32, 8, 128, 64


def _gemms(n: int, a: torch.Tensor, b: torch.Tensor) -> None:
    for _ in range(n):
        torch.mm(a, b)


def _timed(fn, stream=None) -> float:
    stream = stream or torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end)


def _dma_per_layer(nbytes: int, repeats: int, a: torch.Tensor, b: torch.Tensor) -> dict:
    """The same bytes over the copy engine, one contiguous pinned block per layer (a layer-major host layout): does
    a load that takes no SMs overlap the GEMM chain waiting for it layer by layer, where the kernels' loads do not?"""
    src = torch.empty(LAYERS, nbytes // LAYERS, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(LAYERS, nbytes // LAYERS, dtype=torch.uint8, device=a.device)
    stream = torch.cuda.Stream(priority=-1)

    def load() -> list:
        events = []
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for layer in range(LAYERS):
                dst[layer].copy_(src[layer], non_blocking=True)
                events.append(torch.cuda.Event())
                events[-1].record(stream)
        return events

    def per_layer(ready: list) -> None:
        for ev in ready:
            torch.cuda.current_stream().wait_event(ev)
            torch.mm(a, b[:, :4096])

    load()[-1].synchronize()
    loads, whole, layered = [], [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        load()[-1].synchronize()
        loads.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
        ready = load()
        whole.append(_timed(lambda: (torch.cuda.current_stream().wait_event(ready[-1]), _gemms(32, a, b[:, :4096]))))
        torch.cuda.synchronize()
        ready = load()
        layered.append(_timed(lambda: per_layer(ready)))
    torch.cuda.synchronize()
    gemms = statistics.median(_timed(lambda: _gemms(32, a, b[:, :4096])) for _ in range(repeats))
    load_ms = statistics.median(loads)
    return {"load_ms": load_ms, "load_GBps": nbytes / load_ms / 1e6, "gemms_alone_ms": gemms,
            "layers_after_whole_load_ms": statistics.median(whole),
            "layers_waiting_per_layer_ms": statistics.median(layered)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=35, help="pages a load moves (35 x 64 = a 2240-token history)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--programs", type=int, nargs="+", default=[64, 16, 32, 128, 4096],
                    help="kernels.kv_pages launch widths to time (4096: one program per chunk here)")
    ap.add_argument("--result-file")
    args = ap.parse_args()
    dev = torch.device("cuda")
    kv = KVPool(4 * args.pages + 8, PAGE, LAYERS, HEADS, DIM, torch.bfloat16, dev)
    host = HostKVPool(4 * args.pages + 8, kv)
    mover = KVMover(kv, host)
    assert mover.direct, "kernels.kv_pages needs a pinned host pool and Triton"
    host.data.normal_()
    hp = list(range(1, 2 * args.pages + 1, 2))  # every other page: runs of one, as after churn
    dp = list(range(3 * args.pages, 2 * args.pages, -1))
    nbytes = args.pages * host.page_bytes
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=dev)
    b = torch.randn(4096, 14336, dtype=torch.bfloat16, device=dev)
    out: dict = {"device": torch.cuda.get_device_name(), "pages": args.pages, "bytes": nbytes, "runs": {}}

    # --hicache-io-backend: kernel, direct by 2-D copies through staging, direct by cuMemcpyBatchAsync (backups too)
    movers = {"kernel": mover, "direct": KVMover(kv, host, "direct"), "batched": KVMover(kv, host, "direct")}
    movers["direct"].batched = False
    using = ["kernel"]

    def load(direct: bool):
        m = movers[using[0]]
        m.direct = direct
        m.to_device(hp, dp)
        return m.take_ready()

    def backup(direct: bool):
        m = movers[using[0]]
        m.direct = direct
        return m.to_host(dp, hp)

    # warm-up: Triton compiles, the allocator caches the staging buffer
    for io, direct in (("kernel", False), ("kernel", True), ("direct", True), ("batched", True)):
        using[0] = io
        load(direct)
        backup(direct).wait()
    using[0] = "kernel"
    torch.cuda.synchronize()
    gemm_alone = statistics.median(_timed(lambda: _gemms(40, a, b)) for _ in range(args.repeats))
    out["gemm_chain_ms"] = gemm_alone
    from radixmesh.kernels import kv_pages

    variants = [("staged", False, None)] + [(f"kernels-{p}", True, p) for p in args.programs]
    if movers["direct"].dma:
        variants.append(("mover-direct", True, None))  # the copy engine (backups still kernels.kv_pages)
    if movers["batched"].batched:
        variants.append(("mover-batched", True, None))  # one batch of copies per layer, no staging
    for name, direct, programs in variants:
        using[0] = {"mover-direct": "direct", "mover-batched": "batched"}.get(name, "kernel")
        if programs is not None:  # loads launch kv_pages.PROGRAMS wide, backups host_pool.BACKUP_PROGRAMS
            kv_pages.PROGRAMS = host_pool.BACKUP_PROGRAMS = programs
            load(True)
            backup(True).wait()
        rec = {}
        loads, backups, gemms_beside, waited_whole, waited_layers = [], [], [], [], []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            t = time.perf_counter()
            ready = load(direct)
            ready[-1].synchronize()
            loads.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            backup(direct).wait()
            backups.append((time.perf_counter() - t) * 1e3)
            # beside 40 GEMMs on the compute stream
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            _gemms(2, a, b)  # the load is issued while these run
            ready = load(direct)
            _gemms(38, a, b)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            gemms_beside.append(start.elapsed_time(end))
            # a 32-layer chain of GEMMs reading the loaded pages: wait for all first, or layer by layer
            torch.cuda.synchronize()
            ready = load(direct)
            waited_whole.append(_timed(lambda: (torch.cuda.current_stream().wait_event(ready[-1]),
                                                _gemms(32, a, b[:, :4096]))))

            def per_layer(ready):
                for ev in ready:
                    torch.cuda.current_stream().wait_event(ev)
                    torch.mm(a, b[:, :4096])

            torch.cuda.synchronize()
            ready = load(direct)
            waited_layers.append(_timed(lambda: per_layer(ready)))
        torch.cuda.synchronize()
        rec["load_ms"] = statistics.median(loads)
        rec["load_GBps"] = nbytes / rec["load_ms"] / 1e6
        rec["backup_ms"] = statistics.median(backups)
        rec["backup_GBps"] = nbytes / rec["backup_ms"] / 1e6
        rec["gemm_chain_with_load_ms"] = statistics.median(gemms_beside)
        rec["layers_after_whole_load_ms"] = statistics.median(waited_whole)
        rec["layers_waiting_per_layer_ms"] = statistics.median(waited_layers)
        out["runs"][name] = rec
        print(name, json.dumps(rec), flush=True)
    print(json.dumps(out, indent=1))
    out["runs"]["dma-per-layer"] = _dma_per_layer(nbytes, args.repeats, a, b)
    print("dma-per-layer", json.dumps(out["runs"]["dma-per-layer"]), flush=True)
    if args.result_file:
        with open(args.result_file, "a") as f:
            f.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
