"""Programmatic dependent launch inside the decode step (issue 10): the 8B-shaped model (dummy weights, triton, CUDA
graphs) with the kernels launched as programmatic dependents and decode-sized products on kernels.gemv, against the
same model with --disable-pdl (every kernel waits for the one before; cuBLAS products), with PDL but cuBLAS
products, and with PDL and each weight shape on the kernel --decode-gemm auto chose for it, alternated in one process
(graphs captured again at each switch). Per batch size: the GPU time of a step (benchmarks.profile_decode's measure)
and the first 8 greedy tokens of up to 4 requests (the products round differently).

    python -m radixmesh.benchmarks.pdl_step [--batch-size 1 8 64] [--rounds 2] [--result-file F]
"""

from __future__ import annotations

from radixmesh.benchmarks.profile_decode import ab_main
from radixmesh.engine.decode_products import _weights, plan
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.kernels.gemv import ROW_PDL, ROW_PDL_PREFETCH, ROW_PLAIN
from radixmesh.kernels.runtime import pdl_supported, use_pdl


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
# "pdl+plan" is the plan as --decode-gemm auto makes it, one-row products on kernels.gemv.gemv_row (since
# 2026-11-29); "-norows" without them (the auto of before), "-plain" / "-prefetch" with gemv_row in its other PDL
# modes, "-4w8", "-1w4", "-2k512", ... with other tiles (rows, warps, columns a load)
ROW_VARIANTS = {"pdl+plan-norows": None, "pdl+plan-plain": (2, 2048, 4, ROW_PLAIN),
                "pdl+plan-prefetch": (2, 2048, 4, ROW_PDL_PREFETCH), "pdl+plan-2k1024": (2, 1024, 4, ROW_PDL), "pdl+plan-4w8": (4, 1024, 8, ROW_PDL),
                "pdl+plan-8w4": (8, 1024, 4, ROW_PDL), "pdl+plan-4w4": (4, 1024, 4, ROW_PDL),
                "pdl+plan-1w4": (1, 1024, 4, ROW_PDL), "pdl+plan-2w2": (2, 1024, 2, ROW_PDL),
                "pdl+plan-2k512": (2, 512, 4, ROW_PDL), "pdl+plan-2k2048": (2, 2048, 4, ROW_PDL),
                "pdl+plan-2k4096": (2, 4096, 4, ROW_PDL), "pdl+plan-2k2048w8": (2, 2048, 8, ROW_PDL),
                "pdl+plan-1k2048w2": (1, 2048, 2, ROW_PDL)}
VARIANTS = ("off", "pdl", "pdl+gemv", "pdl+plan", *OVERRIDES, "pdl+all32", *ROW_VARIANTS)
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
        rows = dict(_plans["rows"])
        if variant in ROW_VARIANTS:
            rows = {} if ROW_VARIANTS[variant] is None else {shape: ROW_VARIANTS[variant] for shape in rows}
        use_pdl(True, gemv=chosen, row=rows)
        return
    use_pdl(variant != "off", gemv=variant == "pdl+gemv")


def main() -> None:
    print(f"pdl supported: {pdl_supported()}")
    ab_main(__doc__.split("\n")[0], _switch, "pdl", VARIANTS)


if __name__ == "__main__":
    main()
