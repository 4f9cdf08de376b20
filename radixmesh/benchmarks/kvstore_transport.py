"""`python -m radixmesh.benchmarks.kvstore_transport`: L3 page bytes between a worker's host pool and the kvstore, over
gRPC and over the Mooncake transfer engine, through the worker's real storage path (`StorageIO` on a `HostKVPool`).

    python -m radixmesh.benchmarks.kvstore_transport --shape 8b --page-size 64 --pages 64 --batch 16 \
        --output-file out.jsonl

Starts a kvstore process (memory backend, `--enable-mooncake-transfer`) on loopback, or uses --kvstore-url (a store
started with that flag). For each transport (grpc; mooncake) it writes --pages pages from the host pool in jobs of
--batch pages (write-back), then fetches them all back into other host pages (prefetch), and reports per direction:
GB/s of page bytes, ms per job, and the CPU seconds this process spent per GB moved (the worker's storage threads
share the interpreter with its scheduler: CPU here is time the scheduler may wait for the GIL). Each fetched page is
checked against what was written. --output-file appends one JSON line per transport.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import torch

from radixmesh.benchmarks.serving import provenance
from radixmesh.benchmarks.serving_backends import describe_device
from radixmesh.engine.cache.host_pool import HostKVPool
from radixmesh.engine.cache.storage import KvLayout, StorageOptions
from radixmesh.engine.cache.storage_io import JobKind, StorageIO, StorageJob
from radixmesh.services.kvstore.client import KvStoreStorage, open_kvstore

# (num_layers, num_kv_heads, head_dim) of the model shapes
SHAPES = {"tiny": (4, 2, 16), "8b": (32, 8, 128)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m radixmesh.benchmarks.kvstore_transport",
                                description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--pages", type=int, default=64, help="pages written and fetched per transport")
    p.add_argument("--batch", type=int, default=16, help="pages per storage job")
    p.add_argument("--transports", nargs="+", default=["grpc", "mooncake"], choices=["grpc", "mooncake"])
    p.add_argument("--kvstore-url", help="a running kvstore (with --enable-mooncake-transfer); default: start one")
    p.add_argument("--output-file")
    return p.parse_args(argv)


def host_pool(layout: KvLayout, pages: int) -> HostKVPool:
    """A real host pool of `pages` pages shaped like the layout (pinned on a CUDA machine, as a worker's is)."""
    k = torch.empty((1, layout.num_kv_heads, layout.head_dim), dtype=getattr(torch, layout.dtype),
                    device="cuda" if torch.cuda.is_available() else "cpu")
    pool = HostKVPool(pages, SimpleNamespace(k=[k] * layout.num_layers, page_size=layout.page_size, parts=2))
    pool.data.view(torch.uint8).random_(0, 256)
    return pool


def start_kvstore(capacity: int) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "radixmesh.services.kvstore", "--host", "127.0.0.1", "--port",
                             str(port), "--enable-mooncake-transfer", "--capacity-bytes", str(capacity),
                             "--log-level", "warning"])
    url = f"127.0.0.1:{port}"
    probe = KvStoreStorage(StorageOptions(url=url, timeout_s=1))
    deadline = time.monotonic() + 60
    while True:
        try:
            probe.stats()
            break
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the kvstore did not start")
            time.sleep(0.2)
    probe.close()
    return proc, url


def run_jobs(io: StorageIO, jobs: list[StorageJob]) -> tuple[float, float, list[StorageJob]]:
    """Submit every job, wait for all; (wall seconds, this process's CPU seconds, completed jobs)."""
    wall, cpu = time.perf_counter(), time.process_time()
    for job in jobs:
        io.submit(job)
    done: list[StorageJob] = []
    while len(done) < len(jobs):
        done += io.poll()
        time.sleep(0.0005)
    return time.perf_counter() - wall, time.process_time() - cpu, done


