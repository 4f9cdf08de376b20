"""Model implementations behind a registry keyed by `config.json` architectures."""

from radixmesh.engine.models.registry import model_class, supported_architectures

__all__ = ["model_class", "supported_architectures"]
