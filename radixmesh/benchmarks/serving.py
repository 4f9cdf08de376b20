"""`python -m radixmesh.benchmarks.serving`: online serving benchmark
shaped like SGLang's `python -m sglang.bench_serving`.

    python -m radixmesh.benchmarks.serving --backend radixmesh --launch --model-path benchmarks/configs/llama-3.1-8b \
        --load-format dummy --dtype bfloat16 --num-prompts 512 --random-input-len 1024 --random-output-len 256 \
        --random-range-ratio 0.5 --request-rate 16 --max-concurrency 128 --output-file out.jsonl
    python -m radixmesh.benchmarks.serving --backend engine --model-path ...
        (same workload flags: the engine in-process)
    python -m radixmesh.benchmarks.serving --backend openai --base-url http://host:30000 --tokenizer PATH ...
    python -m radixmesh.benchmarks.serving --backend engine radixmesh --launch --model-path ... \
        --max-concurrency 1 64 256 512 --num-prompts 24 512 1024 1024    (side by side, a table of both)

Workload (`--dataset-name random`): prompts of random token ids drawn (from `--seed`) from the tokenizer's vocabulary
minus its special tokens; input and output lengths uniform in [max(len * ratio, 1), len], as SGLang draws them. The
same flags give the same workload on every backend (see `workload_digest` in the results). Requests arrive as a
Poisson process of `--request-rate` per second (inf: all at once), at most `--max-concurrency` in flight. One warm-up
request runs first and is left out. Metrics follow SGLang's definitions (see benchmarks.serving_backends for TTFT,
ITL and E2E); `--output-file` appends one JSON line per backend and concurrency. Exit status 1 when any request
failed.

Several backends (`--backend engine radixmesh`) and several concurrency levels (`--max-concurrency 1 64 256`, with
`--num-prompts` one count for all or one per level) make a sweep: each backend runs every level in turn (the engine
in this process, then shut down, which gives its GPU memory back; the mesh launched with --launch), on the same
workload per level, and a table compares them, the first backend the reference: output tok/s and their ratio, TTFT
and ITL medians and their differences, failed requests. `--rounds N` repeats the sweep, alternating the backends'
order, so a drift of the machine's speed falls on both."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import hashlib
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from radixmesh.benchmarks import thread_cpu
from radixmesh.benchmarks.serving_backends import (REPO, BenchError, CompletionsApi, EngineBackend, GenerateApi,
                                                   HttpBackend, LaunchedMesh, RequestOutput, WorkItem, describe_device)
from radixmesh.engine.config import EngineArgs
from radixmesh.settings import add_settings, resolve

BACKENDS = ("radixmesh", "openai", "engine")
WARMUP_OUTPUT_LEN = 32  # cap on the warm-up request's output, as SGLang's


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Milliseconds; None when there was no sample (e.g. no ITL when every output is one token)."""

    mean: float | None = None
    median: float | None = None
    std: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, seconds: list[float]) -> LatencyStats:
        if not seconds:
            return cls()
        ms = np.asarray(seconds) * 1e3
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()), float(np.percentile(ms, 90)),
                   float(np.percentile(ms, 99)), float(ms.max()))


