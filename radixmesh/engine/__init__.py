"""radixmesh's inference core: a pure library (torch; no gRPC, protobuf or aiohttp).

    from radixmesh.engine import Engine
    llm = Engine(model_path="models/tiny-qwen2")

`Engine` is imported on first use, so light modules (radixmesh.engine.config, .model_config) load without torch.
"""

__all__ = ["Engine"]


def __getattr__(name: str):
    if name == "Engine":
        from radixmesh.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'radixmesh.engine' has no attribute {name!r}")
