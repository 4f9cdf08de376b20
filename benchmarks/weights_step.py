"""The next product's weights pulled into L2 while the small kernels before it run (issue 10): the 8B-shaped model
(dummy weights, triton, CUDA graphs, PDL) with each layer's o_proj weight prefetched by the copy engine right after
the qkv product (kernels.l2_prefetch, engine.layers.linear.PREFETCH_WEIGHTS), so that rotary, the KV store and decode
attention run while it streams, against the same step without it, alternated in one process (graphs captured again
at each switch). Per batch size: the GPU time of a step and the first 8 greedy tokens of up to 4 requests (which
must not move: a prefetch changes no value).

    python -m benchmarks.weights_step [--batch-size 1 8] [--rounds 2] [--result-file F]
"""

from __future__ import annotations

from benchmarks.profile_decode import ab_main
from engine.layers import linear
from engine.model_runner import ModelRunner

VARIANTS = ("none", "o_proj")


def _switch(runner: ModelRunner, variant: str) -> None:
    linear.PREFETCH_WEIGHTS = variant == "o_proj"


def main() -> None:
    ab_main(__doc__.split("\n")[0], _switch, "weight_prefetch", VARIANTS)


if __name__ == "__main__":
    main()
