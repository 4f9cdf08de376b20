"""`python -m radixmesh.benchmarks.soak`: a soak test of the launched mesh under a mixed load, watching for leaks.

    python -m radixmesh.benchmarks.soak --duration 30m       # launches 2 colocated workers on models/tiny-qwen2, CPU
    python -m radixmesh.benchmarks.soak --duration 90s --sample-interval 10s --concurrency 16 \
        --launch-args='--policy random'
    python -m radixmesh.benchmarks.soak --url http://127.0.0.1:30000 --api-key KEY --duration 10m   # a running mesh

By default it starts `python -m radixmesh.services.launch serve --model-path models/tiny-qwen2 --num-workers 2 --device
cpu` on a free loopback port with a random --api-key (--launch-args adds launcher flags), warms up (--warmup-requests of
every kind, then the full load for --warmup-time, so that the allocators' pools reach their working size before the
clock starts), then runs --concurrency closed-loop clients for --duration, each drawing request kinds by --mix (see
benchmarks.soak_load: streamed chat, completions, long prompts near the context limit, client-side aborts, structured
outputs validated against their JSON schema, /generate). With --url it drives a running mesh; its processes are
found through the process listening on the URL's port (or --launcher-pid), else only the requests are checked.

Every --sample-interval (from t=0, once warm) it records per service process RSS (VmRSS), open fds and threads
(benchmarks.soak_probe), per worker the KV tokens held by requests (/get_server_info: the pool less free and
evictable tokens, what sglang:num_used_tokens reports), and for the requests finished in that interval their count,
errors by kind and category, and latency percentiles. When the load stops, it waits (--drain-timeout) for every
in-flight request to end and every worker to be idle with no KV held, samples once more, then (unless --no-flush)
calls /flush_cache and checks that every worker's free KV equals its pool.

The run FAILS (exit status 1) when any of these holds:
- any request failed (HTTP error, timeout, connection error, broken stream), warm-up included;
- any output was invalid (structured output not parsing or not validating against its schema, counts that do not
  match the request, a finished request without a finish reason);
- after the drain a worker still holds KV tokens, or (flushed) its free KV is not its whole pool;
- for any service process, with the samples taken under load (t > 0; the t=0 one is taken idle, between warm-up
  and load) split in thirds: the median RSS of the last third exceeds the median of the first by more than
  max(--max-rss-growth-mib, --max-rss-growth-pct % of that first median) (RSS may settle during warm-up and the
  first third, so it is compared with the last third's level, not with the start); or the median open-fd count of
  the last third exceeds the first's by more than --max-fd-growth (fds should be flat: connections come and go with
  the clients, nothing should accumulate). RSS is judged only when the samples under load span --min-rss-span
  (default 10 minutes): over a shorter run the workers' RSS is still settling (~+25 MiB in a 20 s run), which
  says nothing about a leak;
- a service process died or was replaced during the run, or the launcher did not exit cleanly when stopped.
Exit status 2: bad flags, or the mesh did not start. The JSON (--out, default benchmarks/results/<date>-soak-<dur>.json)
holds the config, the samples, the drain sample (`final`), totals, the checks and the failures."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import re
import secrets
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import aiohttp

from radixmesh.benchmarks import soak_probe
from radixmesh.benchmarks.serving import _Parser, provenance
from radixmesh.benchmarks.serving_backends import REPO, BenchError, LaunchedMesh, describe_device
from radixmesh.benchmarks.soak_load import DEFAULT_MIX, Client, Outcome, Tally, Target, parse_mix
from radixmesh.benchmarks.soak_report import growth, summary, verdict

PROG = "python -m radixmesh.benchmarks.soak"
MAX_ERRORS_KEPT = 50
_UNITS = {"s": 1, "m": 60, "h": 3600}


def parse_duration(text: str) -> float:
    """"90s", "30m", "1h30m", "45" (seconds) -> seconds; ValueError otherwise."""
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?", text.strip())
    if not parts or not any(parts.groups()):
        raise ValueError(f"not a duration: {text!r} (e.g. 90s, 30m, 1h)")
    h, m, s = (float(g or 0) for g in parts.groups())
    return h * 3600 + m * 60 + s


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--duration", default="30m", help="load time, e.g. 90s, 30m, 1h (default 30m)")
    p.add_argument("--sample-interval", default="60s", help="time between samples (default 60s)")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop clients (default 8)")
    p.add_argument("--mix", default=DEFAULT_MIX, help=f"request kinds and weights (default {DEFAULT_MIX})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-requests", type=int, default=2, help="requests of every kind before the clock starts")
    p.add_argument("--warmup-time", default="60s", help="then the full load for this long, unmeasured (default 60s)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds one request may take")
    p.add_argument("--drain-timeout", type=float, default=60.0, help="seconds the workers get to become idle")
    p.add_argument("--max-rss-growth-mib", type=float, default=24.0)
    p.add_argument("--max-rss-growth-pct", type=float, default=5.0)
    p.add_argument("--max-fd-growth", type=int, default=4)
    p.add_argument("--min-rss-span", default="10m", help="judge RSS growth only when the samples under load span at "
                   "least this long (default 10m: shorter runs' RSS is still settling); fds are always judged")
    p.add_argument("--out", help="result JSON (default benchmarks/results/<date>-soak-<duration>.json)")
    p.add_argument("--url", help="drive a running mesh at this URL instead of launching one")
    p.add_argument("--api-key", help="with --url: its API key (default $OPENAI_API_KEY)")
    p.add_argument("--launcher-pid", type=int, help="with --url: the launcher whose services to sample")
    p.add_argument("--no-flush", action="store_true", help="skip /flush_cache and the free-pool check at the end")
    p.add_argument("--model-path", default="models/tiny-qwen2", help="launched mesh: the model")
    p.add_argument("--num-workers", type=int, default=2, help="launched mesh: colocated workers")
    p.add_argument("--device", default="cpu", help="launched mesh: the workers' device")
    p.add_argument("--launch-args", default="", help="more launcher flags, one string: --launch-args='--page-size 16'")
    p.add_argument("--launch-timeout", type=float, default=600.0, help="seconds the mesh may take to start")
    p.add_argument("--mesh-log", help="keep the launched mesh's log here (default: a temporary file)")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.duration_s = parse_duration(args.duration)
        args.interval_s = parse_duration(args.sample_interval)
        args.warmup_s = parse_duration(args.warmup_time)
        args.min_rss_span_s = parse_duration(args.min_rss_span)
        args.weights = parse_mix(args.mix)
    except ValueError as e:
        p.error(str(e))
    if args.duration_s <= 0 or args.interval_s <= 0 or args.concurrency < 1 or args.warmup_requests < 0:
        p.error("--duration, --sample-interval and --concurrency must be positive, --warmup-requests not negative")
    if args.url and (args.launch_args or args.mesh_log):
        p.error("--url drives a running mesh: --launch-args and --mesh-log are for the one this starts")
    if args.out is None:
        args.out = str(REPO / "benchmarks" / "results" / f"{datetime.date.today()}-soak-{args.duration}.json")
    return args


class Soak:
    """One run's state: the target, the clients' outcomes (this interval and overall), the samples."""

    def __init__(self, args: argparse.Namespace, session: aiohttp.ClientSession, base_url: str, launcher: int | None):
        self.args, self.session, self.base_url, self.launcher = args, session, base_url, launcher
        self.window, self.total, self.warmup = Tally(), Tally(), Tally()
        self.errors: list[dict] = []
        self.samples: list[dict] = []
        self.t0 = time.monotonic()

    async def target(self) -> Target:
        async with self.session.get(self.base_url + "/get_model_info") as resp:
            if resp.status != 200:
                raise BenchError(f"GET /get_model_info answered HTTP {resp.status}: {(await resp.text())[:300]}")
            info = await resp.json()
        return Target(self.base_url, info.get("served_model_name") or info["model_path"],
                      info["max_context_length"], info["vocab_size"], self.args.request_timeout)

    def record(self, o: Outcome, warm: bool = False) -> None:
        for tally in ((self.warmup,) if warm else (self.window, self.total)):
            tally.add(o)
        if o.error and len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append({"t_s": round(time.monotonic() - self.t0, 1), "kind": o.kind, "error": o.error,
                                "detail": o.detail, "warmup": warm})

    async def kv(self) -> list[dict] | dict:
        try:
            return await soak_probe.worker_kv(self.session, self.base_url)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            return {"error": f"{type(e).__name__}: {e}"}

    async def sample(self) -> dict:
        names = soak_probe.services(self.launcher) if self.launcher else {}
        procs = {n: soak_probe.process_stats(pid) for n, pid in names.items()}
        requests, self.window = self.window.report(), Tally()
        return {"t_s": round(time.monotonic() - self.t0, 1), "procs": procs, "kv": await self.kv(),
                "requests": requests}

    async def client_loop(self, client: Client, rng: random.Random, deadline: float, warm: bool = False) -> None:
        kinds, weights = list(self.args.weights), list(self.args.weights.values())
        while time.monotonic() < deadline:
            self.record(await client.run(rng.choices(kinds, weights)[0]), warm)

    async def sampler(self, deadline: float) -> None:
        k = 1
        while (at := self.t0 + k * self.args.interval_s) <= deadline + 1e-6:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            self.samples.append(await self.sample())
            print(f"[soak] t={self.samples[-1]['t_s']:.0f}s {_line(self.samples[-1])}", flush=True)
            k += 1

    async def drain(self) -> tuple[bool, float, list | dict]:
        """Waits until every worker is idle and holds no KV (or --drain-timeout); (drained, seconds, last KV)."""
        start = time.monotonic()
        while True:
            kv = await self.kv()
            idle = isinstance(kv, list) and bool(kv) and all(
                "error" not in w and w["used_tokens"] == 0 and w["running"] == 0 and w["waiting"] == 0 for w in kv)
            waited = time.monotonic() - start
            if idle or waited > self.args.drain_timeout:
                return idle, round(waited, 1), kv
            await asyncio.sleep(0.5)

    async def flush_check(self) -> tuple[bool | None, list | dict | None]:
        """/flush_cache (retried while requests are in flight), then whether every worker's KV is all free."""
        if self.args.no_flush:
            return None, None
        for _ in range(10):
            async with self.session.post(self.base_url + "/flush_cache") as resp:
                await resp.read()
            if resp.status == 200:
                break
            await asyncio.sleep(1.0)
        else:
            return False, {"error": f"/flush_cache answered HTTP {resp.status}"}
        kv = await self.kv()
        ok = isinstance(kv, list) and bool(kv) and all("error" not in w and w["used_tokens"] == 0 for w in kv)
        return ok, kv


