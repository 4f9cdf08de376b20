"""Read a worker's step timeline (a Chrome trace written under RADIXMESH_TORCH_PROFILE, engine/profiling.py): one
line per scheduler step with its forward, its host time, and the GPU work its launches queued, by kind (GEMMs,
attention, KV copies by kernel, memcpys by direction, the rest), plus the GPU's idle time inside the window.

    python -m radixmesh.benchmarks.timeline TRACE.json.gz [--steps extend|all] [--json OUT]

A GPU event belongs to the step whose host range holds the launch (CUDA runtime call) that queued it, through the
trace's correlation ids; work queued by another thread (the hierarchy's copy thread, NCCL) is "other thread".
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json

KINDS = (  # first match wins; names are lowercased
    ("gemm", ("gemm", "gemv", "nvjet", "sm90_xmma", "cutlass", "cublas")),
    ("attention", ("extend_kernel", "decode_stage", "attn", "attention", "flashinfer", "batchprefill",
                   "batchdecode", "mergestate")),
    ("kv_pages", ("kv_pages",)),
    ("kv_store", ("store_kv", "rotary")),
    ("norm", ("rmsnorm",)),
    ("act", ("silu",)),
    ("index", ("index", "scatter", "gather")),
)


def kind_of(event: dict) -> str:
    cat = event.get("cat", "")
    name = event.get("name", "").lower()
    if cat == "gpu_memcpy":
        for d in ("htod", "dtoh", "dtod"):
            if d in name:
                return "memcpy_" + d
        return "memcpy"
    if cat == "gpu_memset":
        return "memset"
    for kind, keys in KINDS:
        if any(k in name for k in keys):
            return kind
    return "other"


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return [e for e in data["traceEvents"] if e.get("ph") == "X"]


def analyse(events: list[dict]) -> dict:
    steps = sorted((e for e in events if e.get("name") == "scheduler.step" and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    forwards = [e for e in events if e.get("cat") == "user_annotation"
                and e.get("name", "").startswith(("extend ", "decode "))]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}

    def step_of(ts: float, tid) -> int | None:
        lo, hi = 0, len(steps) - 1
        while lo <= hi:  # the last step starting at or before ts
            mid = (lo + hi) // 2
            if steps[mid]["ts"] <= ts:
                lo = mid + 1
            else:
                hi = mid - 1
        if hi >= 0 and steps[hi]["tid"] == tid and ts <= steps[hi]["ts"] + steps[hi]["dur"]:
            return hi
        return None

    rows = [{"step": i, "host_us": s["dur"], "forward": "", "gpu_us": collections.Counter(), "spans": [],
             "calls": collections.Counter(), "calls_us": collections.Counter()} for i, s in enumerate(steps)]
    for r in runtime.values():  # the CUDA API calls each step made on the host, and their host time
        i = step_of(r["ts"], r["tid"])
        if i is not None:
            rows[i]["calls"][r["name"]] += 1
            rows[i]["calls_us"][r["name"]] += r["dur"]
    for f in forwards:
        i = step_of(f["ts"], f["tid"])
        if i is not None:
            rows[i]["forward"] = f["name"]
    other = {"gpu_us": collections.Counter(), "spans": []}
    for g in gpu:
        launch = runtime.get(g.get("args", {}).get("correlation"))
        i = step_of(launch["ts"], launch["tid"]) if launch is not None else None
        row = rows[i] if i is not None else other
        row["gpu_us"][kind_of(g)] += g["dur"]
        row["spans"].append((g["ts"], g["ts"] + g["dur"]))
    for row in rows + [other]:
        spans = row.pop("spans")
        for key in ("calls", "calls_us"):
            row[key] = collections.Counter(row.get(key, ()))
        row["gpu_busy_us"] = _union(spans)
        row["gpu_first"] = min((a for a, _ in spans), default=None)
        row["gpu_last"] = max((b for _, b in spans), default=None)
        row["gpu_us"] = dict(row["gpu_us"])
        row["gpu_span_us"] = row["gpu_last"] - row["gpu_first"] if spans else 0.0
    all_spans = [(g["ts"], g["ts"] + g["dur"]) for g in gpu]
    window = (steps[-1]["ts"] + steps[-1]["dur"] - steps[0]["ts"]) if steps else 0.0
    busy = _union(all_spans)
    totals = collections.Counter()
    for g in gpu:
        totals[kind_of(g)] += g["dur"]
    return {"steps": rows, "other_thread": other, "window_us": window, "gpu_busy_us": busy,
            "gpu_span_us": (max(b for _, b in all_spans) - min(a for a, _ in all_spans)) if all_spans else 0.0,
            "gpu_us_by_kind": dict(totals)}


def _fmt(row: dict) -> str:
    kinds = " ".join(f"{k}={v / 1e3:.2f}" for k, v in sorted(row["gpu_us"].items(), key=lambda kv: -kv[1]))
    calls = " ".join(f"{k}x{n}/{row['calls_us'][k] / 1e3:.1f}ms" for k, n in row["calls"].most_common(3))
    return (f"step {row['step']:4d} host {row['host_us'] / 1e3:7.2f} ms  gpu busy {row['gpu_busy_us'] / 1e3:7.2f} ms"
            f" span {row['gpu_span_us'] / 1e3:7.2f} ms  {row['forward'] or '(no forward)':28s} {kinds}  [{calls}]")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--steps", choices=["extend", "all"], default="extend",
                   help="which steps get a line: those with an extend forward (and the step after each), or all")
    p.add_argument("--json", help="write the whole analysis here")
    args = p.parse_args(argv)
    res = analyse(load(args.trace))
    rows = res["steps"]
    shown = set(range(len(rows))) if args.steps == "all" else \
        {j for i, r in enumerate(rows) if r["forward"].startswith("extend") for j in (i, i + 1)}
    decode = [r for r in rows if r["forward"].startswith("decode")]
    for i in sorted(shown):
        if i < len(rows):
            print(_fmt(rows[i]))
    if decode:
        n = len(decode)
        print(f"decode steps: {n}, mean host {sum(r['host_us'] for r in decode) / n / 1e3:.2f} ms, "
              f"mean gpu busy {sum(r['gpu_busy_us'] for r in decode) / n / 1e3:.2f} ms")
    o = res["other_thread"]
    print(f"other threads' GPU work: busy {o['gpu_busy_us'] / 1e3:.2f} ms "
          + " ".join(f"{k}={v / 1e3:.2f}" for k, v in o["gpu_us"].items()))
    print(f"window {res['window_us'] / 1e3:.1f} ms (host), GPU span {res['gpu_span_us'] / 1e3:.1f} ms, "
          f"busy {res['gpu_busy_us'] / 1e3:.1f} ms; by kind (ms): "
          + " ".join(f"{k}={v / 1e3:.1f}" for k, v in sorted(res["gpu_us_by_kind"].items(), key=lambda kv: -kv[1])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
