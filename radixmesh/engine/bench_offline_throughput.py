"""Offline throughput through the full Engine (scheduler, prefix cache, batching): N random prompts from a fixed
seed, all submitted at once, greedy, ignore_eos.

    python -m radixmesh.engine.bench_offline_throughput --model-path benchmarks/configs/llama-3.1-8b \
        --load-format dummy --dtype bfloat16 --num-prompts 128 --random-input-len 512 --random-output-len 128 \
        --max-running-requests 64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from radixmesh.engine import Engine
from radixmesh.engine.config import EngineArgs
from radixmesh.settings import add_settings, resolve


def random_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, input_len), generator=gen).tolist()


def run(llm: Engine, prompts: list[list[int]], output_len: int, sampling: dict | None = None) -> dict:
    params = {"temperature": 0, **(sampling or {}), "max_new_tokens": output_len, "ignore_eos": True}
    t0 = time.perf_counter()
    outs = llm.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - t0
    n_in = sum(len(p) for p in prompts)
    n_out = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"num_prompts": len(prompts), "elapsed_s": elapsed, "request_throughput": len(prompts) / elapsed,
            "input_throughput_tok_s": n_in / elapsed, "output_throughput_tok_s": n_out / elapsed,
            "total_output_tokens": n_out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_settings(parser, EngineArgs)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--random-input-len", type=int, default=512)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sampling-params", type=json.loads, default=None,
                        help='JSON dict of sampling parameters (default greedy), e.g. \'{"temperature": 0.8, '
                             '"top_p": 0.9, "frequency_penalty": 0.5}\'')
    parser.add_argument("--profile", action="store_true",
                        help="SGLang's: torch.profiler over the timed run, a Chrome trace in "
                             "$SGLANG_TORCH_PROFILER_DIR (else /tmp)")
    parser.add_argument("--result-file", help="append one JSON line")
    ns = parser.parse_args()
    kwargs = resolve(ns, EngineArgs)[0]
    kwargs.setdefault("skip_tokenizer_init", True)
    llm = Engine(**kwargs)
    try:
        vocab = llm.model_config.vocab_size
        run(llm, random_prompts(2, min(ns.random_input_len, 32), vocab, ns.seed + 1), 4)  # warm-up
        llm.flush_cache()
        prompts = random_prompts(ns.num_prompts, ns.random_input_len, vocab, ns.seed)
        if ns.profile:
            llm.start_profile()
        res = run(llm, prompts, ns.random_output_len, ns.sampling_params)
        if ns.profile:
            print("profile:", ", ".join(llm.stop_profile()))
        load = llm.get_server_info()["internal_states"][0]
    finally:
        llm.shutdown()
    print(f"requests {res['num_prompts']}, {res['elapsed_s']:.2f} s: {res['request_throughput']:.2f} req/s, "
          f"input {res['input_throughput_tok_s']:.1f} tok/s, output {res['output_throughput_tok_s']:.1f} tok/s "
          f"(retractions {load['retractions']})")
    if ns.result_file:
        device = torch.cuda.get_device_name() if llm.runner.device.type == "cuda" else "cpu"
        row = {"bench": "offline_throughput", "device": device, "args": dataclasses.asdict(llm.args),
               "random_input_len": ns.random_input_len, "random_output_len": ns.random_output_len,
               "sampling_params": ns.sampling_params or {"temperature": 0}, **res}
        with open(ns.result_file, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
