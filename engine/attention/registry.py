"""Name -> backend class, imported on first use."""

from __future__ import annotations

import importlib

from engine.attention.base import AttentionBackend, AttentionShape

_BACKENDS = {
    "torch_native": "engine.attention.torch_native:TorchNativeBackend",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def create_backend(name: str, shape: AttentionShape, kv_pool, req_to_token) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; available: {', '.join(available_backends())}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(shape, kv_pool, req_to_token)
