"""Issue 10: can one persistent kernel stream the batch-1 decode step's product weights near the copy bandwidth, with
a grid-wide barrier between products? The second probe of that design (benchmarks.grid_barrier measured the
barrier, 0.9-1.0 us over one program an SM on an H200, and a first streaming loop that restarted its pipeline every
few tiles and stayed far from the floor).

Here every product is a real one, y = W x in float32 from bf16 weights, and each is its own loop compiled for its
shape (N, K constexpr): a program takes a contiguous run of BLOCK_N-row blocks and reads each block's whole rows in
K / BLOCK_K unrolled loads that do not depend on each other, so a program keeps K * BLOCK_N * 2 bytes in flight per
block. The variants, over 32 layers of (qkv, o_proj, gate_up, down) of the Llama-3.1-8B shape:

  persistent   one kernel, PER_SM programs an SM, a grid barrier after each product (what the step needs: the next
               product reads the one before's output)
  free         the same without barriers (streaming alone)
  kernels      the same loop as one kernel per product (one block a program), in a CUDA graph
  cublas       F.linear at one row over the same weights, in a CUDA graph

each against the floor of those bytes at this run's copy bandwidth, and every variant's outputs against cuBLAS's.

    python -m radixmesh.benchmarks.persistent_products [--per-sm 1 2 4] [--block-n 2 4 8] [--result-file F]
    TRITON_INTERPRET=1 python -m radixmesh.benchmarks.persistent_products --tiny
        (CPU: the outputs checked on small shapes)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

HIDDEN, INTER, QKV, LAYERS = 4096, 14336, 6144, 32
SPIN_LIMIT = tl.constexpr(1 << 14) # a barrier gives up after this many polls: a grid not all resident fails slow, not forever


@triton.jit
def _grid_sync(counter, target):
    """benchmarks.grid_barrier's barrier (an arrival counter, every program polling it), with bounded polling."""
    tl.debug_barrier()
    tl.atomic_add(counter, 1, sem="release", scope="gpu")
    polls = 0
    while (tl.atomic_add(counter, 0, sem="acquire", scope="gpu") < target) & (polls < SPIN_LIMIT):
        polls += 1
    tl.debug_barrier()


