"""Static-batch latency: one prefill of `batch_size` x `input_len` tokens, then `output_len` decode steps.
No scheduler: this times the model runner alone (as SGLang's bench_one_batch does).

    python -m radixmesh.engine.bench_one_batch --model-path benchmarks/configs/llama-3.1-8b --load-format dummy \
        --dtype bfloat16 --batch-size 1 8 64 256 --input-len 512 --output-len 32 --roofline \
        [--eager-too] [--long-context 32768] [--prefill-len 8192] [--tp 2 [--profile-collectives]]

`--roofline` measures the GPU's two ceilings in the same run (device-to-device copy bandwidth, bf16 matmul rate) and
reports each decode step against its floor: the weights one step reads (of a mixture of experts, the distinct experts
its batch's tokens took, counted on two more steps: `experts_read`) plus every request's KV at its context, over the
copy bandwidth. A batch whose KV does not fit the pool is skipped with the reason. `--eager-too` repeats the decode
batches with CUDA graphs off; `--long-context` adds one request decoding at that context (split-KV); `--prefill-len`
times one prompt's prefill and its TFLOP/s.
With `--tp N` the runner is rank 0 of N (the other ranks follow in processes of their own, as in an engine); each
rank reads 1/N of the weights, so the floor is the per-rank share; `--profile-collectives` reports the share of each
eager decode step spent in NCCL kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import time

import torch

from radixmesh.engine.bench_roofline import (attention_flops, decode_weight_bytes, holds_fp8, linear_flops,
                                             measure_copy_bandwidth, measure_fp8_matmul_tflops, measure_matmul_tflops,
                                             moe_blocks)
from radixmesh.engine.cache.manager import CacheManager
from radixmesh.engine.config import EngineArgs, resolve_args
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.engine.request import Req
from radixmesh.engine.sampling.params import SamplingParams
from radixmesh.engine.sampling.sampler import SamplingBatch
from radixmesh.engine.scheduler.batch_builder import build_decode, build_extend
from radixmesh.engine.tp_worker import rank_args, start_leader
from radixmesh.settings import add_settings, resolve

# Prefill forwards take whole requests up to this many tokens (a longer request is chunked on its own): SGLang's
# default chunked_prefill_size on GPUs.
PREFILL_CHUNK = 8192


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_reqs(cache: CacheManager, bs: int, input_len: int, vocab: int, gen: torch.Generator) -> list[Req]:
    params = SamplingParams(max_new_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    reqs = []
    for i in range(bs):
        ids = torch.randint(0, vocab, (input_len,), generator=gen).tolist()
        r = Req(rid=str(i), input_ids=ids, sampling=params, stop_ids=frozenset(), sink=lambda out: None)
        if not cache.admit(r):
            raise RuntimeError(f"batch size {bs} exceeds max_running_requests")
        reqs.append(r)
    return reqs


def _greedy(runner: ModelRunner, reqs: list[Req]) -> SamplingBatch:
    return SamplingBatch.build(reqs, False, runner.model_config.vocab_size, runner.device)


def prefill(runner: ModelRunner, cache: CacheManager, reqs: list[Req]) -> list[int]:
    """Prefill every request (groups of whole requests up to PREFILL_CHUNK tokens; longer ones in chunks over their
    own prefix); returns each request's first token."""
    first: list[int] = []
    i = 0
    while i < len(reqs):
        group = [reqs[i]]
        while (i + len(group) < len(reqs)
               and sum(len(r.input_ids) for r in group) + len(reqs[i + len(group)].input_ids) <= PREFILL_CHUNK):
            group.append(reqs[i + len(group)])
        i += len(group)
        while True:
            for r in group:
                r.extend_len = min(len(r.input_ids) - r.kv_len, PREFILL_CHUNK)
                if cache.alloc_tokens(r, r.extend_len) is None:
                    raise RuntimeError("KV pool too small for this batch")
            batch, _ = build_extend(group, cache.slots_of_new_tokens(group), runner.device)
            ids = runner.forward_and_sample(batch, _greedy(runner, group)).next_ids.tolist()
            for r in group:
                r.kv_len += r.extend_len
            if all(r.kv_len == len(r.input_ids) for r in group):
                first += ids
                break
    return first


