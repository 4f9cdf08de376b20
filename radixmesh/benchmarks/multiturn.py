"""`python -m radixmesh.benchmarks.multiturn`: multi-turn conversations against the mesh, shaped like SGLang's HiCache
benchmark (`benchmark/hicache/bench_multiturn.py`): every client re-sends its whole, growing history each turn, so the
prefix cache (and, once the histories outgrow the device KV pool, the hierarchical cache) decides the TTFT.

    python -m radixmesh.benchmarks.multiturn --launch --model-path benchmarks/configs/llama-3.1-8b --load-format dummy \
        --dtype bfloat16 --num-clients 256 --num-rounds 5 --request-length 1024 --output-length 64 \
        --shared-system-prompt-len 512 --max-parallel 32 --output-file multiturn.jsonl
    python -m radixmesh.benchmarks.multiturn --base-url http://host:30000 --tokenizer PATH ...   (a running router)

Comparisons: one workload, W = the flags of the first example (grow --num-clients, or shrink the pool with
--max-total-tokens / --mem-fraction-static, until "Working set / KV pool" is well above 1, so that evicted histories
must come back from a lower tier or be prefilled again):

    python -m radixmesh.benchmarks.multiturn $W                                                # hierarchy off (L1)
    python -m radixmesh.benchmarks.multiturn $W --enable-hierarchical-cache --hicache-ratio 4  # L1 + L2 (host memory)
    python -m radixmesh.benchmarks.multiturn $W --enable-hierarchical-cache --hicache-ratio 4 --kvstore  # L1 + L2 + L3
    python -m radixmesh.benchmarks.multiturn $W --workers 2 --policy cache_aware               # routing over 2 workers
    python -m radixmesh.benchmarks.multiturn $W --workers 2 --kvstore --policy kv_index

With --launch, every flag this benchmark does not know goes to the launcher (`python -m radixmesh.services.launch
serve`) unchanged, and so do --model-path and --launch-args='...' (for flags that share a name with this benchmark's,
such as the engine's --seed); --workers N is the launcher's --num-workers N. Nothing here checks them: a flag the mesh
does not take stops it at start-up, and the error shows its log.

Workload: from --seed, random token ids (the tokenizer's vocabulary minus its special tokens, as benchmarks.serving
draws them): a system prompt of --shared-system-prompt-len tokens shared by every client, and per client
--num-rounds user turns of --request-length tokens. Turn r's prompt is the system prompt, user turns 1..r and the
model's answers (token ids) to turns 1..r-1; each answer is --output-length tokens (greedy, ignore_eos), sent to the
SGLang-native /generate as input_ids and streamed. A client sends its next turn only after its answer arrived; at
most --max-parallel turns are in flight, turns are released as a Poisson process of --request-rate per second (inf:
at once). Warm-up conversations outside the workload run first, then the prefix cache is flushed.

Results: SGLang's serving metrics (benchmarks.serving: throughputs, TTFT, ITL, E2E), the cache hit rate
sum(meta_info.cached_tokens) / sum(meta_info.prompt_tokens), per-round TTFT and hit rate, the working set (sum of
the clients' final history lengths) and its ratio to the worker's KV pool (max_total_num_tokens of
/get_server_info). --output-file appends one JSON line. Exit status 1 when any turn failed."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import signal
import sys
import tempfile

import aiohttp
import numpy as np

from radixmesh.benchmarks.multiturn_workload import (Turn, TurnApi, Workload, hit_rate, make_workload, round_stats,
                                                     run_clients)
from radixmesh.benchmarks.serving import WARMUP_OUTPUT_LEN, Metrics, _Parser, mesh_for, provenance, summary, token_pool
from radixmesh.benchmarks.serving_backends import BenchError, HttpBackend, WorkItem, describe_device

PROG = "python -m radixmesh.benchmarks.multiturn"
BACKENDS = ("radixmesh",)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)  # no prefix steals a mesh flag
    p.add_argument("--backend", default="radixmesh", help=f"one of {', '.join(BACKENDS)} (SGLang-native /generate)")
    p.add_argument("--base-url", help="router URL (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, help="default 30000; with --launch a free port")
    p.add_argument("--model-path", help="the model (passed to the launcher); also the default tokenizer")
    p.add_argument("--tokenizer", help="tokenizer directory the token ids are drawn from (default: --model-path or "
                                       "the server's)")
    p.add_argument("--num-clients", type=int, default=256, help="conversations")
    p.add_argument("--num-rounds", type=int, default=5, help="turns per conversation")
    p.add_argument("--request-length", type=int, default=512, help="new user tokens per turn")
    p.add_argument("--output-length", type=int, default=64, help="generated tokens per turn (ignore_eos)")
    p.add_argument("--shared-system-prompt-len", type=int, default=0, help="tokens of a prefix every client shares")
    p.add_argument("--max-parallel", type=int, default=128, help="turns in flight at most (0: unbounded)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="turns released per s, Poisson (default inf)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warmup-requests", type=int, default=8,
                   help="warm-up conversations of two turns, before the clock starts (0: none)")
    p.add_argument("--disable-flush-cache", action="store_true", help="keep the prefix cache after the warm-up")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--output-file", help="append one JSON line of results here")
    p.add_argument("--launch", action="store_true", help="start the mesh (services.launch serve) with --model-path "
                   "and every flag not listed here, benchmark it and stop it")
    p.add_argument("--launch-args", default="", help="more launcher flags, as one string after '=': "
                   "--launch-args='--seed 7 --policy random'")
    p.add_argument("--workers", type=int, help="with --launch: colocated workers (the launcher's --num-workers)")
    p.add_argument("--routers", type=int, default=1, help="router replicas on consecutive ports from the router's; "
                   "turns go to them in turn, as a load balancer without affinity would send them (with --launch: "
                   "the launcher's --num-routers)")
    p.add_argument("--launch-timeout", type=float, default=600.0, help="seconds the mesh may take to start")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags, with `launch_flags`: what goes to the launcher besides --model-path. A bad flag exits with status 2
    and one line."""
    p = build_parser()
    args, rest = p.parse_known_args(argv)
    if args.backend not in BACKENDS:
        p.error(f"unknown backend {args.backend!r} (choose from {', '.join(BACKENDS)})")
    if min(args.num_clients, args.num_rounds, args.request_length, args.output_length) < 1:
        p.error("--num-clients, --num-rounds, --request-length and --output-length must be at least 1")
    if args.shared_system_prompt_len < 0 or args.max_parallel < 0 or args.request_rate <= 0:
        p.error("--shared-system-prompt-len and --max-parallel must be >= 0 and --request-rate positive")
    if not args.launch and (rest or args.launch_args or args.workers):
        extra = shlex.join(rest) or "--launch-args/--workers"
        p.error(f"unrecognized arguments: {extra} (flags for the mesh need --launch)")
    if args.launch and (args.base_url or not args.model_path):
        p.error("--launch starts its own mesh: give it --model-path and no --base-url")
    if args.workers is not None and args.workers < 1 or args.routers < 1:
        p.error("--workers and --routers must be at least 1")
    workers = ["--num-workers", str(args.workers)] if args.workers else []
    routers = ["--num-routers", str(args.routers)] if args.routers > 1 else []
    args.launch_flags = [*rest, *shlex.split(args.launch_args), *workers, *routers]
    return args


