"""Greedy agreement of engine configurations with a reference one, on the same prompts.

    python -m radixmesh.benchmarks.backend_agreement --model-path benchmarks/configs/llama-3.1-8b --load-format dummy \
        --dtype bfloat16 --configs torch_native triton triton:eager flashinfer flashinfer:eager:no-overlap

A configuration is `backend[:eager][:no-overlap]` (eager: --disable-cuda-graph); the first is the reference. Each
runs in its own process (its GPU memory is gone when the next starts) and generates `--output-len` greedy tokens
with top-5 logprobs for `--num-prompts` random prompts. Reported per configuration: prompts whose tokens all equal
the reference's; for the others, where they first diverge and how close the reference's own top two were there (a
bf16 difference can only flip a near-tie); and the logprob differences on the tokens both chose before that.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from radixmesh.engine.config import EngineArgs

from radixmesh.settings import add_settings, resolve

REPO = Path(__file__).resolve().parents[2]  # the checkout: benchmarks/results, models/
TOP = 5


def config_kwargs(config: str) -> dict:
    backend, *opts = config.split(":")
    unknown = set(opts) - {"eager", "no-overlap"}
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)} in config {config!r}")
    return {"attention_backend": backend, "disable_cuda_graph": "eager" in opts,
            "disable_overlap_schedule": "no-overlap" in opts}


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(min(1000, vocab // 4), vocab - 256, (n, length), generator=gen).tolist()


def generate(kwargs: dict, inputs: list[list[int]], output_len: int) -> list[dict]:
    """Greedy outputs with top logprobs: [{"ids": [...], "logprobs": [...], "top": [[(lp, id), ...], ...]}]."""
    from radixmesh.engine import Engine

    llm = Engine(**kwargs)
    try:
        outs = llm.generate(input_ids=inputs, sampling_params={"max_new_tokens": output_len, "temperature": 0},
                            return_logprob=True, top_logprobs_num=TOP)
    finally:
        llm.shutdown()
    return [{"ids": o["output_ids"], "logprobs": [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
             "top": [[(lp, t) for lp, t, _ in row] for row in o["meta_info"]["output_top_logprobs"]]} for o in outs]


@dataclass(frozen=True, slots=True)
class Agreement:
    config: str
    identical: int
    prompts: int
    divergence_steps: list[int]
    divergence_gaps: list[float]  # reference's logprob of its token minus of the other's (inf: not in its top 5)
    logprob_diff_mean: float
    logprob_diff_max: float


def compare(config: str, ref: list[dict], got: list[dict]) -> Agreement:
    steps, gaps, diffs = [], [], []
    for r, g in zip(ref, got):
        for i, (tr, tg) in enumerate(zip(r["ids"], g["ids"])):
            if tr != tg:
                steps.append(i)
                alt = {t: lp for lp, t in r["top"][i]}
                gaps.append(r["logprobs"][i] - alt[tg] if tg in alt else float("inf"))
                break
            diffs.append(abs(r["logprobs"][i] - g["logprobs"][i]))
    same = sum(r["ids"] == g["ids"] for r, g in zip(ref, got))
    return Agreement(config, same, len(ref), steps, gaps, sum(diffs) / max(len(diffs), 1), max(diffs, default=0.0))


def run_config(base: dict, config: str, inputs: list[list[int]], output_len: int) -> list[dict]:
    """One configuration in a child process."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"kwargs": {**base, **config_kwargs(config)}, "inputs": inputs,
                                    "output_len": output_len, "out": str(Path(tmp) / "out.json")}))
        proc = subprocess.run([sys.executable, "-m", "radixmesh.benchmarks.backend_agreement", "--child", str(spec)],
                              cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"config {config} failed:\n{proc.stderr[-3000:]}")
        return json.loads((Path(tmp) / "out.json").read_text())


def agreement(base: dict, configs: list[str], num_prompts: int = 16, prompt_len: int = 200, output_len: int = 32,
              vocab: int = 128256, seed: int = 8) -> list[Agreement]:
    inputs = prompts(num_prompts, prompt_len, vocab, seed)
    ref = run_config(base, configs[0], inputs, output_len)
    return [compare(c, ref, run_config(base, c, inputs, output_len)) for c in configs[1:]]


def _child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    Path(spec["out"]).write_text(json.dumps(generate(spec["kwargs"], spec["inputs"], spec["output_len"])))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_settings(parser, EngineArgs)
    parser.add_argument("--configs", nargs="+", required=True)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--result-file")
    ns = parser.parse_args()
    base = resolve(ns, EngineArgs)[0]
    base.setdefault("skip_tokenizer_init", True)
    vocab = json.loads((Path(base["model_path"]) / "config.json").read_text())["vocab_size"]
    rows = agreement(base, ns.configs, ns.num_prompts, ns.prompt_len, ns.output_len, vocab)
    for a in rows:
        gaps = ", ".join(f"{g:.3f}" for g in a.divergence_gaps)
        print(f"{a.config:>32}: {a.identical}/{a.prompts} identical; diverge at steps {a.divergence_steps} with "
              f"reference gaps [{gaps}]; logprob diff mean {a.logprob_diff_mean:.4f} max {a.logprob_diff_max:.4f}")
    if ns.result_file:
        with open(ns.result_file, "a") as f:
            for a in rows:
                f.write(json.dumps({"bench": "backend_agreement", "reference": ns.configs[0], **asdict(a),
                                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"})
                        + "\n")


if __name__ == "__main__":
    main()
