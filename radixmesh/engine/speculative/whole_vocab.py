"""The target's embedding and output layer whole, for an EAGLE head on the leader of a tensor-parallel engine.

A speculative draft runs on the leader alone, unsharded (engine.speculative.setup): only the leader samples, so only
it needs the drafts, and the other ranks see them as the verify's input tokens. An EAGLE head uses the target's
embedding (and, EAGLE-1, its output layer), which under tensor parallelism each rank holds a share of, and using a
share is a collective the other ranks do not join. So the leader's head reads whole copies from the target's
checkpoint (random ones with --load-format dummy, whose target is random too), computing what the target's layers
compute alone: a lookup, and the plain product (a target that scales or caps its logits is refused).
"""

from __future__ import annotations

import torch
from torch import nn

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.layers.linear import VocabParallelEmbedding, vocab_logits
from radixmesh.engine.models.llama import LlamaForCausalLM
from radixmesh.engine.models.loader import checkpoint_files, iter_checkpoint

_EMBEDDING = ("model.embed_tokens.weight", "embed_tokens.weight")
_OUTPUT = ("lm_head.weight",)
_FLOATS = ("F32", "F16", "BF16")


class _Body(nn.Module):
    pass


class WholeVocab(nn.Module):
    """Stands in for the target where the head calls it: `model.embed_tokens(ids)`, `compute_logits(hidden)` (with
    `logits`), `config`."""

    def __init__(self, target: nn.Module, logits: bool):
        super().__init__()
        cfg = target.config
        if logits and type(target).compute_logits is not LlamaForCausalLM.compute_logits:
            raise ValueError(f"speculative_algorithm EAGLE with tensor parallelism computes the head's logits on the "
                             f"leader from a whole copy of the target's output layer, and {cfg.architecture} "
                             "transforms its logits beyond that product: use tp_size 1, or an EAGLE3 head (its own "
                             "output layer)")
        like = target.model.embed_tokens.weight
        single = TensorParallel.single()
        self.config = cfg
        self.model = _Body()
        with torch.device("meta"):  # (its weight is set below)
            self.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, single)
        wanted = {"embedding": _EMBEDDING}
        if logits and not cfg.tie_word_embeddings:
            wanted["output"] = _OUTPUT
        found = _read(cfg, wanted, like.dtype)
        self.model.embed_tokens.weight = nn.Parameter(_or_random(found.get("embedding"), cfg, like), False)
        self.output = None  # [vocab, hidden] (EAGLE-1's logits)
        if logits:
            self.output = self.model.embed_tokens.weight if cfg.tie_word_embeddings else \
                nn.Parameter(_or_random(found.get("output"), cfg, like), False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return vocab_logits(TensorParallel.single(), hidden, self.output, self.config.vocab_size)


def _read(cfg, wanted: dict[str, tuple[str, ...]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint tensors named in `wanted` (kind -> names), as `dtype` on the host; {} without weight files (a
    dummy target)."""
    try:
        checkpoint_files(cfg.path)
    except FileNotFoundError:
        return {}
    kinds = {name: kind for kind, names in wanted.items() for name in names}
    out = {}
    for name, lazy in iter_checkpoint(cfg.path):
        kind = kinds.get(name)
        if kind is None or kind in out:
            continue
        if lazy.get_dtype() not in _FLOATS:
            raise ValueError(f"{name} in {cfg.path} is stored as {lazy.get_dtype()}: an EAGLE head under tensor "
                             f"parallelism reads it whole, as one of {', '.join(_FLOATS)}")
        out[kind] = lazy[:cfg.vocab_size].to(dtype)
    missing = [kind for kind in wanted if kind not in out]
    if missing:
        raise ValueError(f"the target checkpoint {cfg.path} has no {' or '.join(wanted[missing[0]])}, which an EAGLE "
                         "head under tensor parallelism reads whole")
    return out


def _or_random(weight: torch.Tensor | None, cfg, like: torch.Tensor) -> torch.Tensor:
    """`weight` on the target's device, or (a dummy target) small uniform values as the loader's dummy weights."""
    if weight is not None:
        return weight.to(like.device)
    out = torch.empty((cfg.vocab_size, cfg.hidden_size), dtype=like.dtype, device=like.device)
    return out.uniform_(-0.02, 0.02)
