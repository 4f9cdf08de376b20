"""Where a decode step's time goes (8B-shaped model, dummy weights): per batch size, the GPU time of one step (CUDA
events around graph replay + sampling), its kernels (count, time by kernel, the gaps between them) and the host time
the synchronous step adds on top; with --timeline one step's kernels in order and each kernel's share of the step
(its end minus the previous kernel's end, the median per kernel name: `shares`).

    python -m radixmesh.benchmarks.profile_decode [--attention-backend triton] [--batch-size 1 64] [--input-len 512]
                                        [--timeline] [--result-file F]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from radixmesh.engine.bench_one_batch import _make_reqs, decode, prefill
from radixmesh.engine.cache.manager import CacheManager
from radixmesh.engine.config import EngineArgs, resolve_args
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.kernels.fp8_gemv import ROW_PLAN


def _gpu_ms(runner, cache, reqs, ids, steps: int = 20) -> tuple[float, float, list[int]]:
    """(median GPU ms of forward + sampling, median wall ms of the whole synchronous step, the last tokens)."""
    gpu: list[float] = []
    wall, ids = decode(runner, cache, reqs, ids, steps, gpu)
    return statistics.median(gpu) * 1e3, statistics.median(wall) * 1e3, ids


def _kernels(prof, steps: int) -> dict:
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    by_name = collections.Counter()
    for e in events:
        by_name[e.name[:70]] += e.time_range.elapsed_us()
    busy = sum(e.time_range.elapsed_us() for e in events)
    span = events[-1].time_range.end - events[0].time_range.start if events else 0
    return {"kernels_per_step": len(events) / steps, "kernel_us_per_step": busy / steps,
            "span_us_per_step": span / steps,
            "top": [(name, us / steps) for name, us in by_name.most_common(14)]}


def _timeline(prof) -> list[tuple[str, float, float]]:
    """The kernels of a profile in the order they started: (name, start us from the first one's start, us)."""
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    t0 = events[0].time_range.start if events else 0
    return [(e.name[:60], e.time_range.start - t0, e.time_range.elapsed_us()) for e in events]


def shares(timeline: list[tuple[str, float, float]], least: int = 8) -> dict[str, dict]:
    """Each kernel's share of a step: its end minus the end of the kernel before it (under programmatic dependent
    launch a kernel's own duration includes its wait for the one before, so durations overlap and mislead; ends
    do not), by kernel name: how many, the median share and their sum, us; names seen fewer than `least` times
    (the step's one-off kernels) are left out. Largest sum first."""
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    ends = [start + us for _, start, us in timeline]
    for (name, _, _), end, before in zip(timeline[1:], ends[1:], ends):
        by_name[name].append(end - before)
    rows = {name: {"count": len(v), "median_us": round(statistics.median(v), 2), "sum_us": round(sum(v), 1)}
            for name, v in by_name.items() if len(v) >= least}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["sum_us"]))


def profile_batch(runner, cache, bs: int, input_len: int, trace: bool = False) -> dict:
    """`trace`: also one more step's kernels in order (name, start, duration), under "timeline"."""
    reqs = _make_reqs(cache, bs, input_len, runner.model_config.vocab_size, torch.Generator().manual_seed(bs))
    ids = prefill(runner, cache, reqs)
    _, ids = decode(runner, cache, reqs, ids, 5)
    gpu_ms, wall_ms, ids = _gpu_ms(runner, cache, reqs, ids)
    steps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _, ids = decode(runner, cache, reqs, ids, steps)
    timeline = None
    if trace:
        with profile(activities=[ProfilerActivity.CUDA]) as one:
            decode(runner, cache, reqs, ids, 1)
        timeline = _timeline(one)
    for r in reqs:
        cache.release(r)
    out = {"batch_size": bs, "gpu_ms": gpu_ms, "wall_ms": wall_ms, **_kernels(prof, steps)}
    return out if timeline is None else {**out, "timeline": timeline, "shares": shares(timeline)}


def decode_runner(model_path: str, backend: str, batch_sizes: list[int], input_len: int,
                  **overrides) -> tuple[ModelRunner, CacheManager]:
    """A runner of `model_path` with dummy weights, sized for decode batches up to max(batch_sizes) at contexts
    of ~input_len, and its cache manager (no radix cache). `overrides`: more EngineArgs."""
    cfg = ModelConfig.from_path(model_path)
    args = resolve_args(EngineArgs(model_path=cfg.path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                                   disable_radix_cache=True, max_running_requests=max(batch_sizes),
                                   context_length=input_len + 128, attention_backend=backend, **overrides), cfg)
    runner = ModelRunner(args, cfg)
    return runner, CacheManager(runner.kv_pool, runner.req_to_token, None)