@triton.jit
def _product(W, X, Y, pid, programs, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """Y[:N] = W[N, K] @ X[:K] (float32), program `pid` of `programs` taking row blocks pid*B/P .. (pid+1)*B/P."""
    blocks: tl.constexpr = N // BLOCK_N
    start = pid * blocks // programs
    end = (pid + 1) * blocks // programs
    for b in range(start, end):
        r = b * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = W + r.to(tl.int64)[:, None] * K
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: the block's loads go out together
            c = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(rows + c[None, :], eviction_policy="evict_first")
            acc += w.to(tl.float32) * tl.load(X + c).to(tl.float32)[None, :]
        tl.store(Y + r, tl.sum(acc, 1))


@triton.jit
def _layers_kernel(W, X_H, X_I, Y_QKV, Y_O, Y_GU, Y_D, counter, n_layers, HIDDEN: tl.constexpr,
                   INTER: tl.constexpr, QKV: tl.constexpr, SYNC: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """Every layer's four products in turn (weights [qkv | o | gate_up | down] per layer, contiguous), with a grid
    barrier after each when SYNC."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    layer_elems: tl.constexpr = QKV * HIDDEN + HIDDEN * HIDDEN + 2 * INTER * HIDDEN + HIDDEN * INTER
    layer_start = W
    for layer in range(n_layers):
        base = layer_start
        _product(base, X_H, Y_QKV, pid, programs, QKV, HIDDEN, BLOCK_N, BLOCK_K)
        if SYNC:
            _grid_sync(counter, (4 * layer + 1) * programs)
        base += QKV * HIDDEN
        _product(base, X_H, Y_O, pid, programs, HIDDEN, HIDDEN, BLOCK_N, BLOCK_K)
        if SYNC:
            _grid_sync(counter, (4 * layer + 2) * programs)
        base += HIDDEN * HIDDEN
        _product(base, X_H, Y_GU, pid, programs, 2 * INTER, HIDDEN, BLOCK_N, BLOCK_K)
        if SYNC:
            _grid_sync(counter, (4 * layer + 3) * programs)
        base += 2 * INTER * HIDDEN
        _product(base, X_I, Y_D, pid, programs, HIDDEN, INTER, BLOCK_N, BLOCK_K)
        if SYNC:
            _grid_sync(counter, (4 * layer + 4) * programs)
        layer_start += layer_elems  # a 64-bit pointer: the offsets past 2^31 elements never pass through an int32


@triton.jit
def _one_kernel(W, X, Y, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    _product(W, X, Y, tl.program_id(0), tl.num_programs(0), N, K, BLOCK_N, BLOCK_K)


class Model:
    """The product weights of `layers` layers in one buffer, the two input vectors, one output per role."""

    def __init__(self, dev, hidden=HIDDEN, inter=INTER, qkv=QKV, layers=LAYERS, seed=0):
        self.hidden, self.inter, self.qkv, self.layers = hidden, inter, qkv, layers
        self.shapes = ((qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter))
        self.layer_elems = sum(n * k for n, k in self.shapes)
        g = torch.Generator(device=dev).manual_seed(seed)
        self.W = (torch.randn(layers * self.layer_elems, generator=g, device=dev) * 0.02).to(torch.bfloat16)
        self.xh = torch.randn(hidden, generator=g, device=dev).to(torch.bfloat16)
        self.xi = torch.randn(inter, generator=g, device=dev).to(torch.bfloat16)
        self.ys = [torch.zeros(n, dtype=torch.float32, device=dev) for n, _ in self.shapes]
        self.counter = torch.zeros(1, dtype=torch.int32, device=dev)

    def view(self, layer: int, role: int) -> torch.Tensor:
        start = layer * self.layer_elems + sum(n * k for n, k in self.shapes[:role])
        n, k = self.shapes[role]
        return self.W[start:start + n * k].view(n, k)

    def x(self, role: int) -> torch.Tensor:
        return self.xi if role == 3 else self.xh

    def persistent(self, programs: int, sync: bool, block_n: int, block_k: int, warps: int, stages: int) -> None:
        self.counter.zero_()
        self.compiled = _layers_kernel[(programs,)](self.W, self.xh, self.xi, *self.ys, self.counter, self.layers,
                                    HIDDEN=self.hidden, INTER=self.inter, QKV=self.qkv, SYNC=sync, BLOCK_N=block_n,
                                    BLOCK_K=block_k, num_warps=warps, num_stages=stages)

    def kernels(self, block_n: int, block_k: int, warps: int, stages: int) -> None:
        for layer in range(self.layers):
            for role, (n, k) in enumerate(self.shapes):
                _one_kernel[(n // block_n,)](self.view(layer, role), self.x(role), self.ys[role], N=n, K=k,
                                             BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)

    def cublas(self) -> None:
        for layer in range(self.layers):
            for role in range(4):
                F.linear(self.x(role)[None], self.view(layer, role))

    def error(self) -> float:
        """The largest difference of the last layer's outputs from the float32 products, over their largest value."""
        worst = 0.0
        for role in range(4):
            want = self.view(self.layers - 1, role).float() @ self.x(role).float()
            worst = max(worst, ((self.ys[role] - want).abs().max() / want.abs().max()).item())
        return worst


def resident(regs: int, warps: int, shared: int) -> int:
    """Programs of a kernel that fit on one Hopper SM at once: 64K registers allocated 256 a warp at a time, 64
    warps, 32 blocks, 227 KiB of shared memory."""
    per_warp = -(-regs * 32 // 256) * 256
    fit = min(65536 // per_warp // warps, 64 // warps, 32)
    return min(fit, (227 * 1024) // shared) if shared else fit


def tiny_check() -> None:
    """On any device (TRITON_INTERPRET=1 on a CPU): small shapes, every variant's outputs against float32 products."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m = Model(dev, hidden=64, inter=96, qkv=128, layers=2)
    for name, run in (("persistent, 2 programs", lambda: m.persistent(2, False, 4, 32, 4, 1)),
                      ("persistent, 3 programs", lambda: m.persistent(3, False, 2, 32, 4, 1)),
                      ("kernels", lambda: m.kernels(4, 32, 4, 1))):
        for y in m.ys:
            y.zero_()
        run()
        err = m.error()
        print(f"{name}: largest error {err:.2e}")
        assert err < 1e-5, (name, err)


def main() -> None:
    from radixmesh.benchmarks.pdl_chain import _copy_gbps, _time_graph, write_rows

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="check the outputs on small shapes and stop")
    parser.add_argument("--per-sm", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--block-n", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--block-k", type=int, default=1024)
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[1])
    parser.add_argument("--result-file")
    ns = parser.parse_args()
    if ns.tiny:
        tiny_check()
        return
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    m = Model(dev)
    copy = _copy_gbps(dev)
    floor_ms = m.W.numel() * 2 / copy / 1e6
    rows_out = []

    def report(name, ms, **extra):
        err = m.error()
        row = {"variant": name, "ms": ms, "x_floor": ms / floor_ms, "floor_ms": floor_ms, "copy_GBps": copy,
               "max_rel_error": err, "sms": sms, "device": torch.cuda.get_device_name(), **extra}
        rows_out.append(row)
        print(f"{name:>52}: {ms:8.3f} ms  {ms / floor_ms:.3f}x the floor ({floor_ms:.3f} ms at {copy:.0f} GB/s)"
              f"  error {err:.1e}", flush=True)

    report("cuBLAS F.linear per product", _time_graph(m.cublas))
    for warps in ns.warps:
        for stages in ns.stages:
            for block_n in ns.block_n:
                tiles = dict(block_n=block_n, block_k=ns.block_k, warps=warps, stages=stages)
                for per_sm in ns.per_sm:
                    ms = _time_graph(lambda: m.persistent(sms * per_sm, False, **tiles))
                    regs, spills = m.compiled.n_regs, m.compiled.n_spills
                    fit = resident(regs, warps, m.compiled.metadata.shared)
                    report(f"persistent x{per_sm}/SM free, {block_n}-row, {warps}w {stages}s", ms, per_sm=per_sm,
                           sync=False, regs=regs, spills=spills, resident_per_sm=fit, **tiles)
                    if per_sm > fit:  # the barrier would wait for programs that cannot start
                        print(f"  barriers skipped: {fit} programs an SM fit ({regs} registers)")
                        continue
                    ms = _time_graph(lambda: m.persistent(sms * per_sm, True, **tiles))
                    report(f"persistent x{per_sm}/SM barriers, {block_n}-row, {warps}w {stages}s", ms,
                           per_sm=per_sm, sync=True, regs=regs, spills=spills, **tiles)
                report(f"a kernel per product, {block_n}-row, {warps}w {stages}s", _time_graph(lambda: m.kernels(**tiles)),
                       **tiles)
    write_rows(ns.result_file, rows_out)


if __name__ == "__main__":
    main()