@dataclass(frozen=True, slots=True)
class Metrics:
    """SGLang's serving metrics over the successful requests; throughputs per second of `duration`."""

    completed: int
    failed: int
    duration: float  # s, first arrival to last response
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    concurrency: float  # sum of E2E latencies / duration: the mean number of requests in flight
    ttft: LatencyStats
    tpot: LatencyStats  # (E2E - TTFT) / (output tokens - 1), requests of more than one token
    itl: LatencyStats
    e2e_latency: LatencyStats

    @classmethod
    def of(cls, outputs: list[RequestOutput], duration: float) -> Metrics:
        ok = [o for o in outputs if o.success]
        n_in, n_out = sum(o.prompt_len for o in ok), sum(o.output_len for o in ok)
        e2e = [o.e2e_s for o in ok]
        tpot = [(o.e2e_s - o.ttft_s) / (o.output_len - 1) for o in ok if o.output_len > 1]
        return cls(completed=len(ok), failed=len(outputs) - len(ok), duration=duration, total_input_tokens=n_in,
                   total_output_tokens=n_out, request_throughput=len(ok) / duration, input_throughput=n_in / duration,
                   output_throughput=n_out / duration, total_throughput=(n_in + n_out) / duration,
                   concurrency=sum(e2e) / duration, ttft=LatencyStats.of([o.ttft_s for o in ok]),
                   tpot=LatencyStats.of(tpot), itl=LatencyStats.of([x for o in ok for x in o.itl_s]),
                   e2e_latency=LatencyStats.of(e2e))

    def flat(self) -> dict:
        """SGLang's result keys: `mean_ttft_ms`, `p99_e2e_latency_ms`, ..."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, LatencyStats):
                out.update({f"{stat}_{f.name}_ms": v for stat, v in dataclasses.asdict(value).items()})
            else:
                out[f.name] = value
        return out


def token_pool(path: str) -> np.ndarray:
    """Token ids a random prompt may use: the vocabulary that both the model and its tokenizer know, minus the
    tokenizer's special tokens."""
    root = Path(path)
    if not root.is_dir():
        raise BenchError(f"no tokenizer at {path!r} (give --tokenizer or --model-path as a local directory)")
    config = root / "config.json"
    model_vocab = json.loads(config.read_text())["vocab_size"] if config.is_file() else math.inf
    if (root / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        size = tok.get_vocab_size(with_added_tokens=True)
        special = [i for i, t in tok.get_added_tokens_decoder().items() if t.special]
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        size, special = len(tok), tok.all_special_ids
    ids = np.arange(min(size, model_vocab), dtype=np.int64)
    return ids[~np.isin(ids, special)]


def make_workload(n: int, input_len: int, output_len: int, ratio: float, seed: int,
                  pool: np.ndarray) -> list[WorkItem]:
    """`n` prompts; lengths uniform in [max(int(len * ratio), 1), len] (SGLang's --random-range-ratio)."""
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(max(int(input_len * ratio), 1), input_len + 1, size=n)
    out_lens = rng.integers(max(int(output_len * ratio), 1), output_len + 1, size=n)
    ids = rng.choice(pool, size=int(in_lens.sum()))
    prompts = np.split(ids, np.cumsum(in_lens)[:-1])
    return [WorkItem(p.tolist(), int(o)) for p, o in zip(prompts, out_lens)]


def workload_digest(items: list[WorkItem]) -> str:
    h = hashlib.sha256()
    for item in items:
        h.update(np.asarray(item.input_ids, dtype=np.int64).tobytes() + item.output_len.to_bytes(8, "little"))
    return h.hexdigest()[:16]


async def arrivals(n: int, rate: float, seed: int):
    """Yields 0..n-1 at Poisson arrival times of `rate` per second (exponential gaps from their own seeded stream,
    kept against absolute times so sleep overshoot does not accumulate); inf yields all at once."""
    gaps = np.random.default_rng([seed, 1]).exponential(1.0 / rate, size=n) if math.isfinite(rate) else np.zeros(n)
    due = time.perf_counter()
    for i in range(n):
        yield i
        due += gaps[i]
        await asyncio.sleep(max(due - time.perf_counter(), 0.0))


async def run_timed(backend, items: list[WorkItem], args: argparse.Namespace,
                    concurrency: int | None) -> tuple[list[RequestOutput], float]:
    """Every item sent at its arrival time, at most `concurrency` in flight (None: no bound). Returns (outputs in
    order, duration)."""
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    bar = tqdm(total=len(items), disable=args.disable_tqdm)

    async def one(item: WorkItem) -> RequestOutput:
        if limit is None:
            out = await backend.send(item)
        else:
            async with limit:
                out = await backend.send(item)
        bar.update(1)
        return out

    start = time.perf_counter()
    tasks = [asyncio.create_task(one(items[i])) async for i in arrivals(len(items), args.request_rate, args.seed)]
    outputs = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return outputs, duration


def make_backend(args: argparse.Namespace, engine: dict, name: str):
    if name == "engine":
        return EngineBackend(engine)
    api = GenerateApi() if name == "radixmesh" else CompletionsApi(args.model)
    return HttpBackend(args.base_url or f"http://{args.host}:{args.port}", api)


async def benchmark(args: argparse.Namespace, engine: dict, name: str,
                    levels: list[tuple[int | None, int]]) -> list[dict]:
    """Backend `name` started once, warmed up, then each (max concurrency, prompts) level timed in turn; a result
    per level."""
    backend = make_backend(args, engine, name)
    results = []
    try:
        hint = await backend.start()
        path = args.tokenizer or engine.get("tokenizer_path") or engine.get("model_path") or args.model or hint
        if path is None:
            raise BenchError("no tokenizer to draw prompts from: give --tokenizer or --model-path")
        pool = token_pool(path)
        for concurrency, prompts in levels:
            items = make_workload(prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
                                  args.seed, pool)
            if not results:
                await warm_up(backend, items[0], args.warmup_requests)
            results.append(await timed_level(backend, args, items, concurrency, name))
    finally:
        await backend.close()
    return results


async def warm_up(backend, item: WorkItem, requests: int) -> None:
    for _ in range(requests):
        warm = await backend.send(WorkItem(item.input_ids, min(item.output_len, WARMUP_OUTPUT_LEN)))
        if not warm.success:
            raise BenchError(f"the warm-up request failed: {warm.error}")


async def timed_level(backend, args: argparse.Namespace, items: list[WorkItem], concurrency: int | None,
                      name: str) -> dict:
    if args.flush_cache:
        await backend.flush_cache()
    before = await backend.counters()
    cpu_root = getattr(args, "cpu_root", None) or os.getpid()
    cpu_before = thread_cpu.snapshot(cpu_root) if args.thread_cpu else None
    if args.profile:
        print((await backend.profile(True, args.profile_output_dir)).strip(), flush=True)
    outputs, duration = await run_timed(backend, items, args, concurrency)
    if args.profile:
        print((await backend.profile(False)).strip(), flush=True)
    cpu = thread_cpu.per_token(cpu_before, thread_cpu.snapshot(cpu_root),
                               sum(o.output_len for o in outputs if o.success)) if args.thread_cpu else None
    after = await backend.counters()
    device = await backend.device()
    device = describe_device(device) if args.launch or name == "engine" else device  # else not here
    errors = sorted({o.error for o in outputs if not o.success})
    return {"backend": name, "max_concurrency": concurrency, **Metrics.of(outputs, duration).flat(),
            "errors": errors[:10], "device": device, "workload_digest": workload_digest(items),
            "workload_output_tokens": sum(i.output_len for i in items),
            "workload_input_tokens": sum(len(i.input_ids) for i in items),
            # The (first) worker's scheduler during the timed run: prefill and decode steps, prefilled tokens.
            "scheduler": {k: after[k] - before[k] for k in after if k in before},
            **({"thread_cpu": cpu} if cpu is not None else {})}


def comparison(results: list[dict]) -> str:
    """One row per concurrency level: each backend's output tok/s, TTFT and ITL medians, failed requests, and how the
    others compare with the first backend (tok/s ratio, TTFT and ITL differences in ms)."""
    names = list(dict.fromkeys(r["backend"] for r in results))
    levels = list(dict.fromkeys(r["max_concurrency"] for r in results))
    ref, others = names[0], names[1:]
    head = ["conc", *(f"{n} tok/s" for n in names), *(f"{n}/{ref}" for n in others),
            *(f"TTFT p50 {n}" for n in names), *(f"ITL p50 {n}" for n in names), "failed"]
    rows = [head]
    for level in levels:
        got = {n: [r for r in results if r["backend"] == n and r["max_concurrency"] == level] for n in names}
        tok = {n: _mean(r["output_throughput"] for r in got[n]) for n in names}
        rows.append([str(level if level is not None else "inf"), *(f"{tok[n]:.1f}" for n in names),
                     *(f"{tok[n] / tok[ref]:.3f}" if tok[ref] else "-" for n in others),
                     *(f"{_mean(r['median_ttft_ms'] for r in got[n]):.1f}" for n in names),
                     *(_ms(_mean(r['median_itl_ms'] for r in got[n])) for n in names),
                     str(sum(r["failed"] for n in names for r in got[n]))])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


SUMMARY = (("Backend", "backend", "s"), ("Traffic request rate", "request_rate", "s"),
           ("Max request concurrency", "max_concurrency", "s"), ("Successful requests", "completed", "d"),
           ("Failed requests", "failed", "d"), ("Benchmark duration (s)", "duration", ".2f"),
           ("Total input tokens", "total_input_tokens", "d"), ("Total generated tokens", "total_output_tokens", "d"),
           ("Request throughput (req/s)", "request_throughput", ".2f"),
           ("Input token throughput (tok/s)", "input_throughput", ".2f"),
           ("Output token throughput (tok/s)", "output_throughput", ".2f"),
           ("Total token throughput (tok/s)", "total_throughput", ".2f"), ("Concurrency", "concurrency", ".2f"))
SECTIONS = (("End-to-End Latency", "e2e_latency", "E2E", ("mean", "median", "p90", "p99")),
            ("Time to First Token", "ttft", "TTFT", ("mean", "median", "p90", "p99")),
            ("Time per Output Token (excl. 1st token)", "tpot", "TPOT", ("mean", "median", "p99")),
            ("Inter-Token Latency", "itl", "ITL", ("mean", "median", "p90", "p99", "max")))
STAT_LABELS = {"mean": "Mean", "median": "Median", "p90": "P90", "p99": "P99", "max": "Max"}


def summary(result: dict) -> str:
    def row(label: str, value, fmt: str) -> str:
        shown = "-" if value is None else format(value, fmt) if fmt != "s" else str(value)
        return f"{label + ':':<40} {shown:<10}"

    lines = ["{:=^50}".format(" Serving Benchmark Result ")]
    lines += [row(label, result.get(key), fmt) for label, key, fmt in SUMMARY]
    for title, key, short, stats in SECTIONS:
        lines.append(f"{title:-^50}")
        lines += [row(f"{STAT_LABELS[stat]} {short} (ms)", result[f"{stat}_{key}_ms"], ".2f") for stat in stats]
    sched = result.get("scheduler") or {}
    if sched:
        lines.append(f"{'Worker scheduler':-^50}")
        lines += [row(label, sched.get(key), "d") for label, key in (
            ("Prefill steps", "forward_extend"), ("Decode steps", "forward_decode"),
            ("Prefilled tokens", "prefill_tokens"))]
    if result.get("thread_cpu"):
        lines.append(f"{'CPU per output token (us), by thread':-^50}")
        lines += [row(f"{t['service']} {t['thread']}", t["us_per_token"], ".1f") for t in result["thread_cpu"][:8]]
    return "\n".join(lines + ["=" * 50])


def provenance(argv: list[str]) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit,
            "command": "python -m radixmesh.benchmarks.serving " + shlex.join(argv)}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")  # one line, not the usage of every engine flag


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m radixmesh.benchmarks.serving", description=__doc__.split("\n")[0])
    p.add_argument("--backend", nargs="+", default=["radixmesh"],
                   help=f"one of {', '.join(BACKENDS)}, or several side by side (the first is the reference)")
    p.add_argument("--base-url", help="server URL (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, help="default 30000; with --launch a free port")
    p.add_argument("--model", help="model name for the openai backend (default: the server's first model); also "
                                   "the tokenizer when --tokenizer and --model-path are not given")
    p.add_argument("--tokenizer", help="tokenizer directory the prompts are drawn from (default: --model-path, "
                                       "--model or the server's)")
    p.add_argument("--dataset-name", default="random", choices=["random"])
    p.add_argument("--num-prompts", type=int, nargs="+", default=[1000],
                   help="prompts per run: one count, or one per --max-concurrency level")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * ratio, len] (SGLang's default 0.0; 1.0: exactly len)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default inf)")
    p.add_argument("--max-concurrency", type=int, nargs="+", default=[None],
                   help="requests in flight at most (default unbounded); several levels run one after another")
    p.add_argument("--rounds", type=int, default=1,
                   help="with several backends: sweeps of every level, the backends' order alternating by round")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--flush-cache", action="store_true", help="flush the prefix cache after the warm-up")
    p.add_argument("--thread-cpu", action="store_true",
                   help="CPU per output token of each thread over the timed run, of the launched mesh (--launch) "
                        "or of this process (the engine backend); Linux only")
    p.add_argument("--thread-cpu-pid", type=int,
                   help="with --thread-cpu: the process tree to measure instead (a mesh started elsewhere: the "
                        "launcher's pid)")
    p.add_argument("--profile", action="store_true",
                   help="SGLang's: /start_profile before the timed run and /stop_profile after it (torch.profiler "
                        "on every worker; the traces go to --profile-output-dir or the server's "
                        "$SGLANG_TORCH_PROFILER_DIR)")
    p.add_argument("--profile-output-dir", help="with --profile: where the workers write their traces")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--output-file", help="append one JSON line of results here")
    p.add_argument("--launch", action="store_true", help="start the mesh (services.launch serve) with the engine "
                   "flags given here, benchmark it and stop it")
    p.add_argument("--launch-args", default="", help="more launcher flags, as one string after '=': "
                   "--launch-args='--num-workers 2 --policy random'")
    p.add_argument("--launch-timeout", type=float, default=600.0, help="seconds the mesh may take to start")
    add_settings(p, EngineArgs)
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, dict]:
    """(the flags, the engine keyword arguments: all of them for the engine backend and --launch, else only the
    model and tokenizer paths); a bad flag exits with status 2 and one line."""
    p = build_parser()
    args = p.parse_args(argv)
    for name in args.backend:
        if name not in BACKENDS:
            p.error(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    if len(set(args.backend)) < len(args.backend) or ("radixmesh" in args.backend and "openai" in args.backend):
        p.error("--backend names each backend once, and at most one of radixmesh and openai (one server)")
    if len(args.num_prompts) not in (1, len(args.max_concurrency)):
        p.error("--num-prompts takes one count, or one per --max-concurrency level")
    if min(*args.num_prompts, args.random_input_len, args.random_output_len, args.rounds) < 1:
        p.error("--num-prompts, --random-input-len, --random-output-len and --rounds must be at least 1")
    if any(c is not None and c < 1 for c in args.max_concurrency):
        p.error("--max-concurrency must be at least 1")
    if not 0.0 <= args.random_range_ratio <= 1.0 or args.request_rate <= 0:
        p.error("--random-range-ratio must be in [0, 1] and --request-rate positive")
    if args.launch and (args.backend == ["engine"] or args.base_url):
        p.error("--launch starts its own mesh: use it with --backend radixmesh or openai and without --base-url")
    try:
        engine = resolve(args, EngineArgs)[0] if "engine" in args.backend or args.launch else \
            {k: v for k, v in vars(args).items() if k in ("model_path", "tokenizer_path")}
    except ValueError as e:
        p.error(str(e))
    return args, engine


def mesh_for(args: argparse.Namespace, engine: dict, log_dir: str) -> LaunchedMesh:
    """The launcher for --launch: the engine flags given here plus --launch-args, on args.port (or a free one)."""
    from radixmesh.services.launch import engine_flags, free_port

    args.port = args.port or free_port()
    argv = ["--host", "127.0.0.1", "--port", str(args.port), *engine_flags(engine), *shlex.split(args.launch_args)]
    return LaunchedMesh(argv, f"http://127.0.0.1:{args.port}", Path(log_dir) / "mesh.log")


def levels_of(args: argparse.Namespace) -> list[tuple[int | None, int]]:
    """(max concurrency, prompts) per level, in the order given."""
    prompts = args.num_prompts * len(args.max_concurrency) if len(args.num_prompts) == 1 else args.num_prompts
    return list(zip(args.max_concurrency, prompts))


def run_backend(args: argparse.Namespace, engine: dict, name: str, logs: str) -> list[dict]:
    """Every level on backend `name`; a mesh it needs is launched first and stopped after (--launch)."""
    mesh = mesh_for(args, engine, logs) if args.launch and name != "engine" else None
    try:
        if mesh is not None:
            mesh.start(args.launch_timeout)
            args.cpu_root = mesh.proc.pid
        else:
            args.cpu_root = args.thread_cpu_pid
        results = asyncio.run(benchmark(args, engine, name, levels_of(args)))
        if mesh is not None and any(r["failed"] for r in results):
            print(f"--- the mesh's log, last lines ---\n{mesh.log_tail(30)}", file=sys.stderr)
        return results
    finally:
        if mesh is not None:
            mesh.stop()


def sweep(args: argparse.Namespace, engine: dict) -> list[dict]:
    """Every backend over every level, `--rounds` times (the order of the backends reversed every other round)."""
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as logs:
        for round_ in range(args.rounds):
            order = args.backend if round_ % 2 == 0 else args.backend[::-1]
            for name in order:
                results += [{**r, "round": round_} for r in run_backend(args, engine, name, logs)]
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, engine = parse_args(argv)
    args.port = args.port or (None if args.launch else 30000)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs the finally below: the mesh is stopped
    try:
        results = sweep(args, engine)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    rate = args.request_rate if math.isfinite(args.request_rate) else "inf"  # JSON has no infinity
    records = [{"bench": "serving", "request_rate": rate, **r,
                "args": {**vars(args), "request_rate": rate, "engine": engine}, **provenance(argv)} for r in results]
    for record in records:
        print(summary(record))
    if len(records) > 1:
        print(f"{' Side by side (medians; mean of rounds) ':=^80}\n{comparison(records)}")
    if args.output_file:
        with open(args.output_file, "a") as fh:
            fh.writelines(json.dumps(record) + "\n" for record in records)
    errors = sorted({e for r in records for e in r["errors"]})
    for error in errors:
        print(f"failed request: {error}", file=sys.stderr)
    return 1 if any(r["failed"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