def ab_rounds(runner, cache, switch, variants: tuple, batch_sizes: list[int], input_len: int,
              rounds: int) -> list[dict]:
    """An A/B inside one process: per round, per variant, `switch(runner, variant)` and the graphs captured again,
    then per batch size the GPU time of a decode step and the first 8 greedy tokens of up to 4 requests."""
    vocab = runner.model_config.vocab_size
    rows = []
    for round_ in range(rounds):
        for variant in variants:
            switch(runner, variant)
            torch.cuda.empty_cache()
            runner.graphs.capture()
            for bs in batch_sizes:
                reqs = _make_reqs(cache, bs, input_len, vocab, torch.Generator().manual_seed(bs))
                ids = prefill(runner, cache, reqs)
                _, tokens = decode(runner, cache, reqs, ids, 8)
                gpu_ms, wall_ms, _ = _gpu_ms(runner, cache, reqs, tokens)
                for r in reqs:
                    cache.release(r)
                row = {"round": round_, "variant": variant, "batch_size": bs, "gpu_ms": round(gpu_ms, 4),
                       "wall_ms": round(wall_ms, 4), "first_tokens": [r.output_ids[:8] for r in reqs[:4]]}
                rows.append(row)
                print(f"round {round_} {str(variant):>12} bs {bs:3}: GPU {gpu_ms:.3f} ms/step, synchronous "
                      f"{wall_ms:.3f}")
    return rows


def ab_main(description: str, switch, key: str, variants: tuple = (False, True)) -> None:
    """The command line of an in-step A/B (benchmarks.transposed_step, benchmarks.pdl_step): the 8B-shaped model with
    an attention backend (triton by default) and graphs for the batch sizes asked, `switch(runner, variant)` for each
    of `variants`, alternated; each row's variant is recorded under `key`."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model-path", default="benchmarks/configs/llama-3.1-8b")
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--decode-gemm", default="auto", choices=["auto", "gemv", "cublas"])
    p.add_argument("--variants", nargs="+", default=[str(v) for v in variants], choices=[str(v) for v in variants],
                   help="the variants to alternate (default: all)")
    p.add_argument("--result-file")
    ns = p.parse_args()
    variants = tuple(v for v in variants if str(v) in ns.variants)
    runner, cache = decode_runner(ns.model_path, ns.attention_backend, ns.batch_size, ns.input_len,
                                  mem_fraction_static=0.7, cuda_graph_bs=tuple(ns.batch_size),
                                  decode_gemm=ns.decode_gemm)
    from radixmesh.kernels.runtime import gemv_enabled

    products = "radixmesh.kernels.gemv" if gemv_enabled(torch.empty(0, device=runner.device)) else "cuBLAS"
    print(f"decode products (--decode-gemm {ns.decode_gemm}): {products}")
    rows = ab_rounds(runner, cache, switch, variants, ns.batch_size, ns.input_len, ns.rounds)
    for row in rows:
        row[key] = row.pop("variant")
        row["device"], row["backend"], row["products"] = torch.cuda.get_device_name(), ns.attention_backend, products
    if ns.result_file:
        with open(ns.result_file, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default="benchmarks/configs/llama-3.1-8b")
    parser.add_argument("--attention-backend", default="triton")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--result-file")
    parser.add_argument("--timeline", action="store_true",
                        help="record one step's kernels in order (name, start, duration) in the result file")
    parser.add_argument("--quantization", choices=["fp8"],
                        help="weights quantized to fp8 at load (SGLang's --quantization); a checkpoint config's "
                             "quantization_config is read either way")
    ns = parser.parse_args()
    extra = {"quantization": ns.quantization} if ns.quantization else {}
    runner, cache = decode_runner(ns.model_path, ns.attention_backend, ns.batch_size, ns.input_len, **extra)
    for bs in ns.batch_size:
        row = {"backend": ns.attention_backend, "quantization": ns.quantization,
               "fp8_row_plan": {f"{n}x{k}": list(c) for (n, k), c in ROW_PLAN.items()},
               **profile_batch(runner, cache, bs, ns.input_len, ns.timeline)}
        print(f"bs {bs}: GPU {row['gpu_ms']:.3f} ms/step (kernels {row['kernel_us_per_step'] / 1e3:.3f} ms busy, "
              f"{row['kernels_per_step']:.0f} kernels, span {row['span_us_per_step'] / 1e3:.3f} ms); synchronous "
              f"step {row['wall_ms']:.3f} ms" + (f"; fp8 one-row tiles {row['fp8_row_plan']}" if ROW_PLAN else ""))
        for name, us in row["top"]:
            print(f"   {us:9.1f} us  {name}")
        for name, share in row.get("shares", {}).items():  # --timeline
            print(f"   share {share['median_us']:7.2f} us x {share['count']:3}  {name}")
        if ns.result_file:
            with open(ns.result_file, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