async def get_json(backend: HttpBackend, path: str) -> dict:
    """GET `path` of the server as a JSON object ({} when it does not answer one)."""
    try:
        async with backend.session.get(backend.base_url + path) as resp:
            body = await resp.json() if resp.status == 200 else {}
    except (aiohttp.ClientError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def check_context(workload: Workload, model_info: dict) -> None:
    """Fails early when the last turn would not fit the model's context (every turn would fail at the server)."""
    need, limit = workload.final_prompt_len() + workload.output_len, model_info.get("max_context_length")
    if isinstance(limit, int) and need > limit:
        raise BenchError(f"the last turn needs {need} tokens of context and the model serves {limit}: lower "
                         "--num-rounds, --request-length, --output-length or --shared-system-prompt-len")


def server_facts(info: dict) -> dict:
    """KV pool sizes (tokens) and the cache and routing settings of /get_server_info, as the results record them."""
    workers = [w for w in info.get("workers") or [] if isinstance(w, dict) and "error" not in w]
    pools = [w["max_total_num_tokens"] for w in workers if isinstance(w.get("max_total_num_tokens"), int)]
    cache = {k: v for k, v in info.items() if k == "page_size" or "hicache" in k or "hierarchical" in k}
    return {"kv_pool_tokens": info.get("max_total_num_tokens"), "kv_pool_tokens_all_workers": sum(pools) or None,
            "num_workers": len(workers) or None, "policy": (info.get("router") or {}).get("policy"), "cache": cache}


async def warm_up(backend: HttpBackend, api: TurnApi, args: argparse.Namespace, pool: np.ndarray) -> None:
    """--warmup-requests two-turn conversations drawn apart from the workload, side by side (up to --max-parallel),
    then (unless disabled) the prefix cache is flushed. The second turn extends the first, so prefill over a cached
    prefix, batched prefill and decode all run at the workload's first lengths before the clock starts. (A JIT
    compiler's first use of a kernel variant still lands in the run that meets it first: run something before the
    first measured configuration on a fresh kernel cache, as benchmarks/gpu_speed.sh does.)"""
    rng = np.random.default_rng([args.seed, 2])
    limit = asyncio.Semaphore(args.max_parallel or args.warmup_requests or 1)

    async def one(item: WorkItem) -> None:
        async with limit:
            out = await backend.send(item)
        api.take_final(item)
        if not out.success:
            raise BenchError(f"the warm-up request failed: {out.error}")

    output_len = min(args.output_length, WARMUP_OUTPUT_LEN)
    first = [rng.choice(pool, size=args.shared_system_prompt_len + args.request_length).tolist()
             for _ in range(args.warmup_requests)]
    await asyncio.gather(*(one(WorkItem(p, output_len)) for p in first))
    second = [p + rng.choice(pool, size=args.request_length).tolist() for p in first]
    await asyncio.gather(*(one(WorkItem(p, output_len)) for p in second))
    if not args.disable_flush_cache:
        await backend.flush_cache()


def report(turns: list[Turn], histories: list[int], duration: float, workload: Workload, facts: dict) -> dict:
    """The result fields of one run (the serving metrics over every turn, then the multi-turn ones)."""
    rounds = round_stats(turns, workload.num_rounds)
    working_set = sum(histories)
    pool = facts["kv_pool_tokens"]
    planned = len(workload.turns) * workload.num_rounds
    return {**Metrics.of([t.out for t in turns], duration).flat(),
            "errors": sorted({t.out.error for t in turns if not t.out.success})[:10],
            "num_requests": planned, "skipped": planned - len(turns),  # turns after a failed one are never sent
            "cache_hit_rate": hit_rate(turns), "round_mean_ttft_ms": [r["mean_ttft_ms"] for r in rounds],
            "rounds": rounds, "working_set_tokens": working_set,
            # The shared system prompt once: what a cache that holds every history at once needs.
            "working_set_unique_tokens": working_set - max(len(histories) - 1, 0) * len(workload.system),
            "working_set_ratio": working_set / pool if isinstance(pool, int) and pool else None, **facts,
            "workload_digest": workload.digest()}


def replica_url(base_url: str, i: int) -> str:
    """The i-th router replica's URL: the same host, the port i above the first router's."""
    head, _, port = base_url.rstrip("/").rpartition(":")
    return f"{head}:{int(port) + i}"


class RoundRobin:
    """Sends each turn to the next router replica (only `send` is used while the clients play)."""

    def __init__(self, backends: list[HttpBackend]):
        self.backends, self._next = backends, 0

    async def send(self, item):
        backend = self.backends[self._next % len(self.backends)]
        self._next += 1
        return await backend.send(item)


async def benchmark(args: argparse.Namespace) -> dict:
    api = TurnApi()
    backend = HttpBackend(args.base_url or f"http://{args.host}:{args.port}", api)
    replicas = [HttpBackend(replica_url(backend.base_url, i), api) for i in range(1, args.routers)]
    try:
        hint = await backend.start()
        for r in replicas:
            await r.start()
        path = args.tokenizer or args.model_path or hint
        if path is None:
            raise BenchError("no tokenizer to draw prompts from: give --tokenizer or --model-path")
        pool = token_pool(path)
        workload = make_workload(args.num_clients, args.num_rounds, args.request_length, args.output_length,
                                 args.shared_system_prompt_len, args.seed, pool)
        check_context(workload, await get_json(backend, "/get_model_info"))
        facts = server_facts(await get_json(backend, "/get_server_info"))
        await warm_up(backend, api, args, pool)
        before = await backend.counters()
        turns, histories, duration = await run_clients(RoundRobin([backend, *replicas]), api, workload,
                                                       args.max_parallel or None, args.request_rate, args.seed,
                                                       args.disable_tqdm)
        after = await backend.counters()
        device = await backend.device()
    finally:
        await backend.close()
        for r in replicas:
            await r.close()
    return {**report(turns, histories, duration, workload, facts),
            "device": describe_device(device) if args.launch else device,  # else not this machine's
            # The (first) worker's scheduler during the timed run: prefill and decode steps, prefilled tokens.
            "scheduler": {k: after[k] - before[k] for k in after if k in before}}


def summary_text(result: dict) -> str:
    """benchmarks.serving's summary under this benchmark's title, then the multi-turn section."""
    def row(label: str, value, fmt: str) -> str:
        return f"{label + ':':<40} {'-' if value is None else format(value, fmt):<10}"

    lines = ["{:=^50}".format(" Multi-turn Benchmark Result "), *summary(result).splitlines()[1:-1]]
    lines.append(f"{'Multi-turn':-^50}")
    lines += [row(label, result.get(key), fmt) for label, key, fmt in (
        ("Clients", "num_clients", "d"), ("Rounds", "num_rounds", "d"), ("Skipped turns", "skipped", "d"),
        ("Cache hit rate", "cache_hit_rate", ".3f"), ("Working set (tokens)", "working_set_tokens", "d"),
        ("KV pool per worker (tokens)", "kv_pool_tokens", "d"), ("Working set / KV pool", "working_set_ratio", ".2f"))]
    lines.append(f"{'Round':>5} {'Prompt len':>11} {'Hit rate':>9} {'Mean TTFT (ms)':>15} {'P90 TTFT':>9}")
    for r in result["rounds"]:
        cells = [(r["mean_prompt_len"], ".0f", 11), (r["cache_hit_rate"], ".3f", 9), (r["mean_ttft_ms"], ".2f", 15),
                 (r["p90_ttft_ms"], ".2f", 9)]
        lines.append(f"{r['round']:>5} " + " ".join(f"{'-' if v is None else format(v, f):>{w}}" for v, f, w in cells))
    return "\n".join(lines + ["=" * 50])


def launched_mesh(args: argparse.Namespace, log_dir: str):
    """benchmarks.serving's launcher for --launch, given --model-path and the pass-through flags; sets args.port."""
    ns = argparse.Namespace(port=args.port, launch_args=shlex.join(args.launch_flags))
    mesh = mesh_for(ns, {"model_path": args.model_path}, log_dir)
    args.port = ns.port
    return mesh


def run(args: argparse.Namespace) -> dict:
    """The benchmark, inside a mesh it starts and stops when --launch. Raises BenchError."""
    with tempfile.TemporaryDirectory(prefix="bench-multiturn-") as logs:
        mesh = launched_mesh(args, logs) if args.launch else None
        try:
            if mesh is not None:
                mesh.start(args.launch_timeout)
            result = asyncio.run(benchmark(args))
            if mesh is not None and (result["failed"] or result["skipped"]):
                print(f"--- the mesh's log, last lines ---\n{mesh.log_tail(30)}", file=sys.stderr)
            return result
        finally:
            if mesh is not None:
                mesh.stop()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.port = args.port or (None if args.launch else 30000)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs run()'s finally: the mesh is stopped
    try:
        result = run(args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    rate = args.request_rate if math.isfinite(args.request_rate) else "inf"  # JSON has no infinity
    result = {"bench": "multiturn", "backend": args.backend, "request_rate": rate,
              "max_concurrency": args.max_parallel or None, "num_clients": args.num_clients,
              "num_rounds": args.num_rounds, "request_length": args.request_length,
              "output_length": args.output_length, "shared_system_prompt_len": args.shared_system_prompt_len,
              **result, "args": {**vars(args), "request_rate": rate},
              **provenance(argv), "command": f"{PROG} {shlex.join(argv)}"}
    print(summary_text(result))
    if args.output_file:
        with open(args.output_file, "a") as fh:
            fh.write(json.dumps(result) + "\n")
    for error in result["errors"]:
        print(f"failed request: {error}", file=sys.stderr)
    return 1 if result["failed"] or result["skipped"] else 0


if __name__ == "__main__":
    sys.exit(main())
