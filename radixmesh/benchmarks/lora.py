"""Multi-LoRA decode cost (issue 54) through the public Engine API: milliseconds per output token of a batch of
requests decoding together, on an engine with --enable-lora serving 0 (the base model only), 1 or N distinct
adapters in the batch, against the same engine without --enable-lora.

    python -m radixmesh.benchmarks.lora --model-path build/llama-3.1-8b --engine-args '{"load_format": "dummy"}' \\
        --out benchmarks/results/<date>-<device>-lora.json

It writes its own random rank-16 adapters in peft's format (adapter_config.json, adapter_model.safetensors) for all
seven projections of the model (no peft needed), loaded with --lora-paths. For each batch size B (--batch-sizes) and
adapter count A (--adapters, at most B), B requests of --input-len random tokens each decode --output-len tokens
(ignore_eos) in one streamed call, request i running adapter i mod A; the ms per token is the time of the window
in which every request is decoding (prefills excluded) over the steps in it, the best of --repeats runs. `overhead`
is a LoRA figure over the base engine's at the same B, less 1. The issue's goal: A = 8 costs at most 15% over the
base step at B = 64 (`goal_met`; exit status 1 when it is not). Adapter placements and evictions are reported from
the engine's LoRA manager (none should happen while measuring: every adapter fits in a device slot).
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from radixmesh.engine import Engine
from radixmesh.engine.lora.adapter import PROJECTIONS, projection_shapes
from radixmesh.engine.model_config import ModelConfig

GOAL_BATCH, GOAL_ADAPTERS, GOAL_OVERHEAD = 64, 8, 0.15


def write_adapter(out: Path, cfg: ModelConfig, rank: int, seed: int) -> str:
    """A random peft LoRA adapter of `rank` for every projection of every layer of `cfg` (bfloat16 weights,
    lora_alpha = 2 * rank), in directory `out`."""
    gen = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(cfg)
    tensors = {}
    for layer in range(cfg.num_layers):
        for proj, block in PROJECTIONS.items():
            fan_in, fan_out = shapes[proj]
            key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * fan_in ** -0.5).bfloat16()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.02).bfloat16()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS),
              "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return str(out)


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (length,), generator=gen).tolist() for _ in range(count)]


def decode_ms(engine: Engine, batch: list[list[int]], names: list[str | None], new_tokens: int,
              window=None) -> float:
    """ms per decode step of `batch` run as one streamed call: over the window in which every request is decoding
    (from the last first token to the first last token), its length over the tokens a request received in it (the
    median over the requests; every request decodes one token a step). `window` (a profiler): started when every
    request has its first token and stopped when the first one ends, so that it holds decode steps only."""
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    arrivals: dict[int, list[tuple[float, int]]] = {}  # request -> (time, tokens received by then)
    lora = names if any(n is not None for n in names) else None
    state = "before"
    for out in engine.generate(input_ids=batch, sampling_params=params, lora_path=lora, stream=True):
        now, n = time.perf_counter(), len(out["output_ids"])
        seen = arrivals.setdefault(out["index"], [])
        if n and (not seen or n > seen[-1][1]):
            seen.append((now, n))
        if window is not None and state == "before" and len(arrivals) == len(batch) and all(arrivals.values()):
            window.start()
            state = "open"
        elif window is not None and state == "open" and n >= new_tokens:
            window.stop()
            state = "closed"
    if state == "open":
        window.stop()
    if len(arrivals) != len(batch):
        raise RuntimeError(f"{len(batch) - len(arrivals)} requests produced no token")
    start = max(seen[0][0] for seen in arrivals.values())
    end = min(seen[-1][0] for seen in arrivals.values())

    def received(seen: list[tuple[float, int]], t: float) -> int:
        return seen[bisect.bisect_right([a for a, _ in seen], t) - 1][1]

    steps = statistics.median(received(seen, end) - received(seen, start) for seen in arrivals.values())
    if steps < 1:
        raise RuntimeError("no decode step ran while every request was decoding: raise --output-len")
    return (end - start) * 1e3 / steps


def measure(engine: Engine, batch_size: int, adapters: list[str | None], ns: argparse.Namespace,
            vocab: int) -> float:
    """Best of --repeats runs of decode_ms for `batch_size` requests over `adapters` (round robin), after a warm-up."""
    names = [adapters[i % len(adapters)] for i in range(batch_size)]
    decode_ms(engine, prompts(batch_size, ns.input_len, vocab, seed=1), names, 8)  # kernels compiled, slots placed
    return min(decode_ms(engine, prompts(batch_size, ns.input_len, vocab, seed=2 + r), names, ns.output_len)
               for r in range(ns.repeats))


def profile(engine: Engine, batch_size: int, adapters: list[str | None], ns: argparse.Namespace, vocab: int,
            label: str) -> dict:
    """--profile-steps: one streamed call of `batch_size` requests decoding that many tokens, its decode steps (every
    request decoding; no prefill) under torch's profiler, which records the CUDA kernels the engine's scheduler thread
    launches; prints them by GPU time and returns the GPU time in all and in the LoRA kernels (kernels.lora's shrink
    and expand; the layout's torch ops count in all only). Without a CUDA device the call runs unprofiled (the
    profiler records a CPU's operators only on its own thread, not the scheduler's): no times."""
    names = [adapters[i % len(adapters)] for i in range(batch_size)]
    batch = prompts(batch_size, ns.input_len, vocab, seed=99)
    record = {"label": label, "batch": batch_size, "steps": ns.profile_steps, "gpu_us": None, "lora_kernels_us": None}
    if not torch.cuda.is_available() or ns.device == "cpu":
        decode_ms(engine, batch, names, ns.profile_steps)
        print(f"== {label}, batch {batch_size}: no CUDA device, no kernels recorded", flush=True)
        return record
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    prof = torch_profile(activities=[ProfilerActivity.CUDA])
    decode_ms(engine, batch, names, ns.profile_steps, window=prof)
    events = prof.key_averages()
    record["gpu_us"] = sum(e.self_device_time_total for e in events)
    record["lora_kernels_us"] = sum(e.self_device_time_total for e in events
                                    if "_shrink_kernel" in e.key or "_expand_kernel" in e.key)
    print(f"== {label}, batch {batch_size}: kernels of the decode steps of a {ns.profile_steps}-token call", flush=True)
    print(events.table(sort_by="self_device_time_total", row_limit=16, max_name_column_width=60), flush=True)
    return record


def run(ns: argparse.Namespace, common: dict, adapter_dir: Path) -> dict:
    cfg = ModelConfig.from_path(ns.model_path)
    sizes = [int(x) for x in ns.batch_sizes.split(",")]
    counts = [int(x) for x in ns.adapters.split(",")]
    paths = [write_adapter(adapter_dir / f"a{i}", cfg, ns.rank, seed=i) for i in range(max(counts))]
    names = [f"a{i}" for i in range(len(paths))]
    runs, profiles = [], []
    base = Engine(**common)
    try:
        for bs in sizes:
            runs.append({"lora": False, "batch": bs, "adapters": 0, "ms_per_token": measure(base, bs, [None], ns,
                                                                                             cfg.vocab_size)})
            print(f"base engine        batch {bs:4d}: {runs[-1]['ms_per_token']:8.3f} ms/token", flush=True)
            if ns.profile_steps:
                profiles.append(profile(base, bs, [None], ns, cfg.vocab_size, "base engine"))
    finally:
        base.shutdown()
    base_ms = {r["batch"]: r["ms_per_token"] for r in runs}
    lora = Engine(**common, enable_lora=True, max_lora_rank=ns.rank, max_loras_per_batch=max(max(counts), 1),
                  lora_paths=[f"{n}={p}" for n, p in zip(names, paths)])
    try:
        for bs in sizes:
            for a in counts:
                if a > bs:
                    continue
                ms = measure(lora, bs, names[:a] or [None], ns, cfg.vocab_size)
                runs.append({"lora": True, "batch": bs, "adapters": a, "ms_per_token": ms,
                             "overhead": ms / base_ms[bs] - 1})
                print(f"--enable-lora, {a} adapters batch {bs:4d}: {ms:8.3f} ms/token ({ms / base_ms[bs] - 1:+.1%})",
                      flush=True)
                if ns.profile_steps and a == max(counts):
                    profiles.append(profile(lora, bs, names[:a] or [None], ns, cfg.vocab_size, f"{a} adapters"))
        pool = lora.runner.lora.pool
        stats = {"adapter_loads": pool.loads, "adapter_evictions": pool.evictions,
                 "cuda_graphs": lora.runner.graphs is not None}
    finally:
        lora.shutdown()
    return {"runs": runs, **stats, **({"profiles": profiles} if profiles else {})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m radixmesh.benchmarks.lora", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", default="1,64", help="comma-separated")
    ap.add_argument("--adapters", default="0,1,8", help="distinct adapters in a batch, comma-separated")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine-args", default="{}", help="more Engine keyword arguments, as JSON")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--decode-split", type=int, default=None,
                    help="kernels.lora.DECODE_SPLIT for this run (the K parts of a decode batch's shrink)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after timing, profile a call decoding this many tokens (base, and the most adapters)")
    ap.add_argument("--side-stream", action=argparse.BooleanOptionalAction, default=True,
                    help="the shrinks on a second stream beside the base products (engine.lora.batch; the default)")
    ap.add_argument("--reduce-partials", action=argparse.BooleanOptionalAction, default=True,
                    help="a decode batch's shrink sums its partial sums itself (kernels.lora.REDUCE_DECODE_PARTIALS; "
                         "the default)")
    ap.add_argument("--expand-tiling", default=None, metavar="BLOCK_NxPER_PROGRAMxWARPS",
                    help="the expand's tiling for decode batches (benchmarks.lora_kernels sweeps it), e.g. 64x1x4")
    ns = ap.parse_args(argv)
    from radixmesh.engine.lora.batch import SIDE_STREAM_ENV

    os.environ[SIDE_STREAM_ENV] = "1" if ns.side_stream else "0"
    from radixmesh.kernels import lora as lora_kernels

    if ns.decode_split:
        lora_kernels.DECODE_SPLIT = ns.decode_split
    lora_kernels.REDUCE_DECODE_PARTIALS = ns.reduce_partials
    if ns.expand_tiling:
        lora_kernels.EXPAND_BLOCK_N, lora_kernels.EXPAND_DECODE_BLOCKS, lora_kernels.EXPAND_WARPS = (
            int(v) for v in ns.expand_tiling.split("x"))
    common = {"model_path": ns.model_path, "dtype": ns.dtype, "log_level": "warning", "skip_tokenizer_init": True,
              **json.loads(ns.engine_args)}
    if ns.device:
        common["device"] = ns.device
    record = {"bench": "lora", "command": "python -m radixmesh.benchmarks.lora " +
              " ".join(sys.argv[1:] if argv is None else argv), "date": datetime.date.today().isoformat(),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() and ns.device != "cpu" else "cpu",
              "rank": ns.rank, "input_len": ns.input_len, "output_len": ns.output_len,
              "decode_split": ns.decode_split or "default", "side_stream": ns.side_stream,
              "reduce_partials": ns.reduce_partials, "expand_tiling": ns.expand_tiling or "default"}
    with tempfile.TemporaryDirectory(prefix="radixmesh-lora-bench-") as tmp:
        record.update(run(ns, common, Path(tmp)))
    goal = [r for r in record["runs"] if r["lora"] and r["batch"] == GOAL_BATCH and r["adapters"] == GOAL_ADAPTERS]
    if goal:
        record["goal_met"] = goal[0]["overhead"] <= GOAL_OVERHEAD
        print(f"goal ({GOAL_ADAPTERS} adapters at batch {GOAL_BATCH} within {GOAL_OVERHEAD:.0%} of the base step): "
              f"{'met' if record['goal_met'] else 'not met'} ({goal[0]['overhead']:+.1%})", flush=True)
    if ns.out:
        ns.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0 if record.get("goal_met", True) else 1


if __name__ == "__main__":
    sys.exit(main())
