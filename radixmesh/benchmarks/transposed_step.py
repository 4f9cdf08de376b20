"""The lead of benchmarks.gemv_layouts measured inside the decode step (issue 10): the same 8B-shaped model (dummy
weights, triton, CUDA graphs) with o_proj, down_proj and the LM head computing `x @ w_t` from a transposed copy of
their weights, against the model as it is, alternated in one process (graphs captured again at each switch). Per
batch size: the GPU time of a step (benchmarks.profile_decode's measure), and the first 8 greedy tokens of each
request from both layouts (bf16 rounding may differ).

    python -m radixmesh.benchmarks.transposed_step [--batch-size 1 8 64] [--rounds 2] [--result-file F]
"""

from __future__ import annotations

from radixmesh.benchmarks.profile_decode import ab_main
from radixmesh.engine.model_runner import ModelRunner


def _switch(runner: ModelRunner, transposed: bool) -> None:
    model = runner.model
    for layer in model.model.layers:
        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
            if transposed:
                lin.weight_t = lin.weight.t().contiguous()
                lin.forward = lambda x, lin=lin: x @ lin.weight_t
            else:
                lin.__dict__.pop("forward", None)
                lin.__dict__.pop("weight_t", None)
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    if transposed:
        head_t = head.t().contiguous()
        model.compute_logits = lambda hidden: (hidden @ head_t).float()
    else:
        model.__dict__.pop("compute_logits", None)


def main() -> None:
    ab_main(__doc__.split("\n")[0], _switch, "transposed")


if __name__ == "__main__":
    main()
