"""Profile decode steps of the 8B-shaped model (dummy weights) with torch.profiler; prints the top ops.

    python benchmarks/profile_decode.py [batch_size] [input_len]
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from engine.bench_one_batch import _make_reqs
from engine.cache.manager import CacheManager
from engine.config import EngineArgs, ModelConfig, resolve_args
from engine.model_runner import ModelRunner
from engine.sampling.sampler import SamplingBatch
from engine.scheduler.batch_builder import build_decode, build_extend


def main() -> None:
    bs = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    input_len = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    cfg = ModelConfig.from_path("benchmarks/configs/llama-3.1-8b")
    args = resolve_args(EngineArgs(model_path=cfg.path, load_format="dummy", dtype="bfloat16",
                                   skip_tokenizer_init=True, disable_radix_cache=True, max_running_requests=bs), cfg)
    runner = ModelRunner(args, cfg)
    cache = CacheManager(runner.kv_pool, runner.req_to_token, None)
    reqs = _make_reqs(cache, bs, input_len, cfg.vocab_size, torch.Generator().manual_seed(0))
    sampling = SamplingBatch.build(reqs, False, runner.model_config.vocab_size, runner.device)
    batch, _ = build_extend(reqs, cache.slots_of_new_tokens(reqs), runner.device)
    ids = runner.forward_and_sample(batch, sampling).next_ids.tolist()

    def step():
        nonlocal ids
        for r, t in zip(reqs, ids):
            r.kv_len += r.extend_len
            r.output_ids.append(t)
            r.extend_len = 1
        locs = cache.alloc_decode(reqs)
        ids = runner.forward_and_sample(build_decode(reqs, locs, runner.device), sampling).next_ids.tolist()

    for _ in range(5):
        step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
