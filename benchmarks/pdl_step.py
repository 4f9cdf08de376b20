"""Programmatic dependent launch inside the decode step (issue 10): the 8B-shaped model (dummy weights, triton, CUDA
graphs) with the kernels launched as programmatic dependents and decode-sized products on kernels.gemv, against the
same model with --disable-pdl (every kernel waits for the one before; cuBLAS products), alternated in one process
(graphs captured again at each switch). Per batch size: the GPU time of a step (benchmarks.profile_decode's measure)
and the first 8 greedy tokens of up to 4 requests (the products round differently).

    python -m benchmarks.pdl_step [--batch-size 1 8 64] [--rounds 2] [--result-file F]
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.profile_decode import ab_rounds, decode_runner
from engine.model_runner import ModelRunner
from kernels.runtime import pdl_supported, use_pdl


def _switch(runner: ModelRunner, pdl: bool) -> None:
    use_pdl(pdl)
    torch.cuda.empty_cache()
    runner.graphs.capture()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default="benchmarks/configs/llama-3.1-8b")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--result-file")
    ns = p.parse_args()
    print(f"pdl supported: {pdl_supported()}")
    runner, cache = decode_runner(ns.model_path, "triton", ns.batch_size, ns.input_len, mem_fraction_static=0.7,
                                  cuda_graph_bs=tuple(ns.batch_size))
    rows = ab_rounds(runner, cache, _switch, (False, True), ns.batch_size, ns.input_len, ns.rounds)
    for row in rows:
        row["pdl"] = row.pop("variant")
        row["device"] = torch.cuda.get_device_name()
    if ns.result_file:
        with open(ns.result_file, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
