"""Shared fixtures: the bundled tiny models (built by `make model`) and a transformers reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
TINY_MODELS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")


def _ensure_models() -> None:
    if all((MODELS / m / "config.json").is_file() for m in TINY_MODELS):
        return
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_models.py"), "--out", str(MODELS)],
                   check=True)


@pytest.fixture(scope="session")
def models_dir() -> Path:
    _ensure_models()
    return MODELS


def model_path(name: str) -> str:
    _ensure_models()
    return str(MODELS / name)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
