"""radixmesh's inference core: a pure library (torch; no gRPC, protobuf or aiohttp).

    from engine import Engine
    llm = Engine(model_path="models/tiny-qwen2")
"""

from engine.engine import Engine

__all__ = ["Engine"]
