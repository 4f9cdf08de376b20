"""Issue 10's next step, measured before it is built: what a persistent decode kernel (one program per SM for a
whole chain of products, grid-wide barriers instead of kernel boundaries) would pay for its barriers, and how close
to the copy bandwidth it streams the 8B shape's product weights with a barrier after each product.

Batch-1 decode reads every weight once; each product is a kernel today, and each boundary costs a ramp-down and a
ramp-up of the memory stream (the products chained alone are 1.17-1.20x the floor on an H200, whatever kernel runs
them: benchmarks/results/NOTES.md, 2026-11-29 evening). A persistent kernel keeps every SM streaming across the
boundaries. Measured here, on the weights' memory traffic alone (each program sums its rows of each matrix: a
batch-1 product's reads with a trivial vector):

  barrier     one grid barrier (an arrival counter; every program spins until all have arrived), over many
  persistent  32 layers x (qkv, o_proj, gate_up, down) in one persistent kernel, a barrier after each product
  free        the same without the barriers (what streaming alone reaches)
  kernels     the same reads as one kernel per product, in a CUDA graph
  cublas      F.linear at one row over the same weights, in a CUDA graph (the step's products today, no LM head)

against the floor of those bytes at this run's copy bandwidth.

    python -m radixmesh.benchmarks.grid_barrier [--result-file F]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from radixmesh.benchmarks.pdl_chain import _copy_gbps, _time_graph as _graph_ms, write_rows

HIDDEN, INTER, QKV, LAYERS = 4096, 14336, 6144, 32
SHAPES = ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER))


@triton.jit
def _grid_sync(counter, target):
    """Every program of the grid arrives, then waits until `target` arrivals have been counted."""
    tl.debug_barrier()  # this program's writes are done
    tl.atomic_add(counter, 1, sem="release", scope="gpu")
    while tl.atomic_add(counter, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


@triton.jit
def _barriers_kernel(counter, n):
    programs = tl.num_programs(0)
    for i in range(n):
        _grid_sync(counter, (i + 1) * programs)


@triton.jit
def _stream_kernel(W, offsets, rows, cols, out, counter, first, n_products, SYNC: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Products first .. first + n_products - 1 of the tables: program p sums rows p*BLOCK_N, (p + P)*BLOCK_N, ...
    of each into out; with SYNC a grid barrier after each product."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    for j in range(first, first + n_products):
        base = tl.load(offsets + j)
        n = tl.load(rows + j)
        k = tl.load(cols + j)
        for r0 in range(pid * BLOCK_N, n, programs * BLOCK_N):
            r = r0 + tl.arange(0, BLOCK_N)
            acc = tl.zeros([BLOCK_N], tl.float32)
            for k0 in range(0, k, BLOCK_K):
                c = k0 + tl.arange(0, BLOCK_K)
                w = tl.load(W + base + r[:, None].to(tl.int64) * k + c[None, :], mask=(r[:, None] < n),
                            other=0.0, eviction_policy="evict_first")
                acc += tl.sum(w.to(tl.float32), axis=1)
            tl.store(out + r, acc, mask=r < n)
        if SYNC:
            _grid_sync(counter, (j - first + 1) * programs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-n", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--per-sm", type=int, nargs="+", default=[1, 4],
                        help="persistent programs per SM (all must be resident at once, or the barrier never opens: "
                             "8 an SM hung the streaming kernel on an H200)")
    parser.add_argument("--block-k", type=int, default=512)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--result-file")
    ns = parser.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    shapes = [s for _ in range(LAYERS) for s in SHAPES]
    sizes = [n * k for n, k in shapes]
    offsets = torch.tensor([sum(sizes[:i]) for i in range(len(sizes))], dtype=torch.int64, device=dev)
    rows = torch.tensor([n for n, _ in shapes], dtype=torch.int32, device=dev)
    cols = torch.tensor([k for _, k in shapes], dtype=torch.int32, device=dev)
    W = torch.randn(sum(sizes), dtype=torch.bfloat16, device=dev)
    out = torch.empty(2 * INTER, dtype=torch.float32, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    copy = _copy_gbps(dev)
    floor_ms = W.numel() * 2 / copy / 1e6
    rows_out = []

    def report(name, ms, **extra):
        row = {"variant": name, "ms": ms, "x_floor": ms / floor_ms, "floor_ms": floor_ms, "copy_GBps": copy,
               "sms": sms, "device": torch.cuda.get_device_name(), **extra}
        rows_out.append(row)
        print(f"{name:>36}: {ms:8.3f} ms  {ms / floor_ms:.3f}x the floor ({floor_ms:.3f} ms at {copy:.0f} GB/s)")

    n_barriers = 10_000
    for per_sm in ns.per_sm:
        grid = (sms * per_sm,)
        counter.zero_()
        _barriers_kernel[grid](counter, 10, num_warps=ns.warps)  # compiles; would hang if not all resident
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        counter.zero_()
        start.record()
        _barriers_kernel[grid](counter, n_barriers, num_warps=ns.warps)
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / n_barriers
        print(f"grid barrier over {grid[0]} programs ({per_sm} an SM): {us:.3f} us each")
        rows_out.append({"variant": "barrier", "us_per_barrier": us, "programs": grid[0], "per_sm": per_sm,
                         "device": torch.cuda.get_device_name()})
    n_products = len(shapes)
    for block_n in ns.block_n:
        tiles = dict(BLOCK_N=block_n, BLOCK_K=ns.block_k, num_warps=ns.warps)

        def persistent(sync=True, per_sm=1):
            counter.zero_()
            _stream_kernel[(sms * per_sm,)](W, offsets, rows, cols, out, counter, 0, n_products, SYNC=sync,
                                            **tiles)

        def kernels():
            for j in range(n_products):
                n = shapes[j][0]
                _stream_kernel[(triton.cdiv(n, block_n),)](W, offsets, rows, cols, out, counter, j, 1, SYNC=False,
                                                           **tiles)
        for per_sm in ns.per_sm:
            report(f"persistent x{per_sm}/SM, barriers, {block_n}-row", _graph_ms(lambda: persistent(True, per_sm)),
                   block_n=block_n, per_sm=per_sm)
            report(f"persistent x{per_sm}/SM, no barriers, {block_n}-row",
                   _graph_ms(lambda: persistent(False, per_sm)), block_n=block_n, per_sm=per_sm)
        report(f"a kernel per product, {block_n}-row tiles", _graph_ms(kernels), block_n=block_n)
    views = [W[int(o):int(o) + n * k].view(n, k) for o, (n, k) in zip(offsets.tolist(), shapes)]
    xs = {k: torch.randn((1, k), dtype=torch.bfloat16, device=dev) for k in (HIDDEN, INTER)}
    report("cuBLAS F.linear per product", _graph_ms(lambda: [F.linear(xs[v.shape[1]], v) for v in views]))
    write_rows(ns.result_file, rows_out)


if __name__ == "__main__":
    main()