def _line(s: dict) -> str:
    r = s["requests"]
    kv = "/".join(str(w.get("used_tokens", "?")) for w in s["kv"]) if isinstance(s["kv"], list) else s["kv"]
    rss = " ".join(f"{n}={p['rss_mib']:.0f}M/{p['fds']}fd" for n, p in s["procs"].items() if p)
    return f"requests {r['requests']} failed {r['failed']} p50 {r['latency_ms']['p50']} ms; kv used {kv}; {rss}"


async def run(args: argparse.Namespace, base_url: str, api_key: str | None, launcher: int | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as session:
        soak = Soak(args, session, base_url, launcher)
        try:
            target = await soak.target()
        except (aiohttp.ClientError, OSError) as e:
            raise BenchError(f"cannot reach the mesh at {base_url}: {e}") from None
        prefix_rng = random.Random(args.seed)
        prefix = [prefix_rng.randrange(3, target.vocab_size) for _ in range(target.context_length // 2)]
        rngs = [random.Random(args.seed * 1000 + i + 1) for i in range(args.concurrency)]
        clients = [Client(session, target, rng, prefix) for rng in rngs]
        warm = [k for k, w in args.weights.items() if w > 0] * args.warmup_requests
        for o in await asyncio.gather(*(clients[i % len(clients)].run(k) for i, k in enumerate(warm))):
            soak.record(o, warm=True)
        warm_until = time.monotonic() + args.warmup_s
        await asyncio.gather(*(soak.client_loop(c, r, warm_until, warm=True) for c, r in zip(clients, rngs)))
        soak.t0 = time.monotonic()
        soak.samples.append(await soak.sample())
        deadline = soak.t0 + args.duration_s
        sampler = asyncio.create_task(soak.sampler(deadline))
        await asyncio.gather(*(soak.client_loop(c, r, deadline) for c, r in zip(clients, rngs)))
        await sampler
        drained, drain_s, drain_kv = await soak.drain()
        final = await soak.sample()
        flushed, flush_kv = await soak.flush_check()
    first, last = soak.samples[0]["procs"], final["procs"]
    restarted = sorted(n for n, p in first.items() if p and (not last.get(n) or last[n]["pid"] != p["pid"]))
    return {"target": {"model": target.model, "context_length": target.context_length},
            "samples": soak.samples, "final": final, "totals": soak.total.report(), "warmup": soak.warmup.report(),
            "errors": soak.errors,
            "checks": {"kv_drained": drained, "drain_s": drain_s, "kv_after_drain": drain_kv,
                       "kv_free_after_flush": flushed, "kv_after_flush": flush_kv, "restarted": restarted,
                       "growth": growth(soak.samples[1:], args.max_rss_growth_mib, args.max_rss_growth_pct,
                                        args.max_fd_growth, args.min_rss_span_s)}}


def _launch(args: argparse.Namespace, log_dir: str) -> tuple[LaunchedMesh, str, list[str]]:
    from radixmesh.services.launch import free_port

    port, key = free_port(), "sk-soak-" + secrets.token_hex(8)
    argv = ["--model-path", args.model_path, "--num-workers", str(args.num_workers), "--device", args.device,
            "--host", "127.0.0.1", "--port", str(port), "--api-key", key, *shlex.split(args.launch_args)]
    log = Path(args.mesh_log) if args.mesh_log else Path(log_dir) / "mesh.log"
    mesh = LaunchedMesh(argv, f"http://127.0.0.1:{port}", log)
    mesh.start(args.launch_timeout)
    return mesh, key, [a if a != key else "<random>" for a in argv]


def _running_launcher(args: argparse.Namespace) -> int | None:
    if args.launcher_pid:
        return args.launcher_pid
    url = urlparse(args.url)
    if url.hostname not in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
        return None
    router = soak_probe.listening_pid(url.port or (443 if url.scheme == "https" else 80))
    return soak_probe.launcher_of(router) if router else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs the finally below: the mesh is stopped
    mesh, launch_argv, status = None, None, None
    try:
        with tempfile.TemporaryDirectory(prefix="bench-soak-") as logs:
            try:
                if args.url:
                    base_url, key = args.url.rstrip("/"), args.api_key or os.environ.get("OPENAI_API_KEY")
                    launcher = _running_launcher(args)
                else:
                    mesh, key, launch_argv = _launch(args, logs)
                    base_url, launcher = mesh.base_url, mesh.proc.pid
                result = asyncio.run(run(args, base_url, key, launcher))
            finally:
                if mesh is not None:
                    mesh.stop()
                    status = mesh.proc.returncode
            tail = mesh.log_tail(40) if mesh is not None else None
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    result["checks"]["mesh_exit_status"] = status
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "weights")}
    result = {"bench": "soak", "config": {**config, "base_url": base_url, "weights": args.weights,
                                          "launch_argv": launch_argv, "launcher_pid_sampled": launcher},
              "device": describe_device(args.device) if mesh is not None else None, **provenance(argv),
              "command": f"{PROG} {shlex.join(argv)}".strip(), **result}
    result["failures"] = verdict(result)
    result["passed"] = not result["failures"]
    if result["failures"] and tail:
        result["mesh_log_tail"] = tail.splitlines()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(summary(result))
    print(f"result: {args.out}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