def measure(transport: str, url: str, layout: KvLayout, args: argparse.Namespace) -> dict:
    host = host_pool(layout, 2 * args.pages + 1)
    storage = open_kvstore(StorageOptions(url=url, timeout_s=60, layout=layout, transport=transport))
    io = StorageIO(lambda: storage, host)
    tag = f"{transport}-{time.time_ns()}".encode()
    keys = [tag + i.to_bytes(4, "big") for i in range(args.pages)]
    src = list(range(1, args.pages + 1))
    dst = list(range(args.pages + 1, 2 * args.pages + 1))
    b = args.batch
    try:
        # the first job opens the store (and, for mooncake, registers the pool): not timed
        warm = run_jobs(io, [StorageJob(JobKind.FETCH, None, [b"warm-up-key"], [dst[0]])])[2]
        assert warm[0].error is None, warm[0].error
        w_wall, w_cpu, written = run_jobs(io, [StorageJob(JobKind.WRITE, None, keys[i:i + b], src[i:i + b])
                                               for i in range(0, args.pages, b)])
        assert all(j.error is None for j in written), [j.error for j in written]
        f_wall, f_cpu, fetched = run_jobs(io, [StorageJob(JobKind.FETCH, None, keys[i:i + b], dst[i:i + b])
                                               for i in range(0, args.pages, b)])
        assert all(j.error is None and j.loaded == len(j.keys) for j in fetched), \
            [(j.error, j.loaded, j.corrupt) for j in fetched]
        raw = host.data.view(torch.uint8)
        assert torch.equal(raw[src[0]:src[-1] + 1], raw[dst[0]:dst[-1] + 1]), "fetched pages differ"
    finally:
        io.close()
    gb = args.pages * layout.page_bytes / 1e9
    jobs = len(written)
    return {"transport": transport, "page_bytes": layout.page_bytes, "pages": args.pages, "batch": b,
            "write_gb_s": round(gb / w_wall, 3), "fetch_gb_s": round(gb / f_wall, 3),
            "write_ms_per_job": round(w_wall / jobs * 1e3, 2), "fetch_ms_per_job": round(f_wall / jobs * 1e3, 2),
            "write_cpu_s_per_gb": round(w_cpu / gb, 3), "fetch_cpu_s_per_gb": round(f_cpu / gb, 3)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    layers, heads, dim = SHAPES[args.shape]
    dtype = "bfloat16" if args.shape == "8b" else "float16"
    layout = KvLayout(f"bench-{args.shape}", args.page_size, dtype, layers, heads, dim)
    proc, url = (None, args.kvstore_url) if args.kvstore_url else \
        start_kvstore(4 * args.pages * layout.page_bytes * len(args.transports))
    try:
        rows = [measure(t, url, layout, args) for t in args.transports]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    device = describe_device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"{args.shape} page of {args.page_size} tokens = {layout.page_bytes / 2**20:.2f} MiB, {args.pages} pages in "
          f"jobs of {args.batch}, loopback, {device}")
    print(f"{'transport':<10}{'write GB/s':>11}{'fetch GB/s':>11}{'write ms/job':>13}{'fetch ms/job':>13}"
          f"{'write CPU s/GB':>15}{'fetch CPU s/GB':>15}")
    for r in rows:
        print(f"{r['transport']:<10}{r['write_gb_s']:>11}{r['fetch_gb_s']:>11}{r['write_ms_per_job']:>13}"
              f"{r['fetch_ms_per_job']:>13}{r['write_cpu_s_per_gb']:>15}{r['fetch_cpu_s_per_gb']:>15}")
    if args.output_file:
        meta = {**provenance(sys.argv[1:] if argv is None else argv), "device": device, "shape": args.shape,
                "page_size": args.page_size, "cpus": os.cpu_count()}
        meta["command"] = meta["command"].replace("radixmesh.benchmarks.serving",
                                                  "radixmesh.benchmarks.kvstore_transport")
        with open(args.output_file, "a") as f:
            for r in rows:
                f.write(json.dumps({**meta, **r}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
