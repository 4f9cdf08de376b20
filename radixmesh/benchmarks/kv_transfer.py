"""KV transfer throughput on loopback: the Mooncake transfer engine (TCP, P2P handshake) against a plain socket
copy of the same bytes into a preallocated buffer, from 64 KiB to 64 MiB per transfer.

    python -m radixmesh.benchmarks.kv_transfer --out benchmarks/results/<date>-kv-transfer-loopback.json

Each transfer is timed from the call to its completion (the socket side waits for a one-byte ack after the
receiver has the last byte, as a synchronous write does); the median of --reps transfers is reported."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import subprocess
import time
from datetime import date

import numpy as np

from radixmesh.engine.disaggregation.registry import make_backend
from radixmesh.engine.disaggregation.transfer import Write

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _mooncake_receiver(conn, nbytes: int) -> None:
    backend = make_backend("mooncake")
    buf = np.zeros(nbytes, dtype=np.uint8)
    backend.register(buf.ctypes.data, buf.nbytes)
    conn.send((backend.session_id, buf.ctypes.data))
    conn.recv()


def _socket_receiver(conn, nbytes: int) -> None:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        conn.send(srv.getsockname()[1])
        s, _ = srv.accept()
        with s:
            while True:
                head = s.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    return
                n, got = int.from_bytes(head, "little"), 0
                while got < n:
                    got += s.recv_into(view[got:n])
                s.sendall(b"k")


def bench_mooncake(sizes: list[int], reps: int) -> dict[int, float]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    peer = ctx.Process(target=_mooncake_receiver, args=(there, max(sizes)), daemon=True)
    peer.start()
    try:
        session, remote = here.recv()
        backend = make_backend("mooncake")
        src = np.random.default_rng(0).integers(0, 255, max(sizes), dtype=np.uint8)
        backend.register(src.ctypes.data, src.nbytes)
        backend.write(session, [Write(src.ctypes.data, remote, 4096)])  # the handshake, outside the timing
        out = {}
        for size in sizes:
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                backend.write(session, [Write(src.ctypes.data, remote, size)])
                times.append(time.perf_counter() - t)
            out[size] = statistics.median(times)
        here.send("done")
        return out
    finally:
        peer.join(timeout=5)
        peer.kill()


def bench_socket(sizes: list[int], reps: int) -> dict[int, float]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    peer = ctx.Process(target=_socket_receiver, args=(there, max(sizes)), daemon=True)
    peer.start()
    try:
        port = here.recv()
        src = np.random.default_rng(0).integers(0, 255, max(sizes), dtype=np.uint8)
        view = memoryview(src)
        out = {}
        with socket.create_connection(("127.0.0.1", port)) as s:
            for size in sizes:
                times = []
                for _ in range(reps):
                    t = time.perf_counter()
                    s.sendall(size.to_bytes(8, "little"))
                    s.sendall(view[:size])
                    assert s.recv(1) == b"k"
                    times.append(time.perf_counter() - t)
                out[size] = statistics.median(times)
        return out
    finally:
        peer.join(timeout=5)
        peer.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--sizes", type=int, nargs="*", default=SIZES, help="bytes per transfer")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    mooncake, plain = bench_mooncake(args.sizes, args.reps), bench_socket(args.sizes, args.reps)
    rows = [{"bytes": n, "mooncake_s": mooncake[n], "mooncake_gbps": n / mooncake[n] / 1e9,
             "socket_s": plain[n], "socket_gbps": n / plain[n] / 1e9} for n in args.sizes]
    print(f"{'size':>10} | {'mooncake GB/s':>13} | {'socket GB/s':>11} | mooncake/socket")
    for r in rows:
        print(f"{r['bytes'] >> 10:>8}Ki | {r['mooncake_gbps']:>13.3f} | {r['socket_gbps']:>11.3f} | "
              f"{r['mooncake_gbps'] / r['socket_gbps']:.2f}")
    if args.out:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.out, "w") as fh:
            json.dump({"date": str(date.today()), "device": f"{cpu}, loopback", "commit": commit,
                       "command": f"python -m radixmesh.benchmarks.kv_transfer --reps {args.reps}", "results": rows},
                      fh, indent=2)


if __name__ == "__main__":
    main()
