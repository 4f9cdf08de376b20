"""Decode attention's split count in the decode step (issue 10): the 8B-shaped model (dummy weights, triton, CUDA
graphs, PDL) with kernels.decode_attention's split-KV count chosen as usual (`auto`: enough programs to fill the
GPU, 64 at batch 1, of which a 512-token context fills 8) or fixed for every batch size, alternated in one process
(graphs captured again at each switch). A `+merge` variant has stage 1's last split merge the splits instead of
stage 2 (kernels.decode_attention.FUSED_MERGE: one kernel fewer a layer). Per batch size: the GPU time of a step and
the first 8 greedy tokens of up to 4 requests (a split count changes only how the same softmax terms are grouped,
so tokens may differ only where the dummy model's scores nearly tie; the fused merge changes nothing but where the
merge runs).

    python -m benchmarks.splits_step [--batch-size 1 8] [--variants auto auto+merge 1] [--rounds 2] [--result-file F]
"""

from __future__ import annotations

from benchmarks.profile_decode import ab_main
from engine.attention import triton_backend
from engine.model_runner import ModelRunner
from kernels import decode_attention

VARIANTS = ("auto", "auto+merge", "1", "2", "4", "8", "8+merge", "16")


def _switch(runner: ModelRunner, variant: str) -> None:
    count, merge = variant.split("+")[0], variant.endswith("+merge")
    decode_attention.FUSED_MERGE = merge
    if count == "auto":
        triton_backend.num_kv_splits = decode_attention.num_kv_splits
    else:
        splits = int(count)
        triton_backend.num_kv_splits = lambda batch_size, num_kv_heads, device: splits


def main() -> None:
    ab_main(__doc__.split("\n")[0], _switch, "kv_splits", VARIANTS)


if __name__ == "__main__":
    main()
