"""What the router knows of one worker's LoRA adapters, as the worker itself reported them.

A worker's adapters are what it answered last: ListLoraAdapters when it is added and at every poll
(services/router/lora_directory.py), and the adapters a LoadLoraAdapter or UnloadLoraAdapter call of the router's
answered with (with --router-workers N, also the changes a sibling process made: `applied`). A poll that was asked
before the router changed the worker's adapters answers with the state before the change; `epoch` counts the
router's changes (and lost connections), and a poll's answer is only taken when none happened while it was on its
way.

A worker is `synced` once the router has brought it in line with the mesh's run-time changes
(services/router/lora_sync.py); until then, and from the moment its connection is lost (the process may come back
as a new one, with only its --lora-paths adapters), no request for an adapter is routed to it."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc

from radixmesh.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoraState:
    enabled: bool = False  # the worker serves LoRA adapters (--enable-lora)
    adapters: dict[str, str] = field(default_factory=dict)  # name -> the directory it was loaded from ("": unknown)
    epoch: int = 0  # changes the router made (load/unload answers); a poll sent before one of them is stale
    synced: bool = False  # its adapters are the mesh's run-time changes applied (lora_sync.LoraSync.resync)
    generation: int = 0  # connections lost so far: a resync begun before the latest loss does not count
    refused: dict[str, str] = field(default_factory=dict)  # run-time adapter -> why it could not be loaded again

    def changed(self, adapters) -> None:
        """The adapters a load or unload call answered with (LoraAdapter messages)."""
        self.adapters = as_dict(adapters)
        self.enabled = True
        self.epoch += 1

    def applied(self, name: str, path: str | None) -> None:
        """A change made on the worker by another router process (services/router/lora_peers.py), or found made
        (a load answered ALREADY_EXISTS, an unload NOT_FOUND): adapter `name` loaded from `path`, or unloaded
        (None)."""
        if path is None:
            self.adapters.pop(name, None)
        else:
            self.adapters[name] = path
            self.enabled = True
        self.epoch += 1

    def lost(self) -> None:
        """The connection to the worker broke: what it has loaded is unknown until the next resync."""
        self.synced = False
        self.generation += 1
        self.epoch += 1
        self.refused.clear()

    def polled(self, response: worker_pb2.ListLoraAdaptersResponse, epoch: int) -> None:
        """A ListLoraAdapters answer to a call sent when the state's epoch was `epoch` (ignored if it moved on)."""
        if epoch == self.epoch:
            self.enabled, self.adapters = response.enabled, as_dict(response.adapters)


def as_dict(adapters) -> dict[str, str]:
    return {a.lora_name: a.lora_path for a in adapters}


async def poll(stub: worker_pb2_grpc.WorkerServiceStub, state: LoraState, timeout_s: float) -> bool:
    """Ask the worker which adapters it has loaded and take its answer into `state`; whether it answered. A worker
    that does not know the RPC serves no adapters; another failure leaves `state` as it was (the next poll asks
    again)."""
    epoch = state.epoch
    try:
        response = await stub.ListLoraAdapters(worker_pb2.ListLoraAdaptersRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.UNIMPLEMENTED:
            log.debug("ListLoraAdapters failed: %s %s", e.code().name, e.details())
            return False
        response = worker_pb2.ListLoraAdaptersResponse()
    state.polled(response, epoch)
    return True
