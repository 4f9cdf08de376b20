"""Which cuBLAS path reads a batch-1 projection's weight fastest (issue 10)? For each 8B-shaped projection: the same
product through F.linear (weight [out, in], what the model runs), torch.mv, and a weight stored transposed
([in, out], x @ w), at batch 1 and 8. Weights rotate through copies larger than L2, so every call streams from HBM,
as in a decode step, and calls run back to back (launch latency hidden, as in graph replay). Reports GB/s of weight
read (the step's floor counts those bytes).

    python -m radixmesh.benchmarks.gemv_layouts [--result-file F]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def _time(fn, copies: int, reps: int = 200) -> float:
    """Microseconds per call of `reps` calls back to back (each on the next copy), as kernels follow each other in
    a captured decode step; the median of 5 such runs."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for r in range(reps):
            fn(r % copies)
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(runs)


def _variants(x: torch.Tensor, ws: list, wts: list) -> dict:
    out = {"linear": lambda i: F.linear(x, ws[i]), "x@wT_stored": lambda i: x @ wts[i]}
    if x.shape[0] == 1:
        out["mv"] = lambda i: torch.mv(ws[i], x[0])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--result-file")
    ns = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for name, (out_f, in_f) in SHAPES.items():
        mb = out_f * in_f * 2 / 1e6
        copies = max(2, int(400 // mb) + 1)  # > 400 MB in all: none stays in the 50 MB L2
        ws = [torch.randn(out_f, in_f, dtype=dt, device=dev) for _ in range(copies)]
        wts = [w.t().contiguous() for w in ws]
        for bs in (1, 8):
            x = torch.randn(bs, in_f, dtype=dt, device=dev)
            variants = _variants(x, ws, wts)
            row = {"weight": name, "MB": round(mb, 1), "batch": bs}
            for label, fn in variants.items():
                us = _time(fn, copies)
                row[label] = {"us": round(us, 2), "GBps": round(mb / us * 1e3)}
            rows.append(row)
            print(json.dumps(row))
        ws = wts = None
        torch.cuda.empty_cache()
    if ns.result_file:
        with open(ns.result_file, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
