"""An internal channel (services.common.server.channel: router -> workers, decode -> prefill bootstrap) finds a peer
that the supervisor restarted on the same port within about a second. gRPC's default reconnect backoff grows towards
120 s, and a decode worker's cached channel to a restarted prefill worker kept failing fast with "Connection
refused" for seconds after the new process listened (seen in the PD chaos test)."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from radixmesh.services.common.server import channel
from radixmesh.services.launch import free_port


async def _server(port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    await server.start()
    return server


async def _check(stub) -> bool:
    try:
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
        return True
    except grpc.aio.AioRpcError:
        return False


def test_a_restarted_peer_is_reached_again_within_a_second():
    async def run() -> float:
        port = free_port()
        server = await _server(port)
        ch = channel(f"127.0.0.1:{port}")
        stub = health_pb2_grpc.HealthStub(ch)
        assert await _check(stub)
        await server.stop(None)
        assert not await _check(stub)  # a connection attempt is refused: the channel backs off from now
        server = await _server(port)
        back = time.monotonic()
        while not await _check(stub):
            await asyncio.sleep(0.02)
        took = time.monotonic() - back
        await ch.close()
        await server.stop(None)
        return took
    # the next attempt comes after the first backoff: 0.2 s here, 1 s (+-20 %) with gRPC's defaults
    assert asyncio.run(run()) < 0.6
