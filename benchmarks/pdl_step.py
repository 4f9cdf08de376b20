"""Programmatic dependent launch inside the decode step (issue 10): the 8B-shaped model (dummy weights, triton, CUDA
graphs) with the kernels launched as programmatic dependents and decode-sized products on kernels.gemv, against the
same model with --disable-pdl (every kernel waits for the one before; cuBLAS products), with PDL but cuBLAS
products, and with PDL and each weight shape on the kernel --decode-gemm auto chose for it, alternated in one process
(graphs captured again at each switch). Per batch size: the GPU time of a step (benchmarks.profile_decode's measure)
and the first 8 greedy tokens of up to 4 requests (the products round differently).

    python -m benchmarks.pdl_step [--batch-size 1 8 64] [--rounds 2] [--result-file F]
"""

from __future__ import annotations

from benchmarks.profile_decode import ab_main
from engine.decode_products import _weights, plan
from engine.model_runner import ModelRunner
from kernels.gemv import ROW_CONFIG
from kernels.runtime import pdl_supported, use_pdl


# --disable-pdl; PDL with cuBLAS products; PDL with kernels.gemv for all; PDL with the per-shape plan of
# engine.decode_products (--decode-gemm auto's choice, timed once here), and that plan with one shape's tiles
# overridden (what the plan's same-shape timing may misjudge inside the step, where a product follows a norm,
# attention or SiLU-and-mul)
OVERRIDES = {"pdl+plan+qkv16": ((6144, 4096), (16, 512, 2, 4, 2048)),
             "pdl+plan+qkv32": ((6144, 4096), (32, 512, 4, 4, 2048)),
             "pdl+plan+gate_up": ((28672, 4096), (16, 128, 4, 8, 1024)),
             "pdl+plan+head": ((128256, 4096), (16, 128, 4, 8, 1024)),
             "pdl+plan+gate_up32": ((28672, 4096), (32, 512, 4, 4, 2048)),
             "pdl+plan+head32": ((128256, 4096), (32, 512, 4, 4, 2048))}
# every shape on kernels.gemv with the 32-row tiles (the products chained alone beat cuBLAS's chain with them on an
# H200, 2026-11-29: 4.106 against 4.218 ms)
ALL32 = (32, 512, 4, 4, 2048)
# the plan with its one-row products on kernels.gemv.gemv_row where it won (--decode-gemm auto since 2026-11-29;
# "pdl+plan" is the plan without them), and every shape's one-row products on gemv_row's default tiles
VARIANTS = ("off", "pdl", "pdl+gemv", "pdl+plan", *OVERRIDES, "pdl+all32", "pdl+plan+rows", "pdl+plan+allrows")
_plans: dict = {}


def _switch(runner: ModelRunner, variant: str) -> None:
    if variant == "pdl+all32":
        shapes = {tuple(w.shape) for w in _weights(runner.model)}
        use_pdl(True, gemv={(n, k): (ALL32[0], min(ALL32[1], 1 << (k - 1).bit_length()), *ALL32[2:4],
                                     min(ALL32[4], 1 << (k - 1).bit_length())) for n, k in shapes})
        return
    if variant.startswith("pdl+plan"):
        if "plan" not in _plans:
            _plans["plan"], _plans["rows"] = plan(runner.model, runner.device, runner.dtype)
            print(f"per-shape plan: {_plans['plan']}; one-row products on gemv_row: {_plans['rows']}")
        chosen = dict(_plans["plan"])
        if variant in OVERRIDES:
            shape, tiles = OVERRIDES[variant]
            chosen[shape] = tiles
        rows = {}
        if variant == "pdl+plan+rows":
            rows = _plans["rows"]
        elif variant == "pdl+plan+allrows":
            rows = {tuple(w.shape): ROW_CONFIG for w in _weights(runner.model)}
        use_pdl(True, gemv=chosen, row=rows)
        return
    use_pdl(variant != "off", gemv=variant == "pdl+gemv")


def main() -> None:
    print(f"pdl supported: {pdl_supported()}")
    ab_main(__doc__.split("\n")[0], _switch, "pdl", VARIANTS)


if __name__ == "__main__":
    main()
