"""Where a launched mesh's requests are, over time: polls the Prometheus endpoints that `radixmesh serve
--enable-metrics --metrics-sd-file FILE` lists and records, every --interval seconds, the calls the router has in
flight to its workers and, per worker, the requests its servicer holds, those queued in its scheduler and those
running. Under load these say where a request waits before its prefill: at the router (in flight minus held), in the
worker before the scheduler (held minus queued minus running) or in the scheduler's queue.

    python -m radixmesh.benchmarks.load_timeline --targets targets.json --output load.jsonl &
    ... load the mesh ...
    kill -INT %1     # prints the summary over the samples with requests in flight
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

ROUTER = {"sgl_router_running_requests": "in_flight"}
WORKER = {"radixmesh:worker_active_requests": "held", "sglang:num_queue_reqs": "queued",
          "sglang:num_running_reqs": "running"}


def read_targets(path: str) -> dict[str, str]:
    """service name -> host:port, from a Prometheus file_sd file."""
    with open(path) as f:
        return {g["labels"]["service"]: g["targets"][0] for g in json.load(f)}


def scrape(target: str, wanted: dict[str, str], timeout_s: float = 2.0) -> dict[str, float]:
    """The sum of each wanted sample (over its labels) at http://target/metrics, by short name."""
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    got: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted:
                got[wanted[s.name]] = got.get(wanted[s.name], 0.0) + s.value
    return got


def sample(targets: dict[str, str]) -> dict:
    row: dict = {"t": time.time()}
    for name, target in targets.items():
        if name.startswith("router"):
            row.update({k: row.get(k, 0.0) + v for k, v in scrape(target, ROUTER).items()})
        elif name.startswith(("worker", "prefill", "decode")):
            row[name] = scrape(target, WORKER)
    return row


def summary(rows: list[dict]) -> dict:
    """Mean and max of each quantity over the samples with calls in flight."""
    busy = [r for r in rows if r.get("in_flight", 0) > 0]
    out: dict = {"samples": len(rows), "busy_samples": len(busy)}
    if not busy:
        return out
    keys = {"in_flight": [r["in_flight"] for r in busy]}
    for r in busy:
        for name, w in r.items():
            if isinstance(w, dict):
                for k, v in w.items():
                    keys.setdefault(f"{name}.{k}", []).append(v)
                waiting = w.get("held", 0) - w.get("queued", 0) - w.get("running", 0)
                keys.setdefault(f"{name}.before_scheduler", []).append(waiting)
    for k, vs in keys.items():
        out[k] = {"mean": round(sum(vs) / len(vs), 1), "max": max(vs)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", required=True, help="the launcher's --metrics-sd-file")
    p.add_argument("--interval", type=float, default=0.25)
    p.add_argument("--output", help="append one JSON line per sample here")
    args = p.parse_args(argv)
    targets = read_targets(args.targets)
    rows: list[dict] = []
    stop = []
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    out = open(args.output, "a") if args.output else None
    try:
        while not stop:
            try:
                row = sample(targets)
            except OSError as e:  # a service restarting or gone: the next sample tries again
                print(f"load_timeline: {e}", file=sys.stderr)
            else:
                rows.append(row)
                if out is not None:
                    out.write(json.dumps(row) + "\n")
            time.sleep(args.interval)
    finally:
        if out is not None:
            out.close()
    print(json.dumps(summary(rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
