"""Static-batch latency: one prefill of `batch_size` x `input_len` tokens, then `output_len` decode steps.
No scheduler: this times the model runner alone (as SGLang's bench_one_batch does).

    python -m engine.bench_one_batch --model-path benchmarks/configs/llama-3.1-8b --load-format dummy \
        --dtype bfloat16 --batch-size 1 8 64 --input-len 512 --output-len 32 [--roofline]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from engine.cache.manager import CacheManager
from engine.config import EngineArgs, ModelConfig, resolve_args
from engine.cli import add_engine_args, engine_kwargs
from engine.model_runner import ModelRunner
from engine.request import Req
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import SamplingBatch
from engine.scheduler.batch_builder import build_decode, build_extend


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
        r.extend_len = input_len
        if cache.alloc_tokens(r, input_len) is None:
            raise RuntimeError(f"KV pool too small for {bs} x {input_len} tokens")
        reqs.append(r)
    return reqs


def run_once(runner: ModelRunner, cache: CacheManager, bs: int, input_len: int, output_len: int) -> dict:
    gen = torch.Generator().manual_seed(bs)
    reqs = _make_reqs(cache, bs, input_len, runner.model_config.vocab_size, gen)
    sampling = SamplingBatch.build(reqs, False, runner.model_config.vocab_size, runner.device)
    _sync(runner.device)
    t0 = time.perf_counter()
    batch, _ = build_extend(reqs, cache.slots_of_new_tokens(reqs), runner.device)
    result = runner.forward_and_sample(batch, sampling)
    next_ids = result.next_ids.tolist()
    prefill_s = time.perf_counter() - t0
    step_s = []
    for _ in range(output_len):
        t0 = time.perf_counter()
        for r, tok in zip(reqs, next_ids):
            r.kv_len += r.extend_len
            r.output_ids.append(tok)
            r.extend_len = 1
        locs = cache.alloc_decode(reqs)
        sampling = SamplingBatch.build(reqs, False, runner.model_config.vocab_size, runner.device)
        result = runner.forward_and_sample(build_decode(reqs, locs, runner.device), sampling)
        next_ids = result.next_ids.tolist()  # the host read synchronizes, as the scheduler's does
        step_s.append(time.perf_counter() - t0)
    for r in reqs:
        cache.release(r)
    median = statistics.median(step_s)
    return {"batch_size": bs, "input_len": input_len, "output_len": output_len,
            "prefill_latency_s": prefill_s, "prefill_throughput_tok_s": bs * input_len / prefill_s,
            "decode_median_latency_s": median, "decode_throughput_tok_s": bs / median,
            "total_latency_s": prefill_s + sum(step_s)}


def measure_copy_bandwidth(device: torch.device, nbytes: int = 4 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    return 2 * nbytes * iters / (start.elapsed_time(end) / 1e3)


def decode_weight_bytes(runner: ModelRunner) -> int:
    """Bytes of weights one decode step must read: every parameter except the embedding table (only a few rows are
    gathered), plus the lm_head (the embedding again when tied)."""
    model = runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.model.embed_tokens.weight
    emb_bytes = emb.numel() * emb.element_size()
    return total if model.lm_head is None else total - emb_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--roofline", action="store_true", help="also measure copy bandwidth (CUDA only)")
    parser.add_argument("--result-file", help="append one JSON line per batch size")
    ns = parser.parse_args()
    kwargs = engine_kwargs(ns)
    kwargs.setdefault("max_running_requests", max(ns.batch_size))
    kwargs["disable_radix_cache"] = True
    model_config = ModelConfig.from_path(kwargs["model_path"])
    args = resolve_args(EngineArgs.from_kwargs(**kwargs), model_config)
    runner = ModelRunner(args, model_config)
    cache = CacheManager(runner.kv_pool, runner.req_to_token, None)
    run_once(runner, cache, min(ns.batch_size), min(ns.input_len, 64), 4)  # warm-up: allocator, kernels
    rows = [run_once(runner, cache, bs, ns.input_len, ns.output_len) for bs in ns.batch_size]
    extra = {}
    if ns.roofline and runner.device.type == "cuda":
        bw = measure_copy_bandwidth(runner.device)
        weight_bytes = decode_weight_bytes(runner)
        extra = {"copy_bandwidth_GBps": bw / 1e9, "decode_weight_bytes": weight_bytes,
                 "bs1_decode_roofline_s": weight_bytes / bw}
    print(f"{'bs':>4} {'prefill s':>10} {'prefill tok/s':>14} {'decode step s':>14} {'decode tok/s':>13}")
    for r in rows:
        print(f"{r['batch_size']:>4} {r['prefill_latency_s']:>10.4f} {r['prefill_throughput_tok_s']:>14.1f} "
              f"{r['decode_median_latency_s']:>14.5f} {r['decode_throughput_tok_s']:>13.1f}")
    if extra:
        print(f"copy bandwidth {extra['copy_bandwidth_GBps']:.0f} GB/s; decode reads "
              f"{extra['decode_weight_bytes'] / 1e9:.2f} GB of weights -> batch-1 roofline "
              f"{extra['bs1_decode_roofline_s'] * 1e3:.2f} ms/step")
    if ns.result_file:
        meta = {"bench": "one_batch", "device": _device_name(runner.device), "args": dataclasses.asdict(args),
                **extra}
        with open(ns.result_file, "a") as f:
            for r in rows:
                f.write(json.dumps({**meta, **r}) + "\n")


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    main()