def decode(runner: ModelRunner, cache: CacheManager, reqs: list[Req], first: list[int],
           steps: int, gpu_s: list[float] | None = None) -> tuple[list[float], list[int]]:
    """`steps` decode steps over `reqs` from their tokens `first`: the seconds of each (host read included, as the
    scheduler's) and the tokens the last step produced. `gpu_s` (CUDA): gets each step's GPU seconds, from CUDA
    events around the forward and sampling (what the step costs once overlap scheduling hides the host's part)."""
    next_ids, step_s = first, []
    cuda = gpu_s is not None and runner.device.type == "cuda"
    for _ in range(steps):
        t0 = time.perf_counter()
        for r, tok in zip(reqs, next_ids):
            r.output_ids.append(tok)
            r.extend_len = 1
        locs = cache.alloc_decode(reqs)
        batch = build_decode(reqs, locs, runner.device)
        sampling = _greedy(runner, reqs)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        result = runner.forward_and_sample(batch, sampling)
        if cuda:
            end.record()
        next_ids = result.next_ids.tolist()
        for r in reqs:
            r.kv_len += 1
        step_s.append(time.perf_counter() - t0)
        if cuda:
            gpu_s.append(start.elapsed_time(end) / 1e3)
    return step_s, next_ids


def run_once(runner: ModelRunner, cache: CacheManager, bs: int, input_len: int, output_len: int,
             count_experts: bool = False) -> dict:
    """One static batch: prefill, then `output_len` timed decode steps. With `count_experts` (a mixture of experts),
    also how many distinct experts each sparse layer's step reads (experts_read, after the timed steps)."""
    reqs = _make_reqs(cache, bs, input_len, runner.model_config.vocab_size, torch.Generator().manual_seed(bs))
    _sync(runner.device)
    t0 = time.perf_counter()
    first = prefill(runner, cache, reqs)
    prefill_s = time.perf_counter() - t0
    gpu_s: list[float] = []
    step_s, last = decode(runner, cache, reqs, first, output_len, gpu_s)
    read = experts_read(runner, cache, reqs, last) if count_experts and moe_blocks(runner.model) else None
    for r in reqs:
        cache.release(r)
    median = statistics.median(step_s)
    return {"batch_size": bs, "input_len": input_len, "output_len": output_len,
            "cuda_graph": runner.graphs is not None, "attention_backend": runner.attn_backend.name,
            "prefill_latency_s": prefill_s, "prefill_throughput_tok_s": bs * input_len / prefill_s,
            "decode_median_latency_s": median, "decode_throughput_tok_s": bs / median,
            **({"decode_median_gpu_s": statistics.median(gpu_s)} if gpu_s else {}),
            **({"experts_read": read} if read is not None else {}),
            "total_latency_s": prefill_s + sum(step_s)}


def experts_read(runner: ModelRunner, cache: CacheManager, reqs: list[Req], next_ids: list[int],
                 steps: int = 2) -> list[float]:
    """Per sparse layer of a mixture of experts: how many distinct experts of this rank's a decode step of `reqs`
    reads, the mean over `steps` more steps (from tokens `next_ids`) run without CUDA graphs, with the routing
    counters (engine.models.moe.expert_counters' hook) attached for them only. A batch's step reads the union of its
    tokens' top-k, which is what its floor is made of (issue 51: at batch 64 the step should read close to it)."""
    blocks = moe_blocks(runner.model)
    saved, graphs, runner.graphs = [b.counts for b in blocks], runner.graphs, None
    sums = [0] * len(blocks)
    try:
        for b in blocks:
            b.counts = torch.zeros(b.gate.weight.shape[0], dtype=torch.int64, device=b.gate.weight.device)
        for _ in range(steps):
            for b in blocks:
                b.counts.zero_()
            _, next_ids = decode(runner, cache, reqs, next_ids, 1)
            for i, b in enumerate(blocks):
                first, held = b.experts.first, b.experts.local_experts
                sums[i] += int((b.counts[first:first + held] > 0).sum())
    finally:
        runner.graphs = graphs
        for b, counts in zip(blocks, saved):
            b.counts = counts
    return [n / steps for n in sums]


def prefill_tflops(runner: ModelRunner, cache: CacheManager, length: int, repeats: int = 3) -> dict:
    """One prompt of `length` tokens, prefilled `repeats` times (median): seconds and achieved TFLOP/s."""
    times = []
    for i in range(repeats):
        reqs = _make_reqs(cache, 1, length, runner.model_config.vocab_size, torch.Generator().manual_seed(100 + i))
        _sync(runner.device)
        t0 = time.perf_counter()
        prefill(runner, cache, reqs)
        _sync(runner.device)
        times.append(time.perf_counter() - t0)
        cache.release(reqs[0])
    cfg = runner.model_config
    flops = linear_flops(runner, length) + attention_flops(cfg, length)
    s = statistics.median(times)
    return {"prefill_len": length, "prefill_s": s, "prefill_flops": flops, "prefill_tflops": flops / s / 1e12}


