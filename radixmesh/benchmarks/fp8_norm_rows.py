"""Issue 52's batch-1 lever after the grouped one-row tiles: the RMSNorm before qkv and gate_up in the product's own
launch (kernels.fp8_gemv_norm) against today's two launches (kernels.norm.fused_add_rmsnorm, then kernels.fp8_gemv.
fp8_gemv_row), on the 8B shape: per layer, add-and-norm + qkv [6144, 4096], then add-and-norm + gate_up [28672,
4096], 32 layers one after another in a CUDA graph under programmatic dependent launch, so every product streams its
weight from HBM as in a decode step (the residual sums ping-pong between two buffers, as the fused kernel needs).
us a layer against the two products' fp8 weight-read floor at this run's copy bandwidth; each fused config's output
is first checked against the two kernels'.

Prediction (twentieth session, before any device time): the norm is a one-program launch whose share of the 8B fp8
step is ~1.6 us; inside the product it costs each program a K-long reduction while its weight loads are in flight,
and the norm's elementwise work (three roundings, the sum of squares) on each x value, shared by BLOCK_N rows: at
sm_90 (Triton 3.6) the fused (2, 4) tile issues 9.0 instructions a weight byte against the product's 6.4 at (2,
4096, 4), (4, 4) 6.2, (8, 4) 4.8 at 126 registers. Fused should save ~0.5-1.3 us per norm, ~1-2.6 us a layer (~30-85
us of the 3.25-ms H100 step); the plan keeps it only where it times faster.

    python -m radixmesh.benchmarks.fp8_norm_rows [--scales channel block] [--configs 2,4 4,4 4,8 8,4 8,8]
        [--row-tiles qkv=2,1024,2,16 gate_up=2,4096,4] [--result-file out.jsonl]
"""

from __future__ import annotations

import argparse

import torch

from radixmesh.benchmarks.fp8_rows import BLOCK, LAYERS, _graph, _graph_us
from radixmesh.benchmarks.pdl_chain import _copy_gbps, write_rows
from radixmesh.kernels.fp8_gemv import fp8_gemv_row
from radixmesh.kernels.fp8_gemv_norm import fp8_gemv_row_norm
from radixmesh.kernels.fp8_quant import FP8
from radixmesh.kernels.norm import fused_add_rmsnorm

ROLES = {"qkv": (6144, 4096), "gate_up": (28672, 4096)}  # the products after a norm, 8B shape
HIDDEN = 4096
EPS = 1e-5


def _layers(dev, block) -> list[dict]:
    """Per layer: each role's fp8 weight and scales (per channel, or `block`-wise) and its norm's weight."""
    g = torch.Generator(device=dev).manual_seed(0)
    out = []
    for _ in range(LAYERS):
        layer = {}
        for role, (n, k) in ROLES.items():
            w = (torch.randn((n, k), device=dev, generator=g) * 16).to(FP8)  # within e4m3's 448
            shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
            layer[role] = (w, torch.full(shape, 1 / 16 / k ** 0.5, device=dev),
                           1 + 0.1 * torch.randn((k,), device=dev, generator=g).to(torch.bfloat16))
        out.append(layer)
    return out


def _chain(layers, block, h, d, bufs, fused: tuple | None, row_tiles: dict) -> list[torch.Tensor]:
    """One graph's work: per layer and role, the add-and-norm of (h, d) and the product, in two launches (`fused`
    None, the products on `row_tiles`) or one (`fused`: its (BLOCK_N, num_warps)); every product's output becomes
    the next role's d and each residual sum the next h (two buffers in turn). The outputs, in order."""
    outs = []
    for i, layer in enumerate(layers):
        for j, (role, (w, s, norm)) in enumerate(layer.items()):
            out = bufs[(2 * i + j) % 2]
            if fused is None:
                x, h = fused_add_rmsnorm(h, d, norm, EPS, residual_out=out)
                y = fp8_gemv_row(x, w, s, block, pdl=True, config=row_tiles.get(role))
            else:
                y, h = fp8_gemv_row_norm(h, d, norm, EPS, w, s, block, residual_out=out, pdl=True, config=fused)
            d = y[:, :h.shape[1]]  # (the next add takes the first hidden-size outputs: a stand-in for what is between)
            outs.append(y)
    return outs


def _config(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scales", nargs="+", default=["channel", "block"], choices=["channel", "block"])
    p.add_argument("--configs", nargs="+", default=["2,4", "4,4", "4,8", "8,4", "8,8"],
                   help="fused BLOCK_N,num_warps")
    p.add_argument("--row-tiles", nargs="*", default=["qkv=2,1024,2,16", "gate_up=2,4096,4"],
                   help="role=tile for the unfused products (the plan's picks on an H100, twentieth session)")
    p.add_argument("--result-file")
    ns = p.parse_args()
    dev = torch.device("cuda")
    copy = _copy_gbps(dev)
    row_tiles = {r: _config(t) for r, t in (s.split("=") for s in ns.row_tiles)}
    floor = sum(n * k for n, k in ROLES.values()) / copy / 1e3  # us a layer
    rows = []
    for scale in ns.scales:
        block = BLOCK if scale == "block" else None
        layers = _layers(dev, block)
        h0, d0 = (torch.randn((1, HIDDEN), device=dev, dtype=torch.bfloat16) for _ in range(2))
        bufs = [torch.empty_like(h0) for _ in range(2)]
        variants = {"two launches": None, **{f"fused {c}": _config(c) for c in ns.configs}}
        want = _graph(lambda: _chain(layers[:1], block, h0, d0, bufs, None, row_tiles))[1]
        for name, fused in variants.items():
            got = _graph(lambda f=fused: _chain(layers[:1], block, h0, d0, bufs, f, row_tiles))[1]
            err = max(((g.float() - w.float()).abs().max() / w.float().abs().max()).item() for g, w in zip(got, want))
            us = _graph_us(lambda f=fused: _chain(layers, block, h0, d0, bufs, f, row_tiles), LAYERS)
            rows.append({"scale": scale, "variant": name, "us_a_layer": us, "x_floor": us / floor, "floor_us": floor,
                         "largest_error": err, "copy_GBps": copy, "row_tiles": ns.row_tiles})
            print(f"{scale:7} {name:>14}: {us:6.1f} us a layer ({us / floor:.2f}x the two products' floor "
                  f"{floor:.1f} us); error against two launches {err:.1e}")
    write_rows(ns.result_file, rows)


if __name__ == "__main__":
    main()
