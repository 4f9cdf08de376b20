"""fp8 weights' decode products at 1-16 rows (issue 52), per 8B-shaped projection: 32 copies of each weight (qkv
[6144, 4096], o_proj [4096, 4096], gate_up [28672, 4096], down [4096, 14336]) run one after another in a CUDA graph
under programmatic dependent launch, so every product streams its weight from HBM as in a decode step; us per
product and per layer (the four summed) against the fp8 weight-read floor at this run's copy bandwidth. Variants:

  row xM        kernels.fp8_gemv.fp8_gemv_row, once per row (the one-row kernel M times); at one row also
                "row <config>" for each of --row-configs' tiles
  gemv16        kernels.fp8_gemv.fp8_gemv (the tensor-core product that ran 2-16 rows before fp8_gemv_rows)
  rows <config> kernels.fp8_gemv_rows with each of engine.decode_products.FP8_ROWS_TILES' configs for the padded row
                count, and --cores-configs (the CUDA cores at more rows, to check where they stop keeping up)
  bf16          the same shape with bfloat16 weights on F.linear (cuBLAS), against the same floor

Per-channel and block-wise (128 x 128) scales; every variant's output is first checked against the twin
(kernels.fp8_gemv.fp8_linear_reference) at each row count.

    python -m radixmesh.benchmarks.fp8_rows [--rows 1 2 4 8 16] [--scales channel block] [--result-file out.jsonl]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from radixmesh.benchmarks.pdl_chain import _copy_gbps, write_rows
from radixmesh.engine.decode_products import FP8_ROWS_TILES
from radixmesh.kernels.fp8_gemv import fp8_gemv, fp8_gemv_row, fp8_linear_reference
from radixmesh.kernels.fp8_gemv_rows import fp8_gemv_rows, padded_rows
from radixmesh.kernels.fp8_quant import FP8
from radixmesh.kernels.runtime import pdl_supported

ROLES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
BLOCK = (128, 128)


def _weights(dev) -> dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Per role, LAYERS (fp8 weight, per-channel scales, block scales); one fp8 tensor serves both scalings."""
    g = torch.Generator(device=dev).manual_seed(0)
    out = {}
    for role, (n, k) in ROLES.items():
        out[role] = [((torch.randn((n, k), device=dev, generator=g) * 16).to(FP8),  # within e4m3's 448
                      torch.full((n,), 1 / 16 / k ** 0.5, device=dev),
                      torch.full((-(-n // BLOCK[0]), -(-k // BLOCK[1])), 1 / 16 / k ** 0.5, device=dev))
                     for _ in range(LAYERS)]
    return out


def _variants(m: int, cores: list[tuple], cores_rows: list[int], row_configs: list[tuple] = ()) -> dict:
    """name -> product(x, w, scales, block) for a product of m rows; at one row, fp8_gemv_row with its default tiles
    and with each of `row_configs`."""
    out = {}
    if m == 1:
        out["row"] = lambda x, w, s, b: fp8_gemv_row(x, w, s, b, pdl=True)
        for config in row_configs:
            out[f"row {config}"] = lambda x, w, s, b, c=config: fp8_gemv_row(x, w, s, b, pdl=True, config=c)
        return out
    out[f"row x{m}"] = lambda x, w, s, b: [fp8_gemv_row(x[i:i + 1], w, s, b, pdl=True) for i in range(m)][-1]
    out["gemv16"] = lambda x, w, s, b: fp8_gemv(x, w, s, b, pdl=True)
    configs = list(FP8_ROWS_TILES[padded_rows(m)])
    configs += [c for c in cores if m in cores_rows and c not in configs]
    for config in configs:
        out[f"rows {config}"] = lambda x, w, s, b, c=config: fp8_gemv_rows(x, w, s, b, pdl=True, config=c)
    return out


def _graph(fn) -> tuple[torch.cuda.CUDAGraph, object]:
    """fn captured in a CUDA graph (its kernels compiled during the capture: only the PDL launches are compiled) and
    replayed once; (graph, fn's output)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def _graph_us(fn, calls: int, reps: int = 20) -> float:
    """us per call of the `calls` products fn runs, replayed `reps` times in one graph."""
    graph, _ = _graph(fn)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / calls


def _check(variants: dict, weights, m: int, dev) -> dict[str, float]:
    """Largest error of each variant (in a graph) against the twin over the four roles (first layer) and both
    scalings, in units of the twin's largest magnitude (a bf16 rounding is ~4e-3); a variant that does not fit the
    GPU is dropped."""
    errs = {}
    for name, product in list(variants.items()):
        worst = 0.0
        try:
            for w, sc, sb in (ws[0] for ws in weights.values()):
                x = torch.randn((m, w.shape[1]), device=dev, dtype=torch.bfloat16)
                for s, block in ((sc, None), (sb, BLOCK)):
                    want = fp8_linear_reference(x, w, s, block).float()
                    got = _graph(lambda: product(x, w, s, block))[1].float()
                    want = want[-got.shape[0]:]  # (row xM returns its last row)
                    worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
        except OutOfResources as e:
            print(f"{name}: {e}")
            del variants[name]
            continue
        errs[name] = worst
    return errs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--scales", nargs="+", default=["channel", "block"], choices=["channel", "block"])
    p.add_argument("--cores-configs", nargs="*", default=["4,512,2"],
                   help="fp8_gemv_rows CUDA-core tiles BLOCK_N,BLOCK_K,warps also timed at --cores-rows")
    p.add_argument("--cores-rows", type=int, nargs="*", default=[8],
                   help="row counts the planner gives no CUDA-core tile, timed with --cores-configs (each compiles "
                        "per K and row count: 16 rows takes minutes)")
    p.add_argument("--row-configs", nargs="*", default=[],
                   help="fp8_gemv_row tiles BLOCK_N,BLOCK_K,warps also timed at one row (radixmesh.benchmarks."
                        "row_issue counts their instructions a byte)")
    p.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 cuBLAS comparison (its 15 GB)")
    p.add_argument("--result-file")
    ns = p.parse_args()
    dev = torch.device("cuda")
    cores = [tuple(int(v) for v in c.split(",")) + ("cores",) for c in ns.cores_configs]
    row_configs = [tuple(int(v) for v in c.split(",")) for c in ns.row_configs]
    copy = _copy_gbps(dev)
    print(f"pdl supported: {pdl_supported()}; copy bandwidth {copy:.0f} GB/s")
    weights = _weights(dev)
    bf16 = None if ns.no_bf16 else {
        role: [torch.randn((n, k), device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
        for role, (n, k) in ROLES.items()}
    rows, layer_floor = [], sum(n * k for n, k in ROLES.values()) / copy / 1e3  # us
    for m in ns.rows:
        variants = _variants(m, cores, ns.cores_rows, row_configs)
        print(f"rows {m}: largest error / largest output", {k: f"{v:.1e}" for k, v in
                                                            _check(variants, weights, m, dev).items()})
        x = {k: torch.randn((m, k), device=dev, dtype=torch.bfloat16) for _, k in ROLES.values()}
        runs = [(f"{scale} {name}", product, scale) for scale in ns.scales for name, product in variants.items()]
        if bf16 is not None:
            runs.append(("bf16 cuBLAS", None, "bf16"))
        for label, product, scale in runs:
            layer_us = 0.0
            for role, (n, k) in ROLES.items():
                if product is None:
                    fn = [lambda w=w, xk=x[k]: F.linear(xk, w) for w in bf16[role]]
                else:
                    block = BLOCK if scale == "block" else None
                    fn = [lambda w=w, s=(sb if block else sc), xk=x[k], b=block, f=product: f(xk, w, s, b)
                          for w, sc, sb in weights[role]]
                us = _graph_us(lambda fn=fn: [f() for f in fn], LAYERS)
                floor = n * k / copy / 1e3
                layer_us += us
                rows.append({"rows": m, "variant": label, "role": role, "us": us, "x_floor": us / floor,
                             "floor_us": floor, "copy_GBps": copy})
            rows.append({"rows": m, "variant": label, "role": "layer", "us": layer_us,
                         "x_floor": layer_us / layer_floor, "floor_us": layer_floor, "copy_GBps": copy})
            roles = ", ".join(f"{r['role']} {r['us']:.1f}" for r in rows[-len(ROLES) - 1:-1])
            print(f"rows {m:2d} {label:>40}: {layer_us:8.1f} us a layer ({layer_us / layer_floor:.2f}x the fp8 "
                  f"floor {layer_floor:.1f} us); {roles}")
    write_rows(ns.result_file, rows)


if __name__ == "__main__":
    main()
