"""Attention backends behind a registry (imported lazily, so `import engine` needs no GPU library)."""

from radixmesh.engine.attention.registry import available_backends, create_backend

__all__ = ["available_backends", "create_backend"]
