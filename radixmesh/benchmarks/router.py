"""`python -m radixmesh.benchmarks.router [--out PATH]`: the router's own cost. Starts the real tokenizer service, two
fake workers (benchmarks.fake_worker: answers at once) and the router as separate processes; pins the router to one core
and everything else (this load generator included) to the others; runs closed-loop HTTP load per scenario and
reads the router's CPU time (its CPU-time clock, in ns: every thread's, the trace exporter's included) around each
measured run. With --enable-trace the router exports its spans to a local sink (benchmarks.otlp_sink), which counts
them. --trace-ab compares tracing off with tracing at the default ratio and at the ratios of --trace-ratios. Every
response is checked; any error makes the run fail (exit 1) after the results are written."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from radixmesh.benchmarks.router_scenarios import SCENARIOS, Scenario
from radixmesh.services import forkserver
from radixmesh.services.common.ports import free_port

REPO = Path(__file__).resolve().parents[2]  # the checkout: benchmarks/results, models/
TICK = os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    """Resident memory of `pid` now, in MiB."""
    with open(f"/proc/{pid}/status") as fh:
        kb = next(int(ln.split()[1]) for ln in fh if ln.startswith("VmRSS:"))
    return kb / 1024


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of `pid`, in seconds: the process's CPU-time clock (nanoseconds), else utime + stime
    of /proc/<pid>/stat (clock ticks, 10 ms: too coarse for a few % of a short run)."""
    libc, clock, ts = ctypes.CDLL("libc.so.6"), ctypes.c_int(), _Timespec()
    if libc.clock_getcpuclockid(pid, ctypes.byref(clock)) == 0 and libc.clock_gettime(clock, ctypes.byref(ts)) == 0:
        return ts.sec + ts.nsec * 1e-9
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU time of `pid`'s threads (utime + stime, clock ticks: for shares over a run of seconds): its main thread
    (the event loop) as `main`, the others by their OS names, added up per name (Python's own threads, such as the
    trace exporter's, are all `python`; grpc names its own)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            stat = (task / "stat").read_text()
            name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()
            name = "main" if task.name == str(pid) else name
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


def core_busy_seconds(cpu: int) -> float:
    """Time core `cpu` spent busy (anything but idle and iowait) since boot, by any process, in seconds."""
    with open("/proc/stat") as fh:
        ticks = [int(x) for x in next(ln for ln in fh if ln.startswith(f"cpu{cpu} ")).split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / TICK


class Processes:
    """Child processes pinned to CPU sets; all are stopped on close (they also die if this process dies)."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], cpus: set[int]) -> subprocess.Popen | forkserver.Forked:
        """`python -m argv` pinned to `cpus`, its output in the log folder. A module of ours is forked from the fork
        server that RADIXMESH_FORK_SERVER names where there is one (the test suite's: services.forkserver), then
        pinned."""
        def pin() -> None:
            os.sched_setaffinity(0, cpus)
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

        with open(self.log_dir / f"{name}.log", "wb") as log:
            server = os.environ.get(forkserver.ENV) if argv[0].startswith("radixmesh.") else None
            proc = forkserver.spawn(server, argv, dict(os.environ), cwd=str(REPO),
                                    fds=(0, log.fileno(), log.fileno())) if server else None
            if isinstance(proc, forkserver.Forked):  # (it dies with this process too: the server's rule)
                os.sched_setaffinity(proc.pid, cpus)
            else:
                proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, stdout=log,
                                        stderr=subprocess.STDOUT, preexec_fn=pin)
        self.procs[name] = proc
        return proc

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 30) -> str:
        return "\n".join((self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        """The routers first (with tracing on they flush their spans to the sink), then the others."""
        for group in ([p for n, p in self.procs.items() if n.startswith("router")],
                      [p for n, p in self.procs.items() if not n.startswith("router")]):
            self._stop(group)

    @staticmethod
    def _stop(procs: list[subprocess.Popen]) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_http(url: str, procs: Processes, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        procs.check_alive()
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s")
        time.sleep(0.1)


async def run_load(base: str, sc: Scenario, count: int, concurrency: int, offset: int) -> dict:
    """Closed loop: `concurrency` clients, each sends its next request when its previous answer has arrived."""
    errors: list[str] = []
    latencies: list[float] = []
    ids = iter(range(offset, offset + count))

    async def client(session: aiohttp.ClientSession) -> None:
        for i in ids:
            t0 = time.perf_counter()
            try:
                async with session.post(base + sc.path, json=sc.body(i)) as resp:
                    body = await resp.read()
                problem = f"HTTP {resp.status}: {body[:200]!r}" if resp.status != 200 else sc.check(body)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                problem = f"{type(e).__name__}: {e}"
            latencies.append(time.perf_counter() - t0)
            if problem:
                errors.append(problem)

    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    latencies.sort()
    pick = lambda q: latencies[min(int(q * len(latencies)), len(latencies) - 1)] * 1e3  # noqa: E731
    return {"errors": len(errors), "error_examples": errors[:3], "p50_ms": pick(0.5), "p99_ms": pick(0.99)}


def router_cpu_fields(router_s: float, count: int, wall_s: float) -> dict:
    """A router's CPU over a measured run of `count` requests."""
    return {"wall_s": wall_s, "router_cpu_s": router_s, "router_cpu_ms_per_request": router_s / count * 1e3}


def measure_once(base: str, sc: Scenario, args, pids: dict[str, int], count: int, offset: int) -> dict:
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    core_before, self_before, t0 = core_busy_seconds(args.router_cpu), os.times(), time.perf_counter()
    load = asyncio.run(run_load(base, sc, count, args.concurrency, offset))
    wall = time.perf_counter() - t0
    self_after, core_busy = os.times(), core_busy_seconds(args.router_cpu) - core_before
    used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    used["loadgen"] = (self_after.user + self_after.system) - (self_before.user + self_before.system)
    router = used.pop("router")
    return {**router_cpu_fields(router, count, wall), "requests_per_s": count / wall,
            "router_capacity_rps_one_core": count / router if router else None,
            "router_cpu_us_per_token": router / (count * sc.tokens) * 1e6,
            "router_cpu_utilization": router / wall, "router_core_foreign_load": max(core_busy - router, 0.0) / wall,
            "other_processes_cpu_s": used, "other_cores_utilization": sum(used.values()) / wall / args.other_cores,
            "loadavg_1m": os.getloadavg()[0], **load}


def measure(base: str, sc: Scenario, args, pids: dict[str, int], offset: int) -> dict:
    """Warmup, then `args.repeats` measured runs; the run of median router CPU per request represents them."""
    count = args.stream_requests if sc.stream else args.requests
    asyncio.run(run_load(base, sc, min(args.warmup, count), args.concurrency, offset))
    runs = [measure_once(base, sc, args, pids, count, offset + (k + 1) * count) for k in range(args.repeats)]
    median = sorted(runs, key=lambda r: r["router_cpu_ms_per_request"])[len(runs) // 2]
    keys = ("requests_per_s", "router_cpu_ms_per_request", "router_cpu_utilization", "router_core_foreign_load",
            "loadavg_1m")
    return {"scenario": sc.name, "description": sc.description, "requests": count, "tokens_per_request": sc.tokens,
            "concurrency": args.concurrency, **median, "errors": sum(r["errors"] for r in runs),
            "error_examples": [e for r in runs for e in r["error_examples"]][:3],
            "runs": [{k: round(r[k], 4) for k in keys} for r in runs]}


def add_marginals(results: list[dict]) -> None:
    """Per streamed token beyond the first: (CPU per request − that of the 1-token twin) / (tokens − 1)."""
    by_name = {r["scenario"]: r for r in results}
    for sc in SCENARIOS:
        r, base = by_name.get(sc.name), by_name.get(sc.baseline or "")
        if r and base and sc.tokens > 1:
            extra = r["router_cpu_ms_per_request"] - base["router_cpu_ms_per_request"]
            r["router_cpu_us_per_extra_token"] = extra * 1e3 / (sc.tokens - 1)


LEGEND = """router util: router CPU s / wall s (1.0: its core is saturated, so req/s is one core's capacity).
capacity: requests / router CPU s, the req/s one fully busy router core would serve.
foreign: other processes' load on the router's core. other util: load generator, fakes and tokenizer per other core.
us/extra tok: (CPU per request - that of the 1-token twin) / (tokens - 1)."""


def _num(key: str, fmt: str):
    return lambda r: "-" if r.get(key) is None else format(r[key], fmt)


COLUMNS = (("scenario", lambda r: r["scenario"]), ("reqs", _num("requests", "d")), ("wall s", _num("wall_s", ".2f")),
           ("req/s", _num("requests_per_s", ".0f")), ("capacity", _num("router_capacity_rps_one_core", ".0f")),
           ("cpu ms/req", _num("router_cpu_ms_per_request", ".2f")),
           ("cpu us/tok", _num("router_cpu_us_per_token", ".0f")),
           ("us/extra tok", _num("router_cpu_us_per_extra_token", ".0f")),
           ("router util", _num("router_cpu_utilization", ".2f")), ("foreign", _num("router_core_foreign_load", ".2f")),
           ("other util", _num("other_cores_utilization", ".2f")), ("p50 ms", _num("p50_ms", ".1f")),
           ("p99 ms", _num("p99_ms", ".1f")), ("errors", _num("errors", "d")))


def print_table(results: list[dict]) -> None:
    print(" | ".join(name for name, _ in COLUMNS))
    for r in results:
        print(" | ".join(cell(r) for _, cell in COLUMNS))
    print(LEGEND)


def provenance(argv: list[str]) -> dict:
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()  # noqa
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown")
    return {"device": f"{cpu}, {os.cpu_count()} cores (router pinned to one)",
            "date": datetime.date.today().isoformat(), "commit": git("rev-parse", "HEAD"),
            "uncommitted_changes": git("status", "--porcelain", "--", "radixmesh", "benchmarks").splitlines(),
            "command": "python -m radixmesh.benchmarks.router " + shlex.join(argv), "python": sys.version.split()[0],
            "aiohttp": aiohttp.__version__}


def trace_delivery(procs: Processes) -> dict:
    """Spans the sink received (it prints the count on exit) and the routers' warnings of spans the SDK's queue
    dropped (it logs one per span)."""
    found = {}
    if "otlp_sink" in procs.procs:  # else the run failed before it started
        match = re.search(r"received (\d+) spans", procs.tail("otlp_sink", 200))
        found["spans_received"] = int(match.group(1)) if match else 0
    found["spans_dropped"] = sum((procs.log_dir / f"{name}.log").read_text(errors="replace").count("dropping span")
                                 for name in procs.procs if name.startswith("router"))
    return found


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=3000, help="measured requests per non-streaming scenario run")
    p.add_argument("--stream-requests", type=int, default=600, help="measured requests per streaming scenario run")
    p.add_argument("--warmup", type=int, default=64, help="unmeasured requests before each scenario")
    p.add_argument("--repeats", type=int, default=3, help="measured runs per scenario (the median is reported)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--scenarios", nargs="*", default=[s.name for s in SCENARIOS],
                   choices=[s.name for s in SCENARIOS])
    p.add_argument("--policy", default="cache_aware", help="the router's --policy")
    p.add_argument("--router-cpu", type=int, default=0, help="the core the router runs on")
    p.add_argument("--model-path", default="models/tiny-llama", help="tokenizer of the tokenizer service")
    p.add_argument("--router-tokenizes", action="store_true", help="text prompts are tokenized by the router "
                   "(through the tokenizer service), as with workers that have no tokenizer; default: the workers")
    p.add_argument("--enable-trace", action="store_true", help="the router exports OpenTelemetry traces to a local "
                   "OTLP/gRPC sink (benchmarks.otlp_sink, on the other cores)")
    p.add_argument("--trace-ab", action="store_true", help="routers with tracing on (same core, same fakes), one "
                   "per --trace-ratios, take turns with the untraced one, round by round in alternating order; "
                   "reports each one's median per-round CPU ratio to it (robust to the machine's speed drifting "
                   "between separate runs)")
    p.add_argument("--trace-ratios", nargs="+", default=["default", "1.0"], metavar="RATIO",
                   help="with --trace-ab: the traced routers' --trace-sample-ratio, one router each; `default` "
                   "gives none (what --enable-trace alone does)")
    p.add_argument("--pairs", type=int, default=1, help="with --trace-ab: this many router sets, one after another "
                   "(fresh processes each: a set carries its own luck of hashes and memory layout, which moved one "
                   "set's median by up to 3 points on a 2-vCPU VM); reports the median over every set's rounds and "
                   "each set's own")
    p.add_argument("--side-by-side", action="store_true", help="with --trace-ab: in each round all routers are "
                   "loaded at once (sharing their core) instead of in turn, and their CPU is read over the same "
                   "window: a drift in the machine's speed within a round falls on all")
    p.add_argument("--ab-control", action="store_true", help="with --trace-ab: the other routers untraced too (an "
                   "A/A run: the spread the method shows when there is no difference)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--router-args", nargs="*", default=[], metavar="FLAG",
                   help="more router flags, e.g. --router-args=--disable-generate-stream")
    p.add_argument("--profile-router", metavar="PATH", help="run the router under cProfile, stats to PATH (this "
                   "inflates its CPU time: use for where the time goes, not for the numbers)")
    return p.parse_args(argv)


def fake_tokenizes(args: argparse.Namespace) -> list[str]:
    """The fake workers' flag: they take text prompts, as workers with a tokenizer do, unless --router-tokenizes
    (text prompts then go through the tokenizer service, as with --skip-tokenizer-init workers). With a local
    --model-path they take chat prompts too, as workers that render that model's chat template do."""
    if getattr(args, "router_tokenizes", False):
        return []
    model = getattr(args, "model_path", None)  # the tokenizer service's model: its chat template
    return ["--tokenizes-text", *(["--chat-template-of", model] if model and os.path.isdir(model) else [])]


def run(args: argparse.Namespace, procs: Processes) -> list[dict]:
    cores = args.cores = getattr(args, "cores", None) or os.sched_getaffinity(0)  # before a first pair narrowed it
    others = cores - {args.router_cpu}
    if not others or args.router_cpu not in cores:
        raise SystemExit(f"need core {args.router_cpu} for the router and at least one other core")
    args.other_cores = len(others)
    os.sched_setaffinity(0, others)
    tok, workers = free_port(), [free_port(), free_port()]
    quiet = ["--log-level", "warning"]
    procs.start("tokenizer", ["radixmesh.services.tokenizer", "--model-path", args.model_path, "--port", str(tok),
                              *quiet], others)
    most = str(max(s.tokens for s in SCENARIOS))  # the fakes answer min(this, max_new_tokens) tokens
    for i, port in enumerate(workers):
        procs.start(f"worker{i}", ["radixmesh.benchmarks.fake_worker", "--port", str(port), "--tokens", most, *quiet,
                                   *fake_tokenizes(args)], others)
    profile = ["cProfile", "-o", str(Path(args.profile_router).resolve()), "-m"] if args.profile_router else []
    trace = []
    if args.enable_trace or args.trace_ab:
        sink = free_port()
        procs.start("otlp_sink", ["radixmesh.benchmarks.otlp_sink", "--port", str(sink)], others)
        trace = ["--enable-trace", "--otlp-traces-endpoint", f"127.0.0.1:{sink}"]
    common = ["--tokenizer-url", f"127.0.0.1:{tok}", "--policy", args.policy, *quiet, *args.router_args,
              "--worker-urls", *(f"127.0.0.1:{p}" for p in workers)]
    bases = {"router": start_router(procs, "router", [*profile, "radixmesh.services.router", *common,
                                                      *(trace if args.enable_trace else [])], args.router_cpu)}
    for ratio in args.trace_ratios if args.trace_ab else ():
        flags = [] if args.ab_control else [*trace, *(["--trace-sample-ratio", ratio] if ratio != "default" else [])]
        bases[traced_name(ratio)] = start_router(procs, traced_name(ratio), ["radixmesh.services.router", *common,
                                                 *flags], args.router_cpu)
    pids = {name: p.pid for name, p in procs.procs.items()}
    results = []
    for n, sc in enumerate(s for s in SCENARIOS if s.name in args.scenarios):
        if args.trace_ab:
            results.append(measure_ab(bases, sc, args, pids, offset=n * 1_000_000))
        else:
            results.append(measure(bases["router"], sc, args, pids, offset=n * 1_000_000))
        procs.check_alive()
    args.router_rss_mb = rss_mb(pids["router"])
    if not args.trace_ab:
        add_marginals(results)
    return results


def traced_name(ratio: str) -> str:
    """The name of the traced router at --trace-sample-ratio `ratio` ("default": none given)."""
    return f"router_traced_{ratio}"


def start_router(procs: Processes, name: str, argv: list[str], cpu: int) -> str:
    """A router on a free port, pinned to `cpu`, once its workers are healthy; returns its base URL."""
    base = f"http://127.0.0.1:{(port := free_port())}"
    procs.start(name, [*argv, "--host", "127.0.0.1", "--port", str(port)], {cpu})
    wait_http(base + "/health", procs, timeout_s=120)
    with urllib.request.urlopen(base + "/health_generate", timeout=30) as r:
        workers = json.loads(r.read())["workers"]
    if not all(w["healthy"] for w in workers):
        raise RuntimeError(f"{name} has unhealthy workers: {workers}")
    return base


def measure_ab(bases: dict[str, str], sc: Scenario, args, pids: dict[str, int], offset: int) -> dict:
    """The untraced router and the traced ones take turns (order alternating per round) or, --side-by-side, are
    loaded at once, so a drift in the machine's speed falls on all; each traced router's change is the median of
    its per-round CPU ratios to the untraced one's (`traced`: by --trace-ratios)."""
    count = args.stream_requests if sc.stream else args.requests
    for base in bases.values():
        asyncio.run(run_load(base, sc, min(args.warmup, count), args.concurrency, offset))
    rounds: list[dict] = []
    for k in range(args.repeats):
        if args.side_by_side:
            rounds.append(measure_together(bases, sc, args, pids, count, offset + (len(bases) * k + 1) * count))
            continue
        runs = {}
        for j, name in enumerate(list(bases)[::1 if k % 2 == 0 else -1]):
            own = {n: p for n, p in pids.items() if n not in bases or n == name}
            own["router"] = own.pop(name)
            runs[name] = measure_once(bases[name], sc, args, own, count, offset + (len(bases) * k + j + 1) * count)
        rounds.append(runs)
    off = [r["router"]["router_cpu_ms_per_request"] for r in rounds]
    traced = {ratio: _traced_change(off, [r[traced_name(ratio)]["router_cpu_ms_per_request"] for r in rounds])
              for ratio in args.trace_ratios}
    return {"scenario": sc.name, "description": sc.description, "requests": count, "rounds": args.repeats,
            "side_by_side": args.side_by_side, "cpu_ms_per_request_off": statistics.median(off), "traced": traced,
            "errors": sum(r[n]["errors"] for r in rounds for n in bases),
            "error_examples": [e for r in rounds for n in bases for e in r[n]["error_examples"]][:3],
            "rounds_cpu_ms_per_request": [[round(r[n]["router_cpu_ms_per_request"], 4) for n in bases]
                                          for r in rounds],
            "threads_cpu_s": {n: _summed(r[n].get("threads_cpu_s", {}) for r in rounds) for n in bases}}


def _summed(parts) -> dict[str, float]:
    """Per-thread CPU seconds of several rounds added up."""
    out: dict[str, float] = {}
    for part in parts:
        for name, value in part.items():
            out[name] = round(out.get(name, 0.0) + value, 2)
    return out


def _traced_change(off: list[float], on: list[float]) -> dict:
    """A traced router's CPU per request against the untraced one's, round by round."""
    return _change([b / a for a, b in zip(off, on)], statistics.median(on))


def _change(ratios: list[float], cpu_on: float) -> dict:
    ratio = statistics.median(ratios)
    return {"cpu_ms_per_request_on": cpu_on, "on_over_off_median_ratio": ratio, "cpu_change_pct": (ratio - 1) * 100,
            "capacity_change_pct": (1 / ratio - 1) * 100, "rounds_ratio": ratios}


def measure_together(bases: dict[str, str], sc: Scenario, args, pids: dict[str, int], count: int,
                     offset: int) -> dict:
    """One round of --side-by-side: every router (they share one core) loaded at once by clients of its own, each
    router's CPU read over the same window, so the machine's speed in that window falls on all alike. Returns, per
    router, the CPU fields measure_ab reads and its load's results (the wall time is the loads' together)."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    threads = {name: thread_cpu_seconds(pids[name]) for name in bases}
    t0 = time.perf_counter()

    async def together() -> list[dict]:
        return await asyncio.gather(*(run_load(base, sc, count, args.concurrency, offset + j * count)
                                      for j, base in enumerate(bases.values())))

    loads = dict(zip(bases, asyncio.run(together())))
    wall = time.perf_counter() - t0
    used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    for name in bases:
        after = thread_cpu_seconds(pids[name])
        threads[name] = {t: round(after[t] - threads[name].get(t, 0.0), 2) for t in after}
    return {name: {**router_cpu_fields(used[name], count, wall), "router_cpu_utilization": used[name] / wall,
                   "threads_cpu_s": threads[name], **loads[name]} for name in bases}


def pooled(sets: list[list[dict]]) -> list[dict]:
    """The results of several router sets (measure_ab's, scenario by scenario) as one: medians over all their
    rounds' ratios, with each set's own capacity changes and its results kept."""
    out = []
    for runs in zip(*sets):
        traced = {ratio: {**_change([x for r in runs for x in r["traced"][ratio]["rounds_ratio"]],
                                    statistics.median(r["traced"][ratio]["cpu_ms_per_request_on"] for r in runs)),
                          "per_set_cpu_change_pct": [round(r["traced"][ratio]["cpu_change_pct"], 2) for r in runs]}
                  for ratio in runs[0]["traced"]}
        out.append({"scenario": runs[0]["scenario"], "description": runs[0]["description"],
                    "requests": runs[0]["requests"], "rounds": sum(r["rounds"] for r in runs), "sets": len(runs),
                    "cpu_ms_per_request_off": statistics.median(r["cpu_ms_per_request_off"] for r in runs),
                    "traced": traced, "errors": sum(r["errors"] for r in runs),
                    "error_examples": [e for r in runs for e in r["error_examples"]][:3], "per_set": list(runs)})
    return out


@contextlib.contextmanager
def process_group(prefix: str, after_close=None):
    """Processes (logs in a temporary folder) for one benchmark setting: their log tails printed if it fails,
    all stopped at the end; then `after_close(procs)`, while their logs are still there."""
    with tempfile.TemporaryDirectory(prefix=prefix) as logs:
        procs = Processes(Path(logs))
        try:
            yield procs
        except Exception:
            for name in procs.procs:
                print(f"--- {name} log ---\n{procs.tail(name)}", file=sys.stderr)
            raise
        finally:
            procs.close()
            if after_close is not None:
                after_close(procs)


def print_traced(r: dict) -> None:
    """One line per traced router of a --trace-ab scenario: its CPU per request against the untraced router's."""
    for ratio, t in r["traced"].items():
        per_set = f" over {r['sets']} router sets: {t['per_set_cpu_change_pct']}" if "sets" in r else ""
        print(f"{r['scenario']}, ratio {ratio}: router CPU {r['cpu_ms_per_request_off']:.4f} -> "
              f"{t['cpu_ms_per_request_on']:.4f} ms/request, {t['cpu_change_pct']:+.2f}% (capacity "
              f"{t['capacity_change_pct']:+.1f}%; median of {r['rounds']} paired rounds{per_set})")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally below stops the children

    def read_delivery(procs: Processes) -> None:
        args.trace_delivery = trace_delivery(procs) if args.enable_trace or args.trace_ab else None

    pairs = []
    for _ in range(args.pairs if args.trace_ab else 1):
        with process_group("bench-router-", after_close=read_delivery) as procs:
            pairs.append(run(args, procs))
    results = pairs[0] if len(pairs) == 1 else pooled(pairs)
    if args.trace_ab:
        for r in results:
            print_traced(r)
    else:
        print_table(results)
    doc = {**provenance(argv), "router_rss_mb": round(args.router_rss_mb, 1), "results": results}
    if args.trace_delivery is not None:
        doc["trace_delivery"] = args.trace_delivery
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    failed = [(r["scenario"], r["errors"], r["error_examples"]) for r in results if r["errors"]]
    if failed:
        print(f"FAILED: responses with errors: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
