"""The router's public gRPC ListModels lists what /v1/models lists: the served model's card, then each loaded LoRA
adapter's (by name, its directory as root, the served model as parent); nothing before any worker answered. Against
the real servicer over a registry whose workers report adapters (a worker's LoraState, as its polls fill it); the
mesh end to end: tests/e2e/test_lora_mesh.py."""

from __future__ import annotations

from types import SimpleNamespace

import grpc

from radixmesh.v1 import router_pb2, worker_pb2
from radixmesh.services.router.grpc_api import RouterServicer
from radixmesh.services.router.lora_directory import LoraDirectory
from radixmesh.services.router.lora_state import LoraState
from radixmesh.services.router.tenants import TenantResolver


class Registry:
    def __init__(self):
        self.workers = {}
        self.on_add = None

    def any_info(self):
        return next((w.info for w in self.workers.values()), None)


def worker(url: str, adapters: dict[str, str]):
    info = worker_pb2.GetModelInfoResponse(model_path="/models/llama", served_model_name="llama",
                                           max_context_length=4096)
    return SimpleNamespace(url=url, info=info, lora=LoraState(enabled=True, adapters=adapters, synced=True))


class Context:
    def invocation_metadata(self):
        return ()

    async def abort(self, code: grpc.StatusCode, message: str):
        raise AssertionError(f"aborted: {code} {message}")


class Router:
    """The parts of services.router.core.Router that RouterServicer.ListModels reads."""

    def __init__(self, registry: Registry):
        self.registry = registry
        self.lora = LoraDirectory(registry, 1.0)
        self.tenants = TenantResolver()
        self.model_name = "llama"

    @property
    def served_models(self) -> tuple[str, ...]:
        return ("llama",) if self.registry.workers else ()


async def test_list_models_lists_the_adapters_as_v1_models_does():
    registry = Registry()
    api = RouterServicer(Router(registry))
    assert await api.ListModels(router_pb2.ListModelsRequest(), Context()) == router_pb2.ListModelsResponse()
    registry.workers = {"a:1": worker("a:1", {"sql": "/ad/sql", "chat": "/ad/chat"}),
                        "b:2": worker("b:2", {"sql": "/ad/sql"})}
    answer = await api.ListModels(router_pb2.ListModelsRequest(), Context())
    assert list(answer.models) == ["llama", "chat", "sql"]
    assert [(c.id, c.root, c.parent, c.max_model_len) for c in answer.cards] == [
        ("llama", "/models/llama", "", 4096), ("chat", "/ad/chat", "llama", 0), ("sql", "/ad/sql", "llama", 0)]
    api.router.lora.intent.did_unload("chat")  # unloaded at run time: gone from the list, whatever a worker reports
    assert list((await api.ListModels(router_pb2.ListModelsRequest(), Context())).models) == ["llama", "sql"]
