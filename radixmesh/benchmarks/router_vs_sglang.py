"""`python -m radixmesh.benchmarks.router_vs_sglang [--out PATH]`: our router and SGLang's (sglang-router, Rust;
`pip install sglang-router`) on the same workload, one after the other, each pinned to the same core with everything
else on the others: 32 closed-loop clients, 16-token answers (/generate whole and streamed, streamed chat), CPU time of
the router process (all its threads) per request. Ours runs as benchmarks.router runs it (the tokenizer service and two
fake gRPC workers); SGLang's runs with two fake SGLang HTTP workers (benchmarks.fake_sglang_worker) giving the same
answers, so the same checks judge both.

Not the same work: in HTTP mode SGLang's router passes /generate and chat requests through to the workers, which
tokenize and apply the chat template themselves; ours sends /generate's text to the workers too (they tokenize it),
but calls the tokenizer service for chat (and converts between HTTP/JSON and gRPC both ways). The ratio is what a
user sees: router CPU per request for the same client traffic."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
from pathlib import Path

from radixmesh.benchmarks import router as ours
from radixmesh.benchmarks.router_scenarios import SCENARIOS

COMPARED = ("generate_16", "generate_stream_16", "chat_stream_16", "generate_text_stream_16")


def run_sglang(args: argparse.Namespace, procs: ours.Processes) -> list[dict]:
    """SGLang's router over two fake SGLang workers; results shaped like benchmarks.router's."""
    others = os.sched_getaffinity(0) - {args.router_cpu}
    args.other_cores = len(others)
    os.sched_setaffinity(0, others)
    workers = [ours.free_port(), ours.free_port()]
    most = str(max(s.tokens for s in SCENARIOS))
    for i, port in enumerate(workers):
        procs.start(f"worker{i}", ["radixmesh.benchmarks.fake_sglang_worker", "--port", str(port), "--tokens", most],
                    others)
    for port in workers:
        ours.wait_http(f"http://127.0.0.1:{port}/health", procs, timeout_s=60)
    port = ours.free_port()
    procs.start("router", ["sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                           "--worker-urls", *(f"http://127.0.0.1:{p}" for p in workers), "--policy", args.policy,
                           "--log-level", "warn", "--prometheus-port", str(ours.free_port())], {args.router_cpu})
    base = f"http://127.0.0.1:{port}"
    ours.wait_http(base + "/health", procs, timeout_s=120)
    pids = {name: p.pid for name, p in procs.procs.items()}
    results = []
    for n, sc in enumerate(s for s in SCENARIOS if s.name in args.scenarios):
        results.append(ours.measure(base, sc, args, pids, offset=n * 1_000_000))
        procs.check_alive()
    args.router_rss_mb = ours.rss_mb(pids["router"])
    return results


def side(name: str, args: argparse.Namespace, runner) -> dict:
    with ours.process_group(f"bench-{name}-") as procs:
        results = runner(args, procs)
    return {"router_rss_mb": round(args.router_rss_mb, 1), "results": results}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=3000, help="measured requests per non-streaming run")
    p.add_argument("--stream-requests", type=int, default=1500, help="measured requests per streaming run")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3, help="measured runs per scenario (the median is reported)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--scenarios", nargs="*", default=list(COMPARED), choices=[s.name for s in SCENARIOS])
    p.add_argument("--policy", default="cache_aware", help="both routers' --policy")
    p.add_argument("--router-cpu", type=int, default=0)
    p.add_argument("--model-path", default="models/tiny-llama", help="our tokenizer service's model")
    p.add_argument("--router-tokenizes", action="store_true", help="our router tokenizes text prompts (through the "
                   "tokenizer service) instead of sending them to the workers as SGLang's does")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    args.enable_trace = args.trace_ab = args.ab_control = False
    args.profile_router = None
    args.router_args = []
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if importlib.util.find_spec("sglang_router") is None:
        raise SystemExit("SGLang's router is not installed: pip install sglang-router")
    args = parse_args(argv)
    affinity = os.sched_getaffinity(0)
    doc = {**ours.provenance(argv), "command": "python -m radixmesh.benchmarks.router_vs_sglang " + " ".join(argv),
           "sglang_router": importlib.metadata.version("sglang-router")}
    doc["radixmesh"] = side("radixmesh", args, ours.run)
    os.sched_setaffinity(0, affinity)
    doc["sglang"] = side("sglang", args, run_sglang)
    rows = []
    for a, b in zip(doc["radixmesh"]["results"], doc["sglang"]["results"]):
        ratio = a["router_cpu_ms_per_request"] / b["router_cpu_ms_per_request"]
        rows.append({"scenario": a["scenario"], "radixmesh_cpu_ms_per_request": round(a["router_cpu_ms_per_request"], 4),
                     "sglang_cpu_ms_per_request": round(b["router_cpu_ms_per_request"], 4),
                     "ratio": round(ratio, 3), "errors": a["errors"] + b["errors"]})
        print(f"{a['scenario']}: radixmesh {a['router_cpu_ms_per_request']:.3f} ms/request, SGLang "
              f"{b['router_cpu_ms_per_request']:.3f} ms/request: {ratio:.2f}x")
    doc["comparison"] = rows
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
