"""Decode attention's keys and values pulled into L2 before its PDL wait (issue 10): the 8B-shaped model (dummy
weights, triton, CUDA graphs, PDL) with stage 1 of kernels.decode_attention prefetching its first block before it
waits for the kernel before, against the same kernel without the prefetch, alternated in one process (graphs
captured again at each switch). Per batch size: the GPU time of a step and the first 8 greedy tokens of up to 4
requests (which must not move: a prefetch changes no value).

    python -m radixmesh.benchmarks.prefetch_step [--batch-size 1 8 64] [--rounds 2] [--result-file F]
"""

from __future__ import annotations

from radixmesh.benchmarks.profile_decode import ab_main
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.kernels import decode_attention

VARIANTS = ("wait first", "prefetch")


def _switch(runner: ModelRunner, variant: str) -> None:
    decode_attention.PREFETCH_KV = variant == "prefetch"


def main() -> None:
    ab_main(__doc__.split("\n")[0], _switch, "kv_prefetch", VARIANTS)


if __name__ == "__main__":
    main()
