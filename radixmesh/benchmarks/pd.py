"""Prefill/decode disaggregation against a colocated worker, through the router's own request path.

    python -m radixmesh.benchmarks.pd --model-path benchmarks/configs/llama-3.1-8b --load-format dummy \
        --dtype bfloat16 --input-len 2048 --output-len 64 --num-prompts 48 --concurrency 8 --result-file out.json

Per mode, worker processes are started (colocated: one `services.worker`; pd: one prefill and one decode worker,
sharing the machine's GPU when there is one, KV moved by Mooncake over TCP, staged through pinned host memory on
CUDA), a Router (services.router.core) is built over them in this process, and random prompts (token ids, no
tokenizer) are sent with bounded concurrency, streaming. Reported: TTFT (first streamed token), per-request decode
speed after the first token, and output tokens per second over the whole run."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixmesh.v1 import common_pb2, worker_pb2
from radixmesh.services.launch import free_port
from radixmesh.services.router.core import Router
from radixmesh.services.router.policy_registry import make_policy
from radixmesh.services.router.settings import RouterSettings
from radixmesh.services.router.workers import WorkerRegistry


def _spawn(role: list[str], engine_flags: list[str], log_dir: str, name: str,
           device: str | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, "-m", "radixmesh.services.worker", "--port", str(port), "--log-level", "warning", *role,
            *engine_flags]
    log = open(os.path.join(log_dir, f"{name}.log"), "w")
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": device} if device is not None else {})}
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env), f"127.0.0.1:{port}"


def _wait_serving(proc: subprocess.Popen, address: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker {address} exited with {proc.returncode}")
        with grpc.insecure_channel(address) as ch:
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
        time.sleep(0.5)
    raise RuntimeError(f"worker {address} not serving within {timeout} s")


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


async def _one(router: Router, ids: list[int], output_len: int) -> dict:
    req = worker_pb2.GenerateRequest(request_id=uuid.uuid4().hex, input_ids=ids, stream=True,
                                     sampling_params=common_pb2.SamplingParams(max_new_tokens=output_len,
                                                                               temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    arrivals, tokens = [], 0
    async for msg in router.generate(req):
        if msg.HasField("chunk") and msg.chunk.token_ids:
            arrivals.append(time.perf_counter())
            tokens += len(msg.chunk.token_ids)
    end = time.perf_counter()
    first = arrivals[0]
    return {"ttft_s": first - start, "tokens": tokens, "itl_s": [b - a for a, b in zip(arrivals, arrivals[1:])],
            "decode_tok_s": (tokens - 1) / (end - first) if end > first else 0.0, "latency_s": end - start}


def _pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _level(router: Router, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    """`prompts` through the router, `concurrency` at a time: TTFT and inter-token latency (the gaps between a
    stream's chunks; a decode worker interrupted by prefills shows them in the p99) and output tok/s."""
    sem = asyncio.Semaphore(concurrency)

    async def bounded(ids):
        async with sem:
            return await _one(router, ids, output_len)
    start = time.perf_counter()
    results = await asyncio.gather(*(bounded(ids) for ids in prompts))
    wall = time.perf_counter() - start
    ttft = [1000 * r["ttft_s"] for r in results]
    itl = [1000 * g for r in results for g in r["itl_s"]]
    return {"concurrency": concurrency, "requests": len(results), "wall_s": wall,
            "output_tok_s": sum(r["tokens"] for r in results) / wall,
            "ttft_mean_ms": statistics.mean(ttft), "ttft_p50_ms": _pct(ttft, 0.5), "ttft_p90_ms": _pct(ttft, 0.9),
            "ttft_p99_ms": _pct(ttft, 0.99), "itl_p50_ms": _pct(itl, 0.5), "itl_p99_ms": _pct(itl, 0.99),
            "decode_tok_s_per_request": statistics.mean(r["decode_tok_s"] for r in results)}


async def _drive(addresses: list[str], prompts: list[list[int]], output_len: int, levels: list[tuple[int, int]],
                 mode: str) -> list[dict]:
    """Each (concurrency, prompts) level in turn over the same workers, after a warm-up; each row printed as it
    is measured."""
    settings = RouterSettings(tokenizer_url="unused:1", policy="round_robin", request_timeout_s=600)
    registry = WorkerRegistry(connect_timeout_s=30, probe_interval_s=5)
    for a in addresses:
        await registry.add(a)
    router = Router(settings, registry, make_policy("round_robin", settings), tokenizer=None)
    try:
        for ids in prompts[:2]:  # warm-up: first-call costs (graphs, connections, Mooncake handshakes)
            await _one(router, ids, 4)
        rows, at = [], 2
        for concurrency, n in levels:
            row = await _level(router, prompts[at:at + n], output_len, concurrency)
            at += n
            loads = {a: await registry.workers[a].stub.GetLoads(worker_pb2.GetLoadsRequest()) for a in addresses}
            row["kv_transfer"] = {a: {"gbps": l.kv_transfer_gbps, "latency_ms": l.kv_transfer_latency_ms}
                                  for a, l in loads.items() if l.kv_transfer_gbps}
            print(mode, json.dumps(row), flush=True)
            rows.append(row)
        return rows
    finally:
        await registry.close()


def run_mode(mode: str, args, engine_flags: list[str], prompts, levels) -> list[dict]:
    procs: list[subprocess.Popen] = []
    try:
        if mode == "colocated":
            roles = [("worker", [])]
        else:
            roles = [("prefill", ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                  str(free_port())]), ("decode", ["--disaggregation-mode", "decode"])]
            roles = [(n, r + ["--disaggregation-transfer-backend", args.transfer_backend]) for n, r in roles]
        addresses = []
        devices = args.pd_devices or [None, None]
        for i, (name, role) in enumerate(roles):  # one at a time: each sizes its KV pool from the free GPU memory
            proc, address = _spawn(role, engine_flags, args.log_dir, f"{mode}-{name}", devices[i])
            procs.append(proc)
            _wait_serving(proc, address)
            addresses.append(address)
        return asyncio.run(_drive(addresses, prompts, args.output_len, levels, mode))
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, nargs="+", default=[48],
                    help="prompts per concurrency level (one count for all, or one per level)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8], help="levels, each run in turn")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--modes", nargs="+", default=["colocated", "pd"])
    ap.add_argument("--transfer-backend", default="mooncake")
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--pd-devices", nargs=2, metavar=("PREFILL", "DECODE"),
                    help="CUDA_VISIBLE_DEVICES of the prefill and the decode worker (the colocated worker gets the "
                         "first); unset: every process sees every GPU")
    ap.add_argument("--result-file")
    args, engine_flags = ap.parse_known_args()
    if len(args.num_prompts) not in (1, len(args.concurrency)):
        ap.error("--num-prompts takes one count, or one per --concurrency level")
    counts = args.num_prompts * len(args.concurrency) if len(args.num_prompts) == 1 else args.num_prompts
    levels = list(zip(args.concurrency, counts))
    engine_flags = ["--model-path", args.model_path, "--skip-tokenizer-init", *engine_flags]
    prompts = _prompts(sum(counts) + 2, args.input_len, args.vocab, seed=0)
    out = {"config": {**vars(args), "engine_flags": engine_flags}}
    for mode in args.modes:
        out[mode] = run_mode(mode, args, engine_flags, prompts, levels)
    print(table(out, args.modes))
    if args.result_file:
        with open(args.result_file, "w") as fh:
            json.dump(out, fh, indent=1)


def table(out: dict, modes: list[str]) -> str:
    """One line per mode and level: what issue 50's PD table asks for."""
    lines = ["mode       conc  TTFT p50  TTFT p99  ITL p50  ITL p99  out tok/s  KV GB/s"]
    for mode in modes:
        for r in out[mode]:
            gbps = max((t["gbps"] for t in r["kv_transfer"].values()), default=None)
            lines.append(f"{mode:<9} {r['concurrency']:>5} {r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>9.1f} "
                         f"{r['itl_p50_ms']:>8.2f} {r['itl_p99_ms']:>8.2f} {r['output_tok_s']:>10.1f} "
                         f"{'-' if gbps is None else format(gbps, '.2f'):>8}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