def extend_over_prefix(runner: ModelRunner, cache: CacheManager, batch: int, prefix: int, new: int,
                       repeats: int = 3) -> dict:
    """One forward extending `batch` requests by `new` tokens each over `prefix` tokens already in the pool (a
    multi-turn wave's turns over their histories), and the same forward over no prefix: seconds (median of
    `repeats`), so the difference is what attending to the histories costs, against its attention FLOPs."""
    vocab, out = runner.model_config.vocab_size, {}
    for have in (prefix, 0):
        times = []
        for i in range(repeats):
            gen = torch.Generator().manual_seed(1000 + i)
            reqs = _make_reqs(cache, batch, max(have, 1), vocab, gen)
            if have:
                prefill(runner, cache, reqs)
            else:  # nothing cached: the one token _make_reqs needs is replaced by the new ones
                for r in reqs:
                    r.input_ids = []
            for r in reqs:
                r.input_ids = r.input_ids + torch.randint(0, vocab, (new,), generator=gen).tolist()
                r.extend_len = new
                if cache.alloc_tokens(r, new) is None:
                    raise RuntimeError("KV pool too small for this batch")
            _sync(runner.device)
            t0 = time.perf_counter()
            step, _ = build_extend(reqs, cache.slots_of_new_tokens(reqs), runner.device)
            runner.forward_and_sample(step, _greedy(runner, reqs)).next_ids.tolist()
            times.append(time.perf_counter() - t0)
            for r in reqs:
                cache.release(r)
        out[have] = statistics.median(times)
    cfg = runner.model_config
    # the new tokens' queries against the prefix's keys: QK^T and PV, 2 FLOPs a multiply-add, every layer
    extra_flops = 4 * batch * new * prefix * cfg.num_heads * cfg.head_dim * cfg.num_layers
    gap = out[prefix] - out[0]
    return {"extend_batch": batch, "extend_prefix": prefix, "extend_new": new, "extend_over_prefix_s": out[prefix],
            "extend_no_prefix_s": out[0], "prefix_attention_flops": extra_flops,
            "prefix_attention_tflops": extra_flops / gap / 1e12 if gap > 0 else None}


def _floor(row: dict, runner: ModelRunner, kv_per_token: int, bandwidth: float) -> None:
    """Add the decode step's floor: the weights it reads (of a mixture of experts, the experts its batch took:
    experts_read) + each request's KV at its mean context, over the copy bandwidth."""
    weight_bytes = decode_weight_bytes(runner, row.get("experts_read"))
    row["decode_weight_bytes"] = weight_bytes
    ctx = row["input_len"] + row["output_len"] / 2
    floor = (weight_bytes + row["batch_size"] * ctx * kv_per_token) / bandwidth
    row.update(decode_floor_s=floor, decode_over_floor=row["decode_median_latency_s"] / floor)
    if "decode_median_gpu_s" in row:
        row["decode_gpu_over_floor"] = row["decode_median_gpu_s"] / floor


def _build(ns: argparse.Namespace) -> tuple[ModelRunner, CacheManager, EngineArgs]:
    kwargs = resolve(ns, EngineArgs)[0]
    sizes = list(ns.batch_size) + ([1] if ns.long_context else []) + ([ns.extend_over[2]] if ns.extend_over else [])
    kwargs.setdefault("max_running_requests", max(sizes))
    kwargs["disable_radix_cache"] = True
    longest = max([ns.input_len + ns.output_len, ns.long_context + ns.output_len, ns.prefill_len + 1,
                   sum(ns.extend_over[:2]) + 1 if ns.extend_over else 0])
    kwargs.setdefault("context_length", longest + 16)
    model_config = ModelConfig.from_path(kwargs["model_path"], kwargs.get("revision"))
    args = resolve_args(EngineArgs.from_kwargs(**kwargs), model_config)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tp, ns.followers = start_leader(args)
    runner = ModelRunner(rank_args(args, 0) if ns.followers else args, model_config, tp)
    return runner, CacheManager(runner.kv_pool, runner.req_to_token, None), args


