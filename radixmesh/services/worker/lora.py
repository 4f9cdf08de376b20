"""The worker's LoRA adapter RPCs (LoadLoraAdapter, UnloadLoraAdapter, ListLoraAdapters) over the engine's
load_lora_adapter / unload_lora_adapter / lora_adapters.

The engine knows its adapters by name; this keeps where each was read from (the --lora-paths given at start, then
every load and unload answered here), so that the router can list them as SGLang does and put one back. Engine
calls wait for the scheduler thread, so they run in the default executor, off the event loop. A load whose caller
is gone before it completes (cancelled, past its deadline: the router has then given up on it and undoes what the
others loaded) is unloaded again once it is done, so no worker keeps an adapter that the mesh as a whole refused."""

from __future__ import annotations

import asyncio
import logging

import grpc

from radixmesh.engine.engine import Engine
from radixmesh.engine.lora.config import parse_lora_paths
from radixmesh.v1 import worker_pb2

log = logging.getLogger(__name__)


class WorkerLora:
    def __init__(self, engine: Engine):
        self.engine = engine
        # name -> the directory it was loaded from; the engine's names are the truth, this only adds the paths
        self.paths: dict[str, str] = dict(parse_lora_paths(engine.args.lora_paths)) if engine.args.enable_lora \
            else {}

    def adapters(self) -> list[worker_pb2.LoraAdapter]:
        """The adapters loaded now, by name."""
        return [worker_pb2.LoraAdapter(lora_name=n, lora_path=self.paths.get(n, ""))
                for n in self.engine.lora_adapters()]

    def listing(self) -> worker_pb2.ListLoraAdaptersResponse:
        return worker_pb2.ListLoraAdaptersResponse(enabled=bool(self.engine.args.enable_lora),
                                                   adapters=self.adapters())

    async def load(self, request: worker_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
                   ) -> worker_pb2.LoadLoraAdapterResponse:
        """Loads the adapter; ValueError (INVALID_ARGUMENT) with the engine's reason when it cannot be."""
        name, path = request.lora_name, request.lora_path
        if not name or not path:
            raise ValueError("lora_name and lora_path are both required")
        if name in self.engine.lora_adapters():
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"a LoRA adapter named {name!r} is already loaded")
        loading = asyncio.get_running_loop().run_in_executor(None, self.engine.load_lora_adapter, name, path)
        try:
            await asyncio.shield(loading)
        except asyncio.CancelledError:
            loading.add_done_callback(lambda done: self._undo(name, done))
            raise
        if _caller_gone(context):  # gRPC does not always cancel a handler whose deadline passed
            self._undo(name, loading)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"LoRA adapter {name!r} loaded after the "
                                "caller's deadline; unloaded again")
        self.paths[name] = path
        return worker_pb2.LoadLoraAdapterResponse(adapters=self.adapters())

    def _undo(self, name: str, done: asyncio.Future) -> None:
        """Unload an adapter whose load completed after its caller left (a failed load left nothing to undo)."""
        if done.cancelled() or done.exception() is not None:
            return
        log.warning("the caller of LoRA adapter %s's load left before it completed; unloading it", name)
        undo = asyncio.get_running_loop().run_in_executor(None, self.engine.unload_lora_adapter, name)
        undo.add_done_callback(lambda u: _log_failed_undo(name, u))

    async def unload(self, request: worker_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
                     ) -> worker_pb2.UnloadLoraAdapterResponse:
        """Unloads the adapter; NOT_FOUND when it is not loaded, ValueError while requests use it."""
        name = request.lora_name
        if not name:
            raise ValueError("lora_name is required")
        if name not in self.engine.lora_adapters():
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no LoRA adapter named {name!r} is loaded")
        await asyncio.get_running_loop().run_in_executor(None, self.engine.unload_lora_adapter, name)
        path = self.paths.pop(name, "")
        return worker_pb2.UnloadLoraAdapterResponse(lora_path=path, adapters=self.adapters())


def _caller_gone(context: grpc.aio.ServicerContext) -> bool:
    """The call was cancelled or its deadline passed (its answer would reach no one)."""
    remaining = context.time_remaining()
    return context.cancelled() or (remaining is not None and remaining <= 0)


def _log_failed_undo(name: str, undo: asyncio.Future) -> None:
    if not undo.cancelled() and undo.exception() is not None:
        log.warning("could not unload LoRA adapter %s after its caller left: %s", name, undo.exception())
