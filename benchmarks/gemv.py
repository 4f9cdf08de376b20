"""The decode projections of the Llama-3.1-8B shape at 1-8 rows: cuBLAS (torch) against kernels.gemv over a small grid
of tile configurations, in GB/s of weights read (each weight rotated among copies so no run is served from L2).

    python -m benchmarks.gemv [--rows 1 8] [--result-file out.jsonl]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton.testing

from kernels.gemv import gemv

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
CONFIGS = list(itertools.product([16, 32], [256, 512], [4, 8], [3, 5]))  # BLOCK_N, BLOCK_K, warps, stages
ROTATE_BYTES = 512 << 20  # weights cycled per shape: several times the L2


def _time_ms(fn, weights, x) -> float:
    it = itertools.cycle(weights)
    return triton.testing.do_bench(lambda: fn(x, next(it)), warmup=25, rep=100, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--result-file")
    ns = parser.parse_args()
    dev = torch.device("cuda")
    rows = []
    for (name, (n, k)), m in itertools.product(SHAPES.items(), ns.rows):
        nbytes = n * k * 2
        copies = max(2, ROTATE_BYTES // nbytes)
        weights = [torch.randn((n, k), device=dev, dtype=torch.bfloat16) / 64 for _ in range(copies)]
        x = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
        cublas = _time_ms(lambda a, w: F.linear(a, w), weights, x)
        best = min(((_time_ms(lambda a, w, c=c: gemv(a, w, config=c), weights, x), c) for c in CONFIGS))
        default = _time_ms(lambda a, w: gemv(a, w), weights, x)
        row = {"shape": name, "n": n, "k": k, "rows": m, "cublas_GBps": nbytes / cublas / 1e6,
               "gemv_default_GBps": nbytes / default / 1e6, "gemv_best_GBps": nbytes / best[0] / 1e6,
               "gemv_best_config": best[1], "device": torch.cuda.get_device_name()}
        rows.append(row)
        print(f"{name:>8} m={m}: cuBLAS {row['cublas_GBps']:6.0f} GB/s  gemv default {row['gemv_default_GBps']:6.0f}"
              f"  best {row['gemv_best_GBps']:6.0f} {best[1]}")
        del weights
    if ns.result_file:
        with open(ns.result_file, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
