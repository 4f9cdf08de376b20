"""Where a decode step's time beyond its products goes (issue 10), by ablation: the 8B-shaped model (dummy weights,
CUDA graphs, PDL as configured) with parts of the step replaced by free stand-ins, alternated in one process (graphs
captured again at each switch). The step a variant times is not a model any more (its tokens are noise); what it
gives is an upper bound on what making that part free could buy:

- `full`: the step as it is;
- `-attention`: rotary, the KV store and attention gone (the attention output is the query itself);
- `-norms`: every RMSNorm (and its residual add) gone (x passes through);
- `-silu`: SiLU-and-mul gone (the down product reads the gate half as it is);
- `products`: all three gone: embedding, the products, the LM head and sampling are what is left.

    python -m radixmesh.benchmarks.ablate_step [--attention-backend triton] [--batch-size 1 8] [--rounds 2] \
        [--result-file F]
"""

from __future__ import annotations

import torch

from radixmesh.benchmarks.profile_decode import ab_main
from radixmesh.engine import forward_context
from radixmesh.engine.layers.norm import RMSNorm
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.engine.models import llama

VARIANTS = ("full", "-attention", "-norms", "-silu", "products")
_ORIGINAL = {"attend": forward_context.ForwardContext.attend, "norm": RMSNorm.forward, "silu": llama.silu_and_mul}


def _no_attention(self, layer_id, q, k, v, rope=None):
    return q


def _no_norm(self, x, residual=None):
    return x if residual is None else (x, residual)


def _no_silu(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up[:, : gate_up.shape[1] // 2]


def _switch(runner: ModelRunner, variant: str) -> None:
    gone = {"-attention": {"attend"}, "-norms": {"norm"}, "-silu": {"silu"},
            "products": {"attend", "norm", "silu"}}.get(variant, set())
    forward_context.ForwardContext.attend = _no_attention if "attend" in gone else _ORIGINAL["attend"]
    RMSNorm.forward = _no_norm if "norm" in gone else _ORIGINAL["norm"]
    llama.silu_and_mul = _no_silu if "silu" in gone else _ORIGINAL["silu"]


def main() -> None:
    ab_main(__doc__.split("\n")[0], _switch, "ablation", VARIANTS)


if __name__ == "__main__":
    main()
