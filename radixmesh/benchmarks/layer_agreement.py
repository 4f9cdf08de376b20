"""Where a model served on one device parts from the same model served on another: one prompt's prefill through two
engines (say a GPU's defaults against the CPU's plain-torch paths, which the parity tests hold to transformers), every
module's first output recorded in the order the modules finish, and the first module whose output differs beyond a
tolerance named, with the largest differences after it.

Why: a model that is token-exact on CPU can still be wrong on a GPU (a Triton kernel compiled differently from the
interpreter, a GPU-only path); the greedy tokens say that it is wrong, this says where.

    python -m radixmesh.benchmarks.layer_agreement --model-path P [--device cuda] [--against cpu]
        [--engine-args '{"moe_runner_backend": "torch"}'] [--dtype float32] [--prompt-lens 5 41 60] [--rtol 1e-3]
"""

from __future__ import annotations

import argparse
import json

import torch


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((t for t in map(_first_tensor, out) if t is not None), None)
    return None


def record(model_path: str, device: str, dtype: str, prompts: list[list[int]], opts: dict) -> dict[str, torch.Tensor]:
    """Every module's first output during the prompts' prefill (max_new_tokens 1: one batch where the engine takes
    them together), on the CPU in float32, keyed by module name in the order the modules finished (children before
    their parents); '__tokens__' holds each prompt's token."""
    from radixmesh.engine import Engine

    llm = Engine(model_path=model_path, device=device, dtype=dtype, skip_tokenizer_init=True, random_seed=0,
                 log_level="warning", disable_radix_cache=True, **opts)
    seen: dict[str, torch.Tensor] = {}
    where: set[str] = set()
    on = [False]
    handles = []
    try:
        for name, module in llm.runner.model.named_modules():
            def hook(_m, _inp, out, name=name or "model"):
                t = _first_tensor(out)
                if on[0] and t is not None and name not in seen and t.is_floating_point():
                    seen[name] = t.detach().float().cpu().clone()
                    where.add(t.device.type)
            handles.append(module.register_forward_hook(hook))
        on[0] = True
        outs = llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1, "temperature": 0})
        on[0] = False
        seen["__tokens__"] = torch.tensor([o["output_ids"][0] for o in outs], dtype=torch.float32)
        a = llm.args
        print(f"{device}: outputs on {sorted(where)}, attention {a.prefill_attention_backend}/"
              f"{a.decode_attention_backend}, experts {a.moe_runner_backend}, graphs {not a.disable_cuda_graph}")
    finally:
        for h in handles:
            h.remove()
        llm.shutdown()
    return seen


def compare(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], rtol: float) -> list[dict]:
    """Per module in `got`'s order: its largest difference relative to the reference's largest magnitude."""
    rows = []
    for name, t in got.items():
        r = ref.get(name)
        if r is None:
            rows.append({"module": name, "note": "not in the reference"})
            continue
        if r.shape != t.shape:
            if r.numel() == t.numel():
                t = t.reshape(r.shape)
            else:
                rows.append({"module": name, "note": f"shape {tuple(t.shape)} against {tuple(r.shape)}"})
                continue
        scale = max(r.abs().max().item(), 1e-6)
        err = (t - r).abs().max().item() / scale
        rows.append({"module": name, "shape": list(r.shape), "rel_err": err, "apart": err > rtol})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--against", default="cpu", help="the reference engine's device (its defaults)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--engine-args", default="{}", help="JSON options of the engine under test")
    p.add_argument("--against-args", default="{}", help="JSON options of the reference engine")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[12], help="one prompt of each length, one batch")
    p.add_argument("--prompts", help="JSON list of token-id lists (instead of random prompts of --prompt-lens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=1e-3)
    p.add_argument("--show", type=int, default=12, help="rows printed from the first one apart")
    ns = p.parse_args()
    with open(f"{ns.model_path}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    gen = torch.Generator().manual_seed(ns.seed)
    prompts = json.loads(ns.prompts) if ns.prompts else [
        torch.randint(1, vocab, (n,), generator=gen).tolist() for n in ns.prompt_lens]
    ref = record(ns.model_path, ns.against, ns.dtype, prompts, json.loads(ns.against_args))
    got = record(ns.model_path, ns.device, ns.dtype, prompts, json.loads(ns.engine_args))
    rows = compare(ref, got, ns.rtol)
    first = next((i for i, r in enumerate(rows) if r.get("apart") or "note" in r), None)
    print(f"{len(rows)} modules; tokens {got['__tokens__'].tolist()} against {ref['__tokens__'].tolist()}; "
          + ("none apart" if first is None else f"first apart: {rows[first]['module']}"))
    for r in rows[first or 0:(first or 0) + ns.show] if first is not None else []:
        print(json.dumps(r))
    worst = sorted((r for r in rows if "rel_err" in r), key=lambda r: -r["rel_err"])[:5]
    print("largest:", json.dumps([(r["module"], round(r["rel_err"], 5)) for r in worst]))


if __name__ == "__main__":
    main()
