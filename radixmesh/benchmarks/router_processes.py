"""`python -m radixmesh.benchmarks.router_processes [--out PATH]`: `--router-workers 1` against `2` on this machine,
nothing pinned (the router processes, the load generator, the tokenizer service and two fake workers share every core):
- throughput: requests/s of 32 closed-loop clients on streamed /generate (16 tokens) and streamed chat (16 tokens);
- cache-aware hit rate on a prefix-heavy workload: 64 conversations of ~250 words, each asked 8 times with a new
  last turn, over 32 clients (connections spread over the processes): hits / (hits + misses) summed over every
  process's metrics. Without shared routes a process that has not seen a conversation misses; with them it hits."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from radixmesh.benchmarks import router as bench
from radixmesh.benchmarks.router_scenarios import SCENARIOS, Scenario

THROUGHPUT = ("generate_stream_16", "chat_stream_16")
CONVERSATIONS, TURNS = 64, 8


def _prefix_body(i: int) -> dict:
    conv = i % CONVERSATIONS
    history = " ".join(f"c{conv}w{j}" for j in range(250))
    return {"text": f"{history} turn {i // CONVERSATIONS}", "sampling_params": {"max_new_tokens": 1}}


PREFIX = Scenario("prefix_heavy", "64 conversations x 8 turns, /generate text, 1 token", "/generate", 1, False,
                  _prefix_body, lambda body: "" if b'"output_ids"' in body else f"bad answer {body[:100]!r}")


def metric_sum(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def one_setting(count: int, args) -> dict:
    cores = os.sched_getaffinity(0)
    with bench.process_group(f"bench-procs-{count}-") as procs:
        tok, workers, metrics = bench.free_port(), [bench.free_port(), bench.free_port()], bench.free_port()
        quiet = ["--log-level", "warning"]
        procs.start("tokenizer", ["radixmesh.services.tokenizer", "--model-path", args.model_path, "--port", str(tok),
                                  *quiet], cores)
        for i, port in enumerate(workers):
            procs.start(f"worker{i}", ["radixmesh.benchmarks.fake_worker", "--port", str(port), "--tokens", "16",
                                       *quiet, *bench.fake_tokenizes(args)], cores)
        port = bench.free_port()
        base = f"http://127.0.0.1:{port}"
        procs.start("router", ["radixmesh.services.router", "--host", "127.0.0.1", "--port", str(port),
                               "--tokenizer-url", f"127.0.0.1:{tok}",
                               "--worker-urls", *(f"127.0.0.1:{p}" for p in workers),
                               "--policy", "cache_aware", "--router-workers", str(count), "--enable-metrics",
                               "--metrics-port", str(metrics), *quiet], cores)
        bench.wait_http(base + "/health", procs, timeout_s=120)
        time.sleep(1.0)  # every process up (the port answers as soon as the first one serves)
        out = {"router_workers": count, "throughput": []}
        for n, sc in enumerate(s for s in SCENARIOS if s.name in THROUGHPUT):
            asyncio.run(bench.run_load(base, sc, args.warmup, args.concurrency, n * 1_000_000))
            runs = []
            for k in range(args.repeats):
                t0 = time.perf_counter()
                load = asyncio.run(bench.run_load(base, sc, args.requests, args.concurrency,
                                                  n * 1_000_000 + (k + 1) * args.requests))
                runs.append({"requests_per_s": args.requests / (time.perf_counter() - t0), **load})
            rps = sorted(r["requests_per_s"] for r in runs)
            out["throughput"].append({"scenario": sc.name, "requests_per_s": rps[len(rps) // 2],
                                      "runs_requests_per_s": [round(r, 1) for r in rps],
                                      "errors": sum(r["errors"] for r in runs)})
        hits0 = metric_sum(metrics, "sgl_router_cache_hits_total")
        misses0 = metric_sum(metrics, "sgl_router_cache_misses_total")
        load = asyncio.run(bench.run_load(base, PREFIX, CONVERSATIONS * TURNS, args.concurrency, 0))
        hits = metric_sum(metrics, "sgl_router_cache_hits_total") - hits0
        misses = metric_sum(metrics, "sgl_router_cache_misses_total") - misses0
        out["prefix_heavy"] = {"requests": CONVERSATIONS * TURNS, "cache_hits": hits, "cache_misses": misses,
                               "hit_rate": hits / max(hits + misses, 1), "errors": load["errors"],
                               "best_possible_hit_rate": (TURNS - 1) / TURNS}
        return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--model-path", default="models/tiny-llama")
    p.add_argument("--out")
    args = p.parse_args(argv)
    doc = {**bench.provenance(argv), "command": "python -m radixmesh.benchmarks.router_processes " + " ".join(argv)}
    doc["device"] = doc["device"].replace(" (router pinned to one)", " (nothing pinned)")
    doc["settings"] = [one_setting(n, args) for n in (1, 2)]
    one, two = doc["settings"]
    for a, b in zip(one["throughput"], two["throughput"]):
        print(f"{a['scenario']}: {a['requests_per_s']:.0f} req/s with 1 router process, {b['requests_per_s']:.0f} "
              f"with 2 ({b['requests_per_s'] / a['requests_per_s']:.2f}x)")
    print(f"prefix-heavy cache-aware hit rate: {one['prefix_heavy']['hit_rate']:.3f} with 1, "
          f"{two['prefix_heavy']['hit_rate']:.3f} with 2 (best possible {one['prefix_heavy']['best_possible_hit_rate']:.3f})")
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    errors = sum(t["errors"] for s in doc["settings"] for t in s["throughput"]) + \
        sum(s["prefix_heavy"]["errors"] for s in doc["settings"])
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
