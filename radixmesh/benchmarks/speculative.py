"""Speculative decoding (--speculative-algorithm NGRAM; STANDALONE with --draft-model-path; EAGLE and EAGLE3 with
--eagle-head / --eagle3-head) against plain decoding, through the public Engine API.

    python -m radixmesh.benchmarks.speculative --model-path meta-llama/Llama-3.1-8B-Instruct \\
        --draft-tokens 2,4,6,8 [--draft-model-path meta-llama/Llama-3.2-1B-Instruct] \\
        [--eagle3-head yuhuili/EAGLE3-LLaMA3.1-Instruct-8B] --out benchmarks/results/<date>-<device>-speculative.json

Workloads whose continuations are predictable. For each seed prompt P the plain engine first decodes its greedy
continuation G. `repeat`: P asked again (a retried or repeated question, an agent re-running a step): each engine has
served the run's requests once before, at the same concurrency, so the n-gram corpus of finished requests holds P and
the engine's own continuation (`same_as_before`: the measured outputs equal that run's). `quote`: P + G + P, the
model's own continuation in the prompt (as code edits and summaries quote their source): drafts come from the
request's own sequence, and are kept where the model repeats what it said (a trained model does; random weights do
not). Both engines decode --max-new-tokens greedily. Decode speed is a request's streamed tokens after its first,
over the time from its first token to its last (prefill excluded), run one at a time (batch 1) or `--streams` at once;
the speculative engine reports its acceptance length (tokens per decode forward, from meta_info). Outputs are compared
token for token with the plain engine's (`token_exact`, and `matching`: the share of tokens before the first
difference: in bfloat16 a verify, a decode batch of several rows per request, rounds as a plain decode of one row
does only where their kernels do).

`--verify-cost` adds the ceiling: one request of --context tokens, the seconds of a plain decode forward and of a
verify forward of 1 + k tokens for each k (the model runner directly, as engine.bench_one_batch times steps), so a
kept draft's worth is visible apart from the acceptance rate.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from radixmesh.engine import Engine

SEEDS = [
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "Summarize the following meeting notes in three bullet points.\n\nNotes: The team reviewed the Q3 roadmap.",
    "The history of the printing press begins in the fifteenth century, when",
    "SELECT customers.name, SUM(orders.total) FROM customers JOIN orders ON",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "class LRUCache:\n    def __init__(self, capacity: int):\n",
    "Explain how a hash map handles collisions, with an example in Python.",
    "The quick brown fox jumps over the lazy dog. Translate this sentence into French, German and Spanish.",
]


WORKLOADS = ("repeat", "quote")  # in this order: `repeat` fills the corpus with P + G, which `quote` then ties


def workloads(plain: Engine, n: int, new_tokens: int) -> dict[str, list[list[int]]]:
    """{"repeat": [P], "quote": [P + G + P]} for n seed prompts P (G: the plain engine's greedy continuation)."""
    prompts = [plain.tokenizer.encode(s) for s in (SEEDS * (n // len(SEEDS) + 1))[:n]]
    outs = plain.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": new_tokens})
    return {"repeat": prompts, "quote": [p + o["output_ids"] + p for p, o in zip(prompts, outs)]}


def runs_of(prompts: list[list[int]], streams: int, count: int) -> list[list[int]]:
    """The requests of a run at `streams`: `count` (--prompts) of them, or `streams` where that is more."""
    return prompts[:max(count, streams)]


def warm_up(engine: Engine, vocab: int, streams: int) -> None:
    """Kernels compiled and graphs touched at this concurrency, on prompts that share nothing with the workloads."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(100, vocab, (96,), generator=gen).tolist() for _ in range(streams)]
    engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 16})


def matching(got: list[int], want: list[int]) -> int:
    """Tokens of `got` before its first difference from `want`."""
    n = 0
    for a, b in zip(got, want):
        if a != b:
            break
        n += 1
    return n


def measure(engine: Engine, workload: str, prompts: list[list[int]], new_tokens: int, streams: int) -> dict:
    """decode_speed; for `repeat`, after the same requests ran once at the same concurrency (unmeasured), with
    `same_as_before`: whether the measured outputs equal that run's."""
    if workload != "repeat":
        return decode_speed(engine, prompts, new_tokens, streams)
    before = decode_speed(engine, prompts, new_tokens, streams)["outputs"]
    out = decode_speed(engine, prompts, new_tokens, streams)
    out["same_as_before"] = out["outputs"] == before
    return out


def decode_speed(engine: Engine, prompts: list[list[int]], new_tokens: int, streams: int) -> dict:
    """Streamed decode tok/s (tokens after the first over first-to-last token time), outputs, accept length."""
    params = {"temperature": 0, "max_new_tokens": new_tokens}

    def one(ids: list[int]) -> tuple[int, float, list[int], dict]:
        first = last = None
        out = None
        for out in engine.generate(input_ids=ids, sampling_params=params, stream=True):
            now = time.perf_counter()
            first = first or now
            last = now
        return len(out["output_ids"]) - 1, last - first, out["output_ids"], out["meta_info"]

    with ThreadPoolExecutor(streams) as pool:
        started = time.perf_counter()
        runs = list(pool.map(one, prompts))
        wall = time.perf_counter() - started
    tokens = sum(r[0] for r in runs)
    per_stream = [r[0] / r[1] for r in runs if r[1] > 0]
    metas = [r[3] for r in runs]
    out = {"streams": streams, "requests": len(prompts), "decode_tokens": tokens,
           "tok_s_per_stream": statistics.mean(per_stream), "tok_s_total": sum(len(r[2]) for r in runs) / wall,
           "outputs": [r[2] for r in runs]}
    if "spec_verify_ct" in metas[0]:
        forwards = sum(m["spec_verify_ct"] for m in metas)
        kept = sum(m["spec_accept_token_num"] for m in metas)
        out.update(accept_length=(forwards + kept) / forwards, drafted=sum(m["spec_draft_token_num"] for m in metas),
                   accepted=kept)
    return out


def verify_cost(engine: Engine, context: int, ks: list[int], steps: int) -> dict:
    """Seconds of a plain decode forward and of verify forwards of 1 + k tokens, one request of `context` tokens."""
    from radixmesh.engine.bench_one_batch import _make_reqs, _sync, prefill
    from radixmesh.engine.scheduler.batch_builder import build_decode, build_verify

    runner, cache = engine.runner, engine.cache

    def run() -> dict:
        req = _make_reqs(cache, 1, context, runner.model_config.vocab_size, torch.Generator().manual_seed(0))[0]
        req.output_ids.append(prefill(runner, cache, [req])[0])
        out = {}
        try:
            for k in [0, *ks]:
                times = []
                for i in range(steps + 3):
                    req.extend_len = 1 + k
                    if cache.alloc_tokens(req, 1 + k) is None:
                        raise RuntimeError("KV pool too small")
                    locs = cache.slots_of_new_tokens([req])
                    batch = build_decode([req], locs, runner.device) if k == 0 else \
                        build_verify([req], [[7] * k], locs, runner.device, 1 + k)
                    _sync(runner.device)
                    t0 = time.perf_counter()
                    runner.forward(batch)
                    _sync(runner.device)
                    if i >= 3:
                        times.append(time.perf_counter() - t0)
                    cache.trim(req, req.kv_len)  # nothing kept: the same context every time
                out["decode" if k == 0 else f"verify_k{k}"] = statistics.median(times)
        finally:
            cache.release(req)
        return out

    return engine.scheduler.call(run).result()  # on the scheduler thread, between steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m radixmesh.benchmarks.speculative", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--draft-tokens", default="4,8", help="--speculative-num-draft-tokens values, comma-separated")
    ap.add_argument("--draft-model-path", default=None, help="also run STANDALONE with this draft model")
    ap.add_argument("--eagle-head", default=None, help="also run EAGLE with this head (an EAGLE checkpoint or config)")
    ap.add_argument("--eagle3-head", default=None, help="also run EAGLE3 with this head")
    ap.add_argument("--skip-ngram", action="store_true", help="run the draft models only")
    ap.add_argument("--prompts", type=int, default=8, help="requests per run (at least --streams of them)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--streams", default="1", help="concurrent requests, comma-separated (1: batch 1)")
    ap.add_argument("--verify-cost", action="store_true")
    ap.add_argument("--context", type=int, default=1024, help="--verify-cost's context length")
    ap.add_argument("--engine-args", default="{}", help="more Engine keyword arguments, as JSON")
    ap.add_argument("--out", type=Path, default=None)
    ns = ap.parse_args(argv)
    common = {"model_path": ns.model_path, "dtype": ns.dtype, "log_level": "warning", **json.loads(ns.engine_args)}
    if ns.device:
        common["device"] = ns.device
    streams = [int(x) for x in ns.streams.split(",")]
    record = {"bench": "speculative", "command": "python -m radixmesh.benchmarks.speculative " +
              " ".join(sys.argv[1:] if argv is None else argv), "date": datetime.date.today().isoformat(),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "runs": []}
    plain = Engine(**common)
    vocab = plain.model_config.vocab_size
    try:
        prompts = workloads(plain, max(ns.prompts, *streams), ns.max_new_tokens)
        warm_up(plain, vocab, max(streams))
        base = {(w, s): measure(plain, w, runs_of(prompts[w], s, ns.prompts), ns.max_new_tokens, s)
                for w in WORKLOADS for s in streams}
        if ns.verify_cost:
            widest = max(int(n) for n in ns.draft_tokens.split(","))
            record["verify_cost_s"] = verify_cost(plain, ns.context, list(range(1, widest)), steps=20)
    finally:
        plain.shutdown()
    for (w, s), b in base.items():
        record["runs"].append({"algorithm": None, "workload": w, **{k: v for k, v in b.items() if k != "outputs"}})
        print(f"plain      {w:6s} streams {s:4d}: {b['tok_s_per_stream']:9.1f} tok/s per stream", flush=True)
    algorithms = [] if ns.skip_ngram else [("NGRAM", {})]
    for algo, path in (("STANDALONE", ns.draft_model_path), ("EAGLE", ns.eagle_head), ("EAGLE3", ns.eagle3_head)):
        if path:
            algorithms.append((algo, {"speculative_draft_model_path": path}))
    for algo, extra in algorithms:
        for n in ns.draft_tokens.split(","):
            spec = Engine(**common, **extra, speculative_algorithm=algo, speculative_num_draft_tokens=int(n))
            try:
                warm_up(spec, vocab, max(streams))
                for w in WORKLOADS:
                    for s in streams:
                        r = measure(spec, w, runs_of(prompts[w], s, ns.prompts), ns.max_new_tokens, s)
                        want = base[(w, s)]["outputs"]
                        outs = r.pop("outputs")
                        same = sum(matching(g, x) for g, x in zip(outs, want)) / max(1, sum(map(len, want)))
                        speedup = r["tok_s_per_stream"] / base[(w, s)]["tok_s_per_stream"]
                        record["runs"].append({"algorithm": algo, "num_draft_tokens": int(n), "workload": w, **r,
                                               "speedup_per_stream": speedup, "token_exact": outs == want,
                                               "matching": same})
                        print(f"{algo:10s} n={n:>2} {w:6s} streams {s:4d}: {r['tok_s_per_stream']:9.1f} tok/s per "
                              f"stream ({speedup:.2f}x), accept length {r['accept_length']:.2f}, matching {same:.3f}"
                              + (f", same as before {r['same_as_before']}" if "same_as_before" in r else ""),
                              flush=True)
            finally:
                spec.shutdown()
    if "verify_cost_s" in record:
        print("verify cost (s):", json.dumps(record["verify_cost_s"]))
    if ns.out:
        ns.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0 if all(r.get("token_exact", True) for r in record["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
