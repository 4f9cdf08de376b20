"""Decode attention's split count in the decode step (issue 10): the 8B-shaped model (dummy weights, triton, CUDA
graphs, PDL) with kernels.decode_attention's split-KV count chosen as usual (`auto`: enough programs to fill the
GPU, 64 at batch 1, of which a 512-token context fills 8) or fixed for every batch size, alternated in one process
(graphs captured again at each switch). Per batch size: the GPU time of a step and the first 8 greedy tokens of up
to 4 requests (a split count changes only how the same softmax terms are grouped, so tokens may differ only where
the dummy model's scores nearly tie).

    python -m radixmesh.benchmarks.splits_step [--batch-size 1 8] [--variants auto 1 16] [--rounds 2] [--result-file F]
"""

from __future__ import annotations

from radixmesh.benchmarks.profile_decode import ab_main
from radixmesh.engine.attention import triton_backend
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.kernels import decode_attention

VARIANTS = ("auto", "1", "2", "4", "8", "16", "32")


def _switch(runner: ModelRunner, variant: str) -> None:
    if variant == "auto":
        triton_backend.num_kv_splits = decode_attention.num_kv_splits
    else:
        splits = int(variant)
        triton_backend.num_kv_splits = lambda batch_size, num_kv_heads, device: splits


def main() -> None:
    ab_main(__doc__.split("\n")[0], _switch, "kv_splits", VARIANTS)


if __name__ == "__main__":
    main()