def _measure(runner: ModelRunner, cache: CacheManager, ns: argparse.Namespace) -> list[dict]:
    rows = []
    for bs in ns.batch_size:
        page = cache.page  # (+2: experts_read's counting steps; each request holds whole pages)
        if (need := bs * -(-(ns.input_len + ns.output_len + 2) // page) * page) > runner.max_total_tokens:
            print(f"batch {bs} skipped: its {need} tokens of KV exceed the pool's {runner.max_total_tokens} "
                  "(--mem-fraction-static sets the pool's share of the memory)")
            continue
        rows.append(run_once(runner, cache, bs, ns.input_len, ns.output_len, count_experts=ns.roofline))
    if ns.long_context:
        rows.append(run_once(runner, cache, 1, ns.long_context, ns.output_len))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_settings(parser, EngineArgs)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--roofline", action="store_true", help="measure copy bandwidth and bf16 matmul rate (CUDA)")
    parser.add_argument("--eager-too", action="store_true", help="also time the decode batches without CUDA graphs")
    parser.add_argument("--long-context", type=int, default=0, help="also decode one request at this context")
    parser.add_argument("--prefill-len", type=int, default=0, help="also time one prompt of this length's prefill")
    parser.add_argument("--extend-over", type=int, nargs=3, metavar=("PREFIX", "NEW", "BATCH"),
                        help="also time one forward of BATCH requests extending by NEW tokens over PREFIX cached ones, "
                             "against the same forward with no prefix (multi-turn turns over their histories)")
    parser.add_argument("--result-file", help="append one JSON line per measurement")
    parser.add_argument("--profile-collectives", action="store_true",
                        help="with --tp: the share of eager decode steps spent in NCCL kernels (torch profiler)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="also print where this many decode steps at each batch size spend their time (kernels "
                             "by GPU time, operators by host time)")
    ns = parser.parse_args()
    runner, cache, args = _build(ns)
    run_once(runner, cache, min(ns.batch_size), min(ns.input_len, 64), 4)  # warm-up: allocator, kernels
    rows = _measure(runner, cache, ns)
    if ns.eager_too and runner.graphs is not None:
        graphs, runner.graphs = runner.graphs, None
        rows += _measure(runner, cache, ns)
        runner.graphs = graphs
    extra = {}
    if ns.profile_collectives and runner.tp.size > 1:
        extra["collective_share"] = collective_shares(runner, cache, ns)
    if ns.profile_steps:
        profile_steps(runner, cache, ns)
    if ns.prefill_len:
        extra.update(prefill_tflops(runner, cache, ns.prefill_len))
    if ns.extend_over:
        prefix, new, batch = ns.extend_over
        extra.update(extend_over_prefix(runner, cache, batch, prefix, new))
    if ns.roofline and runner.device.type == "cuda":
        bw = measure_copy_bandwidth(runner.device)
        weight_bytes = decode_weight_bytes(runner)
        kv_per_token = runner.model_config.kv_bytes_per_token(runner.kv_pool.k[0].dtype, runner.num_kv_heads)
        extra.update(copy_bandwidth_GBps=bw / 1e9, decode_weight_bytes=weight_bytes,
                     bs1_decode_roofline_s=weight_bytes / bw, matmul_tflops=measure_matmul_tflops(runner.device))
        for r in rows:
            _floor(r, runner, kv_per_token, bw)
        if holds_fp8(runner.model):  # the fp8 products' own ceiling (issue 52)
            extra["fp8_matmul_tflops"] = measure_fp8_matmul_tflops(runner.device)
        if ns.prefill_len:
            extra["prefill_fraction_of_matmul_peak"] = extra["prefill_tflops"] / extra["matmul_tflops"]
            if extra.get("fp8_matmul_tflops"):
                extra["prefill_fraction_of_fp8_matmul_peak"] = extra["prefill_tflops"] / extra["fp8_matmul_tflops"]
    _report(rows, extra)
    runner.stop_followers()
    if ns.followers is not None:
        ns.followers.join()
    if ns.result_file:
        meta = {"bench": "one_batch", "device": _device_name(runner.device), "args": dataclasses.asdict(args),
                "cuda_graph_capture_s": runner.graphs.capture_seconds if runner.graphs else None,
                "cuda_graph_bytes": runner.graphs.capture_bytes if runner.graphs else None, **extra}
        with open(ns.result_file, "a") as f:
            for r in rows:
                f.write(json.dumps({**meta, **r}) + "\n")


def collective_shares(runner: ModelRunner, cache: CacheManager, ns: argparse.Namespace) -> dict[str, float]:
    """Batch size -> the fraction of the GPU time of eager decode steps spent in NCCL kernels (the all-reduces after
    the row-parallel layers and the logits' all-gather)."""
    from torch.profiler import ProfilerActivity, profile

    graphs, runner.graphs = runner.graphs, None
    out = {}
    try:
        for bs in ns.batch_size:
            run_once(runner, cache, bs, min(ns.input_len, 128), 2)  # warm
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run_once(runner, cache, bs, min(ns.input_len, 128), 8)
            kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
            total = sum(e.device_time for e in kernels)
            nccl = sum(e.device_time for e in kernels if "nccl" in e.name.lower())
            out[str(bs)] = nccl / total if total else 0.0
    finally:
        runner.graphs = graphs
    return out


def profile_steps(runner: ModelRunner, cache: CacheManager, ns: argparse.Namespace) -> None:
    """Print where `--profile-steps` decode steps at each batch size spend their time: the kernels by GPU time and
    the operators by host time (torch profiler; graphs as configured)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    for bs in ns.batch_size:
        reqs = _make_reqs(cache, bs, min(ns.input_len, 128), runner.model_config.vocab_size,
                          torch.Generator().manual_seed(bs))
        first = prefill(runner, cache, reqs)
        decode(runner, cache, reqs, first, 2)  # warm
        with profile(activities=activities) as prof:
            decode(runner, cache, reqs, first, ns.profile_steps)
        for r in reqs:
            cache.release(r)
        table = prof.key_averages()
        print(f"== batch {bs}, {ns.profile_steps} decode steps")
        for key in (["self_cuda_time_total"] if len(activities) > 1 else []) + ["self_cpu_time_total"]:
            print(table.table(sort_by=key, row_limit=20, max_name_column_width=70))


def _report(rows: list[dict], extra: dict) -> None:
    print(f"{'backend':>22} {'graph':>5} {'bs':>4} {'ctx':>6} {'prefill s':>10} {'decode ms':>10} {'tok/s':>9} "
          f"{'x floor':>8} {'GPU ms':>8} {'x floor':>8}")
    for r in rows:
        over = f"{r['decode_over_floor']:.2f}" if "decode_over_floor" in r else "-"
        gpu = f"{r['decode_median_gpu_s'] * 1e3:.3f}" if "decode_median_gpu_s" in r else "-"
        gpu_over = f"{r['decode_gpu_over_floor']:.2f}" if "decode_gpu_over_floor" in r else "-"
        print(f"{r['attention_backend']:>22} {str(r['cuda_graph']):>5} {r['batch_size']:>4} {r['input_len']:>6} "
              f"{r['prefill_latency_s']:>10.4f} {r['decode_median_latency_s'] * 1e3:>10.3f} "
              f"{r['decode_throughput_tok_s']:>9.1f} {over:>8} {gpu:>8} {gpu_over:>8}")
    if counted := [r for r in rows if "experts_read" in r]:  # a mixture of experts: its floors take the union
        print("distinct experts a sparse layer's step reads (mean over layers), by batch size: " + ", ".join(
            f"{r['batch_size']}: {statistics.mean(r['experts_read']):.1f}" for r in counted))
    if "copy_bandwidth_GBps" in extra:
        print(f"copy bandwidth {extra['copy_bandwidth_GBps']:.0f} GB/s, bf16 matmul {extra['matmul_tflops']:.0f} "
              f"TFLOP/s; decode reads {extra['decode_weight_bytes'] / 1e9:.2f} GB of weights -> batch-1 floor "
              f"{extra['bs1_decode_roofline_s'] * 1e3:.2f} ms/step")
        if "fp8_matmul_tflops" in extra:
            fp8 = extra["fp8_matmul_tflops"]
            print(f"fp8 matmul (row-wise scales) {fp8:.0f} TFLOP/s" if fp8 else "fp8 matmul: not on this GPU")
    if "collective_share" in extra:
        print("NCCL share of eager decode GPU time by batch size:",
              ", ".join(f"{bs}: {v:.1%}" for bs, v in extra["collective_share"].items()))
    if "prefill_tflops" in extra:
        frac = extra.get("prefill_fraction_of_matmul_peak")
        print(f"prefill of {extra['prefill_len']} tokens: {extra['prefill_s'] * 1e3:.1f} ms, "
              f"{extra['prefill_tflops']:.0f} TFLOP/s" + (f" ({frac:.0%} of the matmul peak)" if frac else "")
              + (f", {frac8:.0%} of the fp8 matmul peak" if (frac8 := extra.get("prefill_fraction_of_fp8_matmul_peak"))
                 else ""))
    if "extend_over_prefix_s" in extra:
        rate = extra["prefix_attention_tflops"]
        print(f"extend of {extra['extend_batch']} x {extra['extend_new']} tokens: "
              f"{extra['extend_over_prefix_s'] * 1e3:.1f} ms over {extra['extend_prefix']} cached tokens each, "
              f"{extra['extend_no_prefix_s'] * 1e3:.1f} ms over none; the prefix's attention at "
              + (f"{rate:.0f} TFLOP/s" if rate else "no measurable cost"))


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    main()
