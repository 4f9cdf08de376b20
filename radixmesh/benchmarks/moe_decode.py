"""Issue 51: the experts of one mixture-of-experts layer at decode batch sizes, kernels.moe_decode's few-token path
(a small grid of its tiles, searched one launch at a time) against kernels.moe's alignment, grouped GEMMs, SiLU and
top-k sum. Each variant runs `--layers` layers of distinct random weights (more bytes than L2 holds, as in a model's
step) in one CUDA graph; the time per layer is set against the floor of reading the experts the tokens picked (each
distinct expert once) at this run's copy bandwidth. Every variant's output is checked against the grouped path's.

`--fp8 block|channel`: the experts in float8_e4m3fn with 128 x 128 block scales (Qwen3-30B-A3B-FP8's) or one per row,
kernels.moe_decode_fp8 against kernels.moe_fp8's grouped GEMMs; the floor counts one byte a weight. Block-wise the
grouped GEMMs quantize the activations (W8A8) and the few-token path does not: there the few-token variants are
checked against the first one, which is checked against its twin.

`--mxfp4`: the experts in MXFP4 (random codes, scales 2^-10..2^-5; gpt-oss's layout, without its biases and clamp),
kernels.moe_mxfp4's few-token launches (ScaledTiles: tl.dot_scaled or the CUDA-core word products, unrolled or looped;
the best becomes RADIXMESH_MXFP4_TILES) against its grouped GEMMs; the floor counts 17/32 of a byte a weight. Each
row's `default_path` says which path the engine takes at that many tokens, so the rows show where the grouped GEMMs
should take over.

    python -m radixmesh.benchmarks.moe_decode --model-path benchmarks/configs/qwen3-30b-a3b --tokens 1 2 4 8 \\
        [--layers 8] [--tp-size 1] [--fp8 block|channel | --mxfp4] [--result-file F]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from radixmesh.benchmarks.pdl_chain import _copy_gbps, _time_graph, write_rows
from radixmesh.engine.model_config import ModelConfig
from radixmesh.kernels.moe import fused_experts, route_reference
from radixmesh.kernels.moe_decode import DecodeTiles, decode_experts, use_decode_path
from radixmesh.kernels.moe_decode_fp8 import decode_experts_fp8, decode_experts_fp8_reference, fp8_tiles
from radixmesh.kernels.fp8_experts import scale_shape
from radixmesh.kernels.moe_fp8 import fused_experts_fp8
from radixmesh.kernels.moe_mxfp4 import ScaledTiles, decode_experts_mxfp4, fused_experts_mxfp4

UP_GRID = [dict(up_block_n=n, up_block_k=k, up_warps=w) for n, k, w in itertools.product((1, 2, 4), (512, 1024, 2048),
                                                                                         (4, 8))]
DOWN_GRID = [dict(down_block_n=n, down_block_k=k, down_warps=w, down_stacked=st)
             for n, k, w, st in itertools.product((2, 4, 8), (256, 512), (4, 8), (0, 1))]


# fp8: a load of the same bytes covers twice the K
FP8_UP_GRID = [dict(up_block_n=n, up_block_k=k, up_warps=w) for n, k, w in itertools.product((1, 2, 4), (1024, 2048),
                                                                                             (4, 8))]
FP8_DOWN_GRID = [dict(down_block_n=n, down_block_k=k, down_warps=w, down_stacked=st)
                 for n, k, w, st in itertools.product((2, 4, 8), (256, 512, 1024), (4, 8), (0, 1))]


# MXFP4 (ScaledTiles): the products' form (tl.dot_scaled, or the word products with K unrolled or in a pipelined loop)
# with the gate/up tile, then the down tile, then the warps
MXFP4_UP_GRID = ([dict(words=f, up_block_n=n, up_block_k=k, loop=0, num_stages=1) for f, n, k in
                  itertools.product((1, 2), (4, 8, 16), (1024, 2048, 4096))]
                 + [dict(words=f, up_block_n=n, up_block_k=k, loop=1, num_stages=st) for f, n, k, st in
                    itertools.product((1, 2), (8, 16), (256, 512), (2, 3))]
                 + [dict(words=1, up_block_n=n, up_block_k=1024, loop=0, num_stages=1, num_warps=w) for n, w in
                    ((1, 1), (2, 1), (2, 2), (4, 2))]  # small programs, many an SM (2 of the 172-register default fit)
                 + [dict(words=0, up_block_n=32, up_block_k=256, num_stages=3)])
MXFP4_DOWN_GRID = [dict(down_block_n=n, down_block_k=k) for n, k in
                   itertools.product((8, 16, 32), (256, 512, 1024, 2048, 4096))]
MXFP4_WARPS_GRID = [dict(num_warps=w) for w in (1, 2, 4, 8)]


def _mxfp4_weights(experts: int, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 codes [experts, n, k / 2] and scales [experts, n, k / 32] of 2^-10..2^-5."""
    q = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    return q, torch.randint(117, 123, (experts, n, k // 32), dtype=torch.uint8, device="cuda", generator=gen)


def _fp8_weights(experts: int, n: int, k: int, block, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random fp8 codes [experts, n, k] over most of e4m3's range, with scales making the weights ~ k^-0.5."""
    w = (torch.randn((experts, n, k), device="cuda", generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    return w, (0.5 + torch.rand(scale_shape(w, block), device="cuda", generator=gen)) * k ** -0.5 / 64


class Layers:
    """`layers` layers of experts (bf16, fp8 with `fp8`'s scales: "block" 128 x 128 or "channel", or `mxfp4`;
    random), one routing of `tokens` tokens each, and the outputs. `w[i]`: layer i's expert arguments between x and
    the routing ((w13, w2), (w13, s13, w2, s2, block), or MXFP4's (q13, s13, q2, s2))."""

    def __init__(self, layers: int, experts: int, hidden: int, inter: int, top_k: int, tokens: int,
                 fp8: str | None = None, mxfp4: bool = False):
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        dt = torch.bfloat16
        self.x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dt)
        self.block = (128, 128) if fp8 == "block" else None
        if mxfp4:
            self.w = [(*_mxfp4_weights(experts, 2 * inter, hidden, gen), *_mxfp4_weights(experts, hidden, inter, gen))
                      for _ in range(layers)]
        elif fp8:
            self.w = [(*_fp8_weights(experts, 2 * inter, hidden, self.block, gen),
                       *_fp8_weights(experts, hidden, inter, self.block, gen), self.block) for _ in range(layers)]
        else:
            self.w = [((torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen, dtype=dt)
                        * hidden ** -0.5),
                       (torch.randn(experts, hidden, inter, device="cuda", generator=gen, dtype=dt) * inter ** -0.5))
                      for _ in range(layers)]
        self.route = [route_reference(torch.randn(tokens, experts, device="cuda", generator=gen), top_k, True, dt)
                      for _ in range(layers)]
        self.out = [None] * layers
        # (scales: under 1% of an fp8 expert's bytes; MXFP4's a byte every 32 weights)
        expert_bytes = (3 * inter * hidden) * (17 / 32 if mxfp4 else 1 if fp8 else 2)
        self.floor_bytes = sum(len(set(ids.flatten().tolist())) for _, ids in self.route) * expert_bytes / layers

    def run(self, path) -> None:
        for i, (w, (weights, ids)) in enumerate(zip(self.w, self.route)):
            self.out[i] = path(self.x, *w, weights, ids)


def _measure(layers: Layers, path, want: list | None) -> float | None:
    """Microseconds per layer in a CUDA graph, or None where the tiles do not compile or launch on this GPU; the
    outputs must match `want` (bf16 rounding) where given."""
    try:
        ms = _time_graph(lambda: layers.run(path))
    except Exception as e:  # noqa: BLE001 - a tile the GPU cannot hold (registers, shared memory)
        print(f"  skipped: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return None
    if want is not None:
        for got, ref in zip(layers.out, want):
            torch.testing.assert_close(got.float(), ref.float(), rtol=3e-2, atol=3e-2)
    return ms * 1e3 / len(layers.w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--layers", type=int, default=8, help="distinct layers a graph runs (their experts exceed L2)")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--fp8", choices=["block", "channel"], help="fp8 experts with these scales (module docstring)")
    ap.add_argument("--mxfp4", action="store_true", help="MXFP4 experts (module docstring)")
    ap.add_argument("--result-file")
    ns = ap.parse_args()
    cfg = ModelConfig.from_path(ns.model_path)
    if cfg.moe is None:
        ap.error(f"{cfg.architecture} has no mixture-of-experts layers")
    moe, inter = cfg.moe, cfg.moe.intermediate_size // ns.tp_size
    copy = _copy_gbps(torch.device("cuda"))
    base = {"device": torch.cuda.get_device_name(), "copy_GBps": copy, "experts": moe.num_experts,
            "top_k": moe.top_k, "hidden": cfg.hidden_size, "intermediate": inter, "layers": ns.layers,
            "weights": "mxfp4" if ns.mxfp4 else f"fp8-{ns.fp8}" if ns.fp8 else "bf16"}
    if ns.fp8 and ns.mxfp4:
        ap.error("--fp8 and --mxfp4 are two weight formats: give one")
    grouped_path, decode_path = ((fused_experts_mxfp4, decode_experts_mxfp4) if ns.mxfp4 else
                                 (fused_experts_fp8, decode_experts_fp8) if ns.fp8 else
                                 (fused_experts, decode_experts))
    rows = []
    for tokens in ns.tokens:
        layers = Layers(ns.layers, moe.num_experts, cfg.hidden_size, inter, moe.top_k, tokens, ns.fp8, ns.mxfp4)
        floor_us = layers.floor_bytes / copy / 1e3

        def report(path: str, us: float | None, **extra) -> None:
            if us is None:
                return
            rows.append({**base, "tokens": tokens, "path": path, "us_per_layer": us, "floor_us": floor_us,
                         "x_floor": us / floor_us, "default_path": "decode" if use_decode_path(
                             tokens, moe.top_k, moe.num_experts) else "grouped", **extra})
            print(f"tokens {tokens}: {path:>8} {us:7.2f} us a layer, {us / floor_us:.2f}x the floor "
                  f"({floor_us:.2f} us at {copy:.0f} GB/s) {extra or ''}", flush=True)

        grouped = _measure(layers, lambda *a: grouped_path(*a, elsewhere=False, decode_path=False), None)
        want = list(layers.out)
        report("grouped", grouped)
        # the defaults, where the search starts
        best = ScaledTiles() if ns.mxfp4 else fp8_tiles(layers.block) if ns.fp8 else DecodeTiles()
        first = _measure(layers, lambda *a: decode_path(*a, tiles=best), None if layers.block else want)
        if layers.block:  # W8A8 grouped, W8A16 here: the first variant against its twin, the others against it
            want = None
            if first is not None:
                twin = decode_experts_fp8_reference(layers.x, *layers.w[0], *layers.route[0])
                torch.testing.assert_close(layers.out[0].float(), twin.float(), rtol=2e-2, atol=2e-2)
                want = list(layers.out)
        report("decode", first, tiles=best._asdict())
        # one launch's tiles at a time, the other's at their best so far
        grids = ((MXFP4_UP_GRID, MXFP4_DOWN_GRID, MXFP4_WARPS_GRID) if ns.mxfp4 else
                 (FP8_UP_GRID, FP8_DOWN_GRID) if ns.fp8 else (UP_GRID, DOWN_GRID))
        for grid in grids:
            timed = []
            for change in grid:
                t = best._replace(**change)
                us = _measure(layers, lambda *a, t=t: decode_path(*a, tiles=t), want)
                if us is not None:
                    timed.append((us, t))
                    print(f"  searched {us:7.2f} us {json.dumps(t._asdict())}", flush=True)  # (a cut run keeps these)
            best = min(timed, key=lambda r: r[0])[1] if timed else best
        report("decode", _measure(layers, lambda *a: decode_path(*a, tiles=best), want), tiles=best._asdict(),
               best_tiles=True)
    write_rows(ns.result_file, rows)


if __name__ == "__main__":
    main()
