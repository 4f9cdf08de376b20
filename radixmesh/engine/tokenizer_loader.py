"""Load a model's tokenizer: `transformers.AutoTokenizer`, without its most expensive step where that step decides
nothing.

AutoTokenizer reads the model's config to choose the tokenizer class, and reading it imports the model's config
module; for some families (Llama among them) that module pulls in transformers' activations, its hub-kernel and
weight-loading integrations and `torch.distributed.tensor` (sympy), ~1.2 s of CPU in every process that loads a
tokenizer (the tokenizer service and each worker). The choice itself only reads the config's model type (and its
tokenizer class and model name, where it has them) as long as the tokenizer config names its class and nothing
involves remote code. In that case we hand AutoTokenizer a plain config carrying just those fields; in every other
case AutoTokenizer reads the config itself. The class it picks, and so the tokenizer, is the same either way
(tests/unit/test_tokenizer_loader.py compares them for every bundled model).
"""

from __future__ import annotations

import json
import os

from radixmesh.engine.model_source import resolve_model_dir


def load_tokenizer(path: str, trust_remote_code: bool = False, revision: str | None = None):
    """The tokenizer at `path`: a folder, or a Hugging Face model id in the local cache at `revision`
    (engine.model_source)."""
    from transformers import AutoTokenizer

    path = resolve_model_dir(path, revision)
    config = _plain_config(path)
    if config is None:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return AutoTokenizer.from_pretrained(path, config=config, trust_remote_code=trust_remote_code)


def _plain_config(path: str):
    """A bare PreTrainedConfig with the fields AutoTokenizer's class choice reads, or None where the choice could
    read more (no local files, no tokenizer class named, remote code, a config without a model type)."""
    model, tokenizer = _read_json(os.path.join(path, "config.json")), _read_json(
        os.path.join(path, "tokenizer_config.json"))
    if (model is None or tokenizer is None or not tokenizer.get("tokenizer_class") or not model.get("model_type")
            or "auto_map" in tokenizer or "auto_map" in model):
        return None
    from transformers import PreTrainedConfig

    config = PreTrainedConfig()
    config.model_type = model["model_type"]
    config._name_or_path = str(path)
    for key in ("tokenizer_class", "model_name"):
        if key in model:
            setattr(config, key, model[key])
    return config


def _read_json(file: str) -> dict | None:
    try:
        with open(file, encoding="utf-8") as f:
            out = json.load(f)
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None
