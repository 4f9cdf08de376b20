"""Embedding engines (--is-embedding): how a prompt's final hidden states (after the final norm) become one vector.

Which pooling a checkpoint wants is read as sentence-transformers states it: `modules.json` lists a
`sentence_transformers.models.Pooling` module whose `config.json` (e.g. `1_Pooling/config.json`) sets
`pooling_mode_lasttoken` or `pooling_mode_mean_tokens`. A checkpoint that states nothing gets last-token pooling,
which is what SGLang applies to decoder-only embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral). The pooled
vector is always L2-normalised, as SGLang's pooler does for these models.

Last-token pooling reuses the prefix cache: a cached prefix's KV yields the same last-token state, and the cache
always leaves the last prompt token to compute. Mean pooling needs every token's state, so an engine that
mean-pools runs without the radix cache (engine.config.resolve_args); a chunked prompt's chunks add up.

`dimensions` (OpenAI's field; Matryoshka representation learning) keeps the first `dimensions` values and
normalises again. It is allowed where `config.json` says the model was trained for it, with the keys vLLM and
SGLang read: `matryoshka_dimensions` (the sizes allowed) or `is_matryoshka: true` (any size up to hidden_size).
"""

from __future__ import annotations

import enum
import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from radixmesh.engine.batch import ForwardBatch
    from radixmesh.engine.model_config import ModelConfig

_ST_POOLING = "sentence_transformers.models.Pooling"


class Pooling(enum.Enum):
    LAST = "last"  # the last prompt token's state
    MEAN = "mean"  # the mean over every prompt token's state


def _read_json(path: str) -> dict | list | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def pooling_of(model_path: str) -> Pooling:
    """The pooling the checkpoint's sentence-transformers files ask for (LAST when it has none). ValueError for a
    pooling mode this engine does not implement (cls, max, weighted mean)."""
    modules = _read_json(os.path.join(model_path, "modules.json")) or []
    entry = next((m for m in modules if isinstance(m, dict) and m.get("type") == _ST_POOLING), None)
    if entry is None:
        return Pooling.LAST
    cfg_path = os.path.join(model_path, entry.get("path", ""), "config.json")
    cfg = _read_json(cfg_path)
    if not isinstance(cfg, dict):
        raise ValueError(f"{model_path}: modules.json names a Pooling module but {cfg_path} is missing")
    modes = sorted(k.removeprefix("pooling_mode_") for k, v in cfg.items() if k.startswith("pooling_mode_") and v)
    if modes == ["lasttoken"]:
        return Pooling.LAST
    if modes == ["mean_tokens"]:
        return Pooling.MEAN
    raise ValueError(f"{cfg_path}: pooling mode(s) {modes} are not supported; supported: lasttoken, mean_tokens")


def pool(hidden: torch.Tensor, batch: ForwardBatch, kind: Pooling) -> torch.Tensor:
    """hidden [num_tokens, hidden] of one extend forward -> float32 [batch, hidden]: per request, the state of its
    last new token (LAST) or the sum of its new tokens' states (MEAN; the caller divides by the prompt length)."""
    import torch

    if kind is Pooling.LAST:
        return hidden[batch.logits_indices].float()
    segment = torch.repeat_interleave(torch.arange(batch.batch_size, device=hidden.device), batch.extend_lens,
                                      output_size=hidden.shape[0])
    out = torch.zeros(batch.batch_size, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, segment, hidden.float())


def check_dimensions(dimensions, model: ModelConfig) -> int | None:
    """`dimensions` validated against the model (None: the whole vector); ValueError names what is wrong."""
    if dimensions is None:
        return None
    if isinstance(dimensions, bool) or not isinstance(dimensions, int):
        raise ValueError(f"dimensions must be an integer, got {dimensions!r}")
    allowed = model.raw.get("matryoshka_dimensions")
    if not allowed and not model.raw.get("is_matryoshka"):
        raise ValueError("dimensions is not supported: this model does not support matryoshka representation "
                         "(its config.json has neither matryoshka_dimensions nor is_matryoshka)")
    if allowed and dimensions not in allowed:
        raise ValueError(f"dimensions must be one of {sorted(allowed)} for this model, got {dimensions}")
    if not 1 <= dimensions <= model.hidden_size:
        raise ValueError(f"dimensions must be between 1 and {model.hidden_size} (the model's hidden size), "
                         f"got {dimensions}")
    return dimensions
