"""Loads moved before the PDL wait (issue 10): the 8B-shaped model (dummy weights, triton, CUDA graphs, PDL) with
stage 1 of kernels.decode_attention loading its first block of keys and values before it waits for the kernel before
(`kv`), kernels.gemv loading its first tile of weights before it waits (`w`), both, and neither (`wait first`),
alternated in one process (graphs captured again at each switch). Per batch size: the GPU time of a step and the
first 8 greedy tokens of up to 4 requests (which must not move: the same terms are summed in the same order).

    python -m benchmarks.preload_step [--batch-size 1 8 64] [--rounds 2] [--decode-gemm gemv] [--result-file F]
"""

from __future__ import annotations

from benchmarks.profile_decode import ab_main
from engine.model_runner import ModelRunner
from kernels import decode_attention, gemv

VARIANTS = ("wait first", "kv", "w", "kv+w")


def _switch(runner: ModelRunner, variant: str) -> None:
    decode_attention.PRELOAD_KV = variant in ("kv", "kv+w")
    gemv.PRELOAD_W = variant in ("w", "kv+w")


def main() -> None:
    ab_main(__doc__.split("\n")[0], _switch, "preload", VARIANTS)


if __name__ == "__main__":
    main()
