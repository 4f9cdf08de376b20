"""Does a weight pulled into L2 make the batch-1 product that reads it faster (issue 10)? On the GPU: for each
8B-shaped projection, the GEMV's time with L2 flushed, then right after `kernels.l2_prefetch.pull_into_l2`, and the
pull's own time and bandwidth, per mode and program count.

    python -m benchmarks.l2_prefetch [--result-file F]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from kernels.l2_prefetch import pull_into_l2

SHAPES = {"o_proj": (4096, 4096), "qkv": (6144, 4096), "down": (4096, 14336), "gate_up_part": (2560, 4096)}


def _time(fn, flush, before=None, reps: int = 30) -> float:
    times = []
    for _ in range(reps):
        flush.add_(1)  # 256 MiB through L2: nothing of the weight stays
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--result-file")
    ns = parser.parse_args()
    dev = torch.device("cuda")
    flush = torch.zeros(64 * 2**20, dtype=torch.float32, device=dev)
    rows = []
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(out_f, in_f, dtype=torch.bfloat16, device=dev)
        x = torch.randn(1, in_f, dtype=torch.bfloat16, device=dev)
        mb = w.numel() * 2 / 1e6
        cold = _time(lambda: F.linear(x, w), flush)
        row = {"weight": name, "MB": mb, "gemv_cold_us": cold, "gemv_cold_GBps": mb / cold * 1e3}
        for mode in ("load", "hint"):
            for programs in (16, 32, 132, 528, 1024):
                sums = torch.empty(programs, dtype=torch.float32, device=dev)
                pull = _time(lambda: pull_into_l2(w, sums, mode), flush)
                warm = _time(lambda: F.linear(x, w), flush, before=lambda: pull_into_l2(w, sums, mode))
                row[f"{mode}{programs}"] = {"pull_us": pull, "pull_GBps": mb / pull * 1e3, "gemv_after_us": warm}
        rows.append(row)
        print(json.dumps(row))
    if ns.result_file:
        with open(ns.result_file, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
