"""What one message costs the router's process on its hot stream, by transport (issue 13): a gRPC aio bidirectional
stream (WorkerService.GenerateStream, as services/router/mux.py uses it) against a plain asyncio TCP connection
carrying the same serialized protobuf messages in length-prefixed frames. Each of `--inflight` client tasks sends a
GenerateStreamRequest and waits for the GenerateStreamResponse (one step's chunk) that answers it, in a loop; the
client's CPU (every thread of its process) is divided by the round trips. The server runs in another process on the
second core the benchmark may use; the client is pinned to the first.

    python -m radixmesh.benchmarks.transport_cost [--round-trips 20000] [--inflight 1 16] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
import time

import grpc

from radixmesh.v1 import worker_pb2, worker_pb2_grpc
from radixmesh.services.launch import free_port

_LEN = struct.Struct("<I")
REQUEST = worker_pb2.GenerateStreamRequest(submit=worker_pb2.GenerateRequest(request_id="r" * 32, input_ids=[1] * 64))
ANSWER = worker_pb2.GenerateStreamResponse(responses=[worker_pb2.GenerateResponse(
    request_id="r" * 32, chunk=worker_pb2.GenerateStreamChunk(token_ids=[42], text=" tok", completion_tokens=1))])


class _Echo(worker_pb2_grpc.WorkerServiceServicer):
    async def GenerateStream(self, requests, context):
        async for _ in requests:
            yield ANSWER


async def _serve_grpc(port: int) -> None:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(_Echo(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _serve_tcp(port: int) -> None:
    answer = ANSWER.SerializeToString()
    frame = _LEN.pack(len(answer)) + answer

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (n,) = _LEN.unpack(await reader.readexactly(4))
                worker_pb2.GenerateStreamRequest.FromString(await reader.readexactly(n))
                writer.write(frame)
        except asyncio.IncompleteReadError:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    await server.serve_forever()


async def _client_grpc(port: int, trips: int, inflight: int) -> float:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        calls = [stub.GenerateStream() for _ in range(inflight)]

        async def loop(call, n: int) -> None:
            for _ in range(n):
                await call.write(REQUEST)
                await call.read()

        await asyncio.gather(*(loop(c, 200) for c in calls))  # warm-up
        t0 = time.process_time()
        await asyncio.gather(*(loop(c, trips // inflight) for c in calls))
        return time.process_time() - t0


async def _client_tcp(port: int, trips: int, inflight: int) -> float:
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(inflight)]
    request = REQUEST.SerializeToString()

    async def loop(reader, writer, n: int) -> None:
        for _ in range(n):
            writer.write(_LEN.pack(len(request)) + request)
            (size,) = _LEN.unpack(await reader.readexactly(4))
            worker_pb2.GenerateStreamResponse.FromString(await reader.readexactly(size))

    await asyncio.gather(*(loop(r, w, 200) for r, w in conns))
    t0 = time.process_time()
    await asyncio.gather(*(loop(r, w, trips // inflight) for r, w in conns))
    for _, w in conns:
        w.close()
    return time.process_time() - t0


def _wait_listening(port: int, server: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the echo server on port {port} did not start") from None
            time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--round-trips", type=int, default=20000)
    p.add_argument("--inflight", type=int, nargs="+", default=[1, 16])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--serve", choices=("grpc", "tcp"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out")
    args = p.parse_args()
    if args.serve:
        asyncio.run((_serve_grpc if args.serve == "grpc" else _serve_tcp)(args.port))
        return
    cores = sorted(os.sched_getaffinity(0))
    pin = len(cores) > 1  # the client on the first core it may use, the server on the second
    if pin:
        os.sched_setaffinity(0, {cores[0]})
    rows = []
    for transport in ("grpc", "tcp"):
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "radixmesh.benchmarks.transport_cost", "--serve", transport,
                                   "--port", str(port)],
                                  preexec_fn=(lambda: os.sched_setaffinity(0, {cores[1]})) if pin else None)
        try:
            _wait_listening(port, server)
            for inflight in args.inflight:
                client = _client_grpc if transport == "grpc" else _client_tcp
                cpu = sorted(asyncio.run(client(port, args.round_trips, inflight)) for _ in range(args.repeats))
                us = cpu[len(cpu) // 2] / args.round_trips * 1e6
                rows.append({"transport": transport, "inflight": inflight, "round_trips": args.round_trips,
                             "client_cpu_us_per_round_trip": round(us, 2)})
                print(f"{transport:5} inflight {inflight:3}: {us:7.2f} us of client CPU per round trip")
        finally:
            server.kill()
            server.wait()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "command": "python -m radixmesh.benchmarks.transport_cost "
                       + " ".join(sys.argv[1:]), "grpc": grpc.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
