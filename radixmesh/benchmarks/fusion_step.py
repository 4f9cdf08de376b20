"""Rotary and the KV store in one kernel inside the decode step (issue 10): the 8B-shaped model (dummy weights,
triton or --attention-backend flashinfer, CUDA graphs) with decode's rotary and KV store fused (kernels.rotary.rotary_store_kv, the default) against the
two kernels one after the other, alternated in one process (graphs captured again at each switch). Per batch size:
the GPU time of a step (benchmarks.profile_decode's measure) and the first 8 greedy tokens of up to 4 requests
(which must not move: the fused kernel is bit for bit the two).

    python -m radixmesh.benchmarks.fusion_step [--attention-backend flashinfer] [--batch-size 1 8 64] [--rounds 2]
                                     [--result-file F]
"""

from __future__ import annotations

from radixmesh.benchmarks.profile_decode import ab_main
from radixmesh.engine.attention.flashinfer_backend import FlashInferBackend
from radixmesh.engine.attention.triton_backend import TritonBackend
from radixmesh.engine.model_runner import ModelRunner

VARIANTS = ("separate", "fused")


def _switch(runner: ModelRunner, variant: str) -> None:
    for backend in (TritonBackend, FlashInferBackend):
        backend.fuses_rope_store = variant == "fused"


def main() -> None:
    ab_main(__doc__.split("\n")[0], _switch, "rope_store", VARIANTS)


if __name__ == "__main__":
    main()
