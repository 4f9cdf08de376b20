"""Where an fp8 mixture-of-experts checkpoint served in fp8 parts from the same checkpoint served dequantized: greedy
tokens and logprobs of a few prompts, one engine per variant, each against the dequantized twin of its dtype.

Why (issues 51/52): tests/gpu/test_fp8_weights_cuda.py::test_the_engine_holds_moe_experts_in_fp8_in_cuda_graphs
failed on an H100 in the nineteenth session. The cause (twentieth session) was the test's twin: served from the fp8
checkpoint under `auto`, which holds fp8 weights in fp8 on an fp8 GPU, so it was never dequantized; the twin is now a
checkpoint of its own (quantization.fp8.dequantized_checkpoint), here as there. The variants switch one suspect off
at a time: CUDA graphs (and with them programmatic dependent launch between the step's kernels), the sparse layers'
gate in one launch (RADIXMESH_MOE_FUSED_GATE, read at import: each variant runs in a child process), the experts'
Triton runner (`--moe-runner-backend torch`: the experts dequantized in the forward, the projections still fp8), the
dtype.

    python -m radixmesh.benchmarks.fp8_moe_agreement --model-path models/tiny-qwen3-moe [--block 32 128]
        [--variants graphs eager unfused-gate torch-experts bf16] [--result-file out.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

# name -> (engine options, environment): each against the dequantized checkpoint with the same options and dtype
VARIANTS = {
    "graphs": ({}, {}),
    "eager": ({"disable_cuda_graph": True}, {}),
    "unfused-gate": ({}, {"RADIXMESH_MOE_FUSED_GATE": "0"}),
    "torch-experts": ({"moe_runner_backend": "torch"}, {}),
    "bf16": ({"dtype": "bfloat16"}, {}),
}
# the experts on the Triton runner (what `auto` picks on a GPU; on CPU, Triton's interpreter)
BASE = {"dtype": "float32", "skip_tokenizer_init": True, "chunked_prefill_size": 16, "random_seed": 0,
        "log_level": "warning", "moe_runner_backend": "triton"}


def serve(path: str, prompts: list[list[int]], max_new: int, device: str, opts: dict) -> list[dict]:
    """Greedy outputs with logprobs and the top two at every step, from one engine."""
    from radixmesh.engine import Engine

    llm = Engine(model_path=path, device=device, **{**BASE, **opts})
    try:
        outs = llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": max_new, "temperature": 0},
                            return_logprob=True, top_logprobs_num=2)
    finally:
        llm.shutdown()
    return [{"ids": o["output_ids"], "logprobs": [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
             "top2": [[lp for lp, _, _ in t[:2]] for t in o["meta_info"]["output_top_logprobs"]]} for o in outs]


def compare(held: list[dict], twin: list[dict]) -> dict:
    """Per prompt: the first step where the tokens part (None: never), the twin's top-two gap there, and the
    largest logprob difference before it."""
    rows = []
    for h, t in zip(held, twin):
        apart = next((i for i, (a, b) in enumerate(zip(h["ids"], t["ids"])) if a != b), None)
        upto = len(h["ids"]) if apart is None else apart
        diffs = [abs(a - b) for a, b in zip(h["logprobs"][:upto], t["logprobs"][:upto])]
        gap = None if apart is None else t["top2"][apart][0] - t["top2"][apart][1]
        rows.append({"apart_at": apart, "twin_gap_there": gap, "largest_logprob_diff": max(diffs, default=0.0)})
    return {"equal": all(r["apart_at"] is None for r in rows), "prompts": rows}


def run_variant(ns: argparse.Namespace, name: str) -> dict:
    """One variant in this process (its environment already set): the fp8 checkpoint held in fp8 against it
    dequantized."""
    import torch

    from radixmesh.engine.quantization import fp8

    opts, _ = VARIANTS[name]
    gen = torch.Generator().manual_seed(ns.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = fp8.write_checkpoint(ns.model_path, os.path.join(tmp, "fp8"),
                                    block=tuple(ns.block) if ns.block else None)
        # the twin is a checkpoint of its own (on an fp8 GPU `auto` would hold the fp8 one in fp8 too)
        twin_path = fp8.dequantized_checkpoint(path, os.path.join(tmp, "twin"))
        with open(os.path.join(path, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in ns.prompt_lens]
        held = serve(path, prompts, ns.max_new_tokens, ns.device, {**opts, "fp8_gemm_backend": "triton"})
        twin = serve(twin_path, prompts, ns.max_new_tokens, ns.device, opts)
    return {"variant": name, "block": ns.block, "device": ns.device, **compare(held, twin)}


def _child(name: str, timeout: float) -> dict:
    """One variant in a child process with its environment: its result row, or the reason it gave none."""
    cmd = [sys.executable, "-m", "radixmesh.benchmarks.fp8_moe_agreement", *sys.argv[1:], "--one", name]
    try:
        done = subprocess.run(cmd, env={**os.environ, **VARIANTS[name][1]}, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"variant": name, "error": f"no result within {timeout:.0f} s"}
    if done.returncode != 0:
        return {"variant": name, "error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="models/tiny-qwen3-moe")
    p.add_argument("--block", type=int, nargs=2, default=[32, 128], help="fp8 blocks (n k); 0 0: one scale a row")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[9, 21, 33])
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child-timeout", type=float, default=300, help="seconds a variant may take (two engines)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child's variant
    p.add_argument("--result-file")
    ns = p.parse_args()
    if ns.block == [0, 0]:
        ns.block = None
    if ns.one:
        print(json.dumps(run_variant(ns, ns.one)))
        return
    for name in ns.variants:
        row = _child(name, ns.child_timeout)
        print(json.dumps(row))
        if ns.result_file:
            with open(ns.result_file, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
