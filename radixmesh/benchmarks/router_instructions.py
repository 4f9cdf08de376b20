"""`python -m radixmesh.benchmarks.router_instructions`: the router's cost per request in executed instructions, counted
by valgrind's callgrind, so A/B comparisons need no quiet machine. The CPU-time benchmark (benchmarks.router) drifts by
+-5% between runs on a shared VM, more than the differences it is asked about (tracing's 3%); instruction counts
of the same code on the same inputs repeat to a fraction of a percent whatever else the machine runs.

It starts the real tokenizer service and two fake workers (benchmarks.fake_worker) natively, and the router (each
variant in turn) under `valgrind --tool=callgrind --instr-atstart=no`. After a warm-up it zeroes the counters,
switches counting on (callgrind_control), sends `--requests` requests of each scenario from `--concurrency` closed-
loop clients, switches counting off and dumps: instructions per request for that scenario, from every thread of
the router process (its trace exporter's thread included). With `--annotate N` the N C
functions whose counts differ most between the first and each other variant are listed (callgrind_annotate).

Instructions are not time: cache misses, branch mispredictions and a slower or faster core do not show. Use this
for what code a change adds or removes per request, and benchmarks.router for what it costs in seconds. Under
callgrind the router runs ~50x slower than natively, so with concurrency above 1 more requests share an event-loop
turn than they would natively; concurrency 1 (the default) counts one request's own work.

Every process it starts runs with one string-hash seed (PYTHONHASHSEED, `--hash-seed`, 0 by default): with a
random seed per process, dict and set layouts differ from router to router, and so did their counts (a streamed
/generate's spread over three router processes: 5.2k instructions a request with random seeds, 1.0k with seed 0).
A change that only moves the seed's luck shows as a difference that another `--hash-seed` does not repeat."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from radixmesh.benchmarks.router import (Processes, fake_tokenizes, free_port, process_group, provenance, run_load,
                                         wait_http)
from radixmesh.benchmarks.router_scenarios import SCENARIOS

# tracing at the default ratio, and on every request
VARIANTS = {"off": [], "trace": ["--enable-trace"], "trace_all": ["--enable-trace", "--trace-sample-ratio", "1.0"]}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenarios", nargs="*", default=["generate_1"], choices=[s.name for s in SCENARIOS])
    p.add_argument("--variants", nargs="*", default=["off", "trace"], choices=list(VARIANTS),
                   help="router configurations, each counted in a router process of its own")
    p.add_argument("--requests", type=int, default=200, help="counted requests per scenario")
    p.add_argument("--warmup", type=int, default=100, help="uncounted requests per scenario first")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1, help="counted runs per scenario and variant (all reported)")
    p.add_argument("--model-path", default="models/tiny-llama", help="tokenizer of the tokenizer service")
    p.add_argument("--router-tokenizes", action="store_true", help="text prompts are tokenized by the router "
                   "(through the tokenizer service), as with workers that have no tokenizer; default: the workers")
    p.add_argument("--router-args", nargs="*", default=[], metavar="FLAG", help="more router flags for every variant")
    p.add_argument("--annotate", type=int, default=0, metavar="N",
                   help="list the N C functions whose instruction counts differ most from the first variant's")
    p.add_argument("--dump-dir", help="keep callgrind's dumps in this folder (default: a temporary one)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--hash-seed", default="0", type=_hash_seed,
                   help="PYTHONHASHSEED of every process started (0 to 4294967295; `random`: each its own)")
    return p.parse_args(argv)


def _hash_seed(text: str) -> str:
    if text == "random" or (text.isdigit() and int(text) <= 4294967295):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: an integer from 0 to 4294967295, or random")


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def callgrind(pid: int, *flags: str) -> None:
    subprocess.run(["callgrind_control", *flags, str(pid)], check=True, capture_output=True, timeout=120)


def dump_totals(pid: int, out_prefix: str, label: str) -> tuple[int, str]:
    """Dump the counters since the last zeroing; returns (instructions, the dump file)."""
    before = set(glob.glob(out_prefix + "*"))
    callgrind(pid, f"--dump={label}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = sorted(set(glob.glob(out_prefix + "*")) - before)
        for path in new:
            text = Path(path).read_text(errors="replace")
            match = re.search(r"^totals: (\d+)", text, re.M)
            if match and label in text:  # the dump's trigger line names the label
                return int(match.group(1)), path
        time.sleep(0.2)
    raise RuntimeError(f"no callgrind dump for {label}")


def _offset(scenario: int, repeat: int) -> int:
    """The first prompt index of a counted run. Every variant gets the same prompts (each runs in a router of its
    own), so the variants are compared on one workload. Indices have 8 digits in every run: text prompts hold the
    index, and until 2026-11-29 each variant's indices began at its own power of ten, which gave the traced
    variant's text prompts a digit more than the untraced one's (~5k instructions a request more for (d), charged
    to tracing)."""
    return 10_000_000 + (scenario * 10 + repeat) * 100_000


def start_router(procs: Processes, name: str, argv: list[str], out_prefix: str, cpus: set[int]) -> tuple[int, str]:
    port = free_port()
    log = open(procs.log_dir / f"{name}.log", "wb")
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", *os.environ.get("CALLGRIND_FLAGS", "").split(),
           f"--callgrind-out-file={out_prefix}.%p",
           sys.executable, "-m", "radixmesh.services.router", *argv, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[2], stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    log.close()
    procs.procs[name] = proc
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/health", procs, timeout_s=900)
    return proc.pid, base


def count(pid: int, base: str, sc, args, out_prefix: str, label: str, offset: int) -> tuple[int, str]:
    """(instructions of the counted requests, the dump file)."""
    asyncio.run(run_load(base, sc, args.warmup, args.concurrency, offset))
    callgrind(pid, "--zero")
    callgrind(pid, "--instr=on")
    load = asyncio.run(run_load(base, sc, args.requests, args.concurrency, offset + args.warmup))
    callgrind(pid, "--instr=off")
    if load["errors"]:
        raise RuntimeError(f"{label}: {load['errors']} bad responses, e.g. {load['error_examples']}")
    return dump_totals(pid, out_prefix, label)


def annotate_diff(first: str, other: str, top: int) -> list[tuple[int, str]]:
    """The `top` C functions whose inclusive-free (self) counts differ most between two dumps: (delta, function)."""
    def selfs(path: str) -> dict[str, int]:
        out = subprocess.run(["callgrind_annotate", "--threshold=100", "--auto=no", path], capture_output=True,
                             text=True).stdout
        found = {}
        for ln in out.splitlines():
            m = re.match(r"\s*([\d,]+)\s+\([^)]*\)\s+(.+)$", ln)
            if m:
                found[m.group(2).strip()] = found.get(m.group(2).strip(), 0) + int(m.group(1).replace(",", ""))
        return found
    a, b = selfs(first), selfs(other)
    deltas = [(b.get(k, 0) - a.get(k, 0), k) for k in set(a) | set(b)]
    return sorted(deltas, key=lambda d: -abs(d[0]))[:top]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cpus = os.sched_getaffinity(0)
    results, dumps = [], {}
    with contextlib.ExitStack() as stack:
        seed = os.environ.get("PYTHONHASHSEED")
        stack.callback(_set_env, "PYTHONHASHSEED", seed)
        _set_env("PYTHONHASHSEED", None if args.hash_seed == "random" else args.hash_seed)  # inherited
        tmp = args.dump_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-instr-"))
        procs = stack.enter_context(process_group("bench-instr-"))
        tok, workers, sink = free_port(), [free_port(), free_port()], free_port()
        quiet = ["--log-level", "warning"]
        procs.start("tokenizer", ["radixmesh.services.tokenizer", "--model-path", args.model_path, "--port", str(tok),
                                  *quiet], cpus)
        most = str(max(s.tokens for s in SCENARIOS))
        for i, port in enumerate(workers):
            procs.start(f"worker{i}", ["radixmesh.benchmarks.fake_worker", "--port", str(port), "--tokens", most,
                                       *quiet, *fake_tokenizes(args)], cpus)
        if any(v.startswith("trace") for v in args.variants):
            procs.start("otlp_sink", ["radixmesh.benchmarks.otlp_sink", "--port", str(sink)], cpus)
        common = ["--tokenizer-url", f"127.0.0.1:{tok}", *quiet, *args.router_args,
                  "--worker-urls", *(f"127.0.0.1:{p}" for p in workers)]
        for variant in args.variants:
            traced = variant.startswith("trace")
            extra = VARIANTS[variant] + (["--otlp-traces-endpoint", f"127.0.0.1:{sink}"] if traced else [])
            prefix = f"{tmp}/{variant}"
            pid, base = start_router(procs, f"router_{variant}", [*common, *extra], prefix, cpus)
            for n, sc in enumerate(s for s in SCENARIOS if s.name in args.scenarios):
                for k in range(args.repeats):
                    label = f"{variant}-{sc.name}-{k}"
                    total, dump = count(pid, base, sc, args, prefix, label, offset=_offset(n, k))
                    per = total / args.requests
                    results.append({"variant": variant, "scenario": sc.name, "repeat": k, "requests": args.requests,
                                    "concurrency": args.concurrency, "instructions_per_request": round(per)})
                    print(f"{label}: {per / 1e3:,.1f} k instructions per request", flush=True)
                    if k == 0:
                        dumps[(variant, sc.name)] = dump
            Processes._stop([procs.procs.pop(f"router_{variant}")])
        diffs = {}
        if args.annotate and len(args.variants) > 1:
            for sc in args.scenarios:
                for variant in args.variants[1:]:
                    key = f"{variant} - {args.variants[0]}, {sc}"
                    diffs[key] = annotate_diff(dumps[(args.variants[0], sc)], dumps[(variant, sc)], args.annotate)
                    print(f"--- {key}: self instructions per request by C function")
                    for delta, fn in diffs[key]:
                        print(f"{delta / args.requests:+12,.0f}  {fn}")
    doc = {**provenance(sys.argv[1:] if argv is None else argv), "tool": "valgrind callgrind",
           "hash_seed": args.hash_seed, "results": results,
           "annotate": {k: [[d, f] for d, f in v] for k, v in diffs.items()}}
    doc["command"] = doc["command"].replace("radixmesh.benchmarks.router",
                                            "radixmesh.benchmarks.router_instructions", 1)
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
