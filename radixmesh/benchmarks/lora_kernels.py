"""The LoRA kernels alone, as a decode step runs them: for each of a model's layers the shrink and the expand of its
four adapted modules (q/k/v, o, gate/up, down), captured in one CUDA graph per variant and replayed, so that the time
per step includes what a graph pays per kernel (launch, dependent latency) and nothing of the engine.

    python -m radixmesh.benchmarks.lora_kernels --batch 64 --adapters 8 --out result.json

Shapes: Llama-3.1-8B's by default (hidden 4096, q 4096, k/v 1024, intermediate 14336, 32 layers), rank 16, bfloat16.
Variants of the expand (`--expand`: block_n x column blocks per program x warps; a trailing "r": over partial sums
the shrink has summed, kernels.lora.REDUCE_DECODE_PARTIALS; without it over the K parts) are timed against each other
in the same process; the shrinks once, beside them, with and without that sum. The output checks each variant's sums against the first's (they make the same
roundings of the same terms). Prints ms per step and us per kernel."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from radixmesh.benchmarks.pdl_chain import _time_graph
from radixmesh.kernels.lora import lora_expand, lora_layout, lora_shrink, lora_sum_partials


def modules(hidden: int, q: int, kv: int, inter: int) -> dict[str, tuple[int, list[tuple[int, int]]]]:
    """name -> (K, [(start, width) of each fused projection's output columns])."""
    return {"qkv": (hidden, [(0, q), (q, kv), (q + kv, kv)]), "o": (q, [(0, hidden)]),
            "gate_up": (hidden, [(0, inter), (inter, inter)]), "down": (inter, [(0, hidden)])}


def build(batch: int, adapters: int, slots: int, rank: int, shapes: dict, dtype: torch.dtype, dev: str):
    """Inputs, weights and outputs of each module; rows take adapters round robin."""
    gen = torch.Generator(device=dev).manual_seed(0)
    row_slots = torch.arange(batch, device=dev) % adapters
    layout = lora_layout(row_slots, slots)
    mods = {}
    for name, (k, slices) in shapes.items():
        n = sum(w for _, w in slices)
        mods[name] = dict(
            x=torch.randn((batch, k), generator=gen, device=dev).to(dtype),
            a=(torch.randn((slots, len(slices) * rank, k), generator=gen, device=dev) * 0.02).to(dtype),
            b=(torch.randn((slots, n, rank), generator=gen, device=dev) * 0.02).to(dtype),
            out=torch.zeros((batch, n), device=dev, dtype=dtype), slices=slices)
    scalings = torch.full((slots,), 2.0, device=dev)
    return layout, mods, scalings


def time_graph(fn, replays: int) -> float:
    """ms per replay of a CUDA graph of fn() (benchmarks.pdl_chain's timing); off CUDA (Triton's interpreter: a smoke
    run), ms per call."""
    if torch.cuda.is_available():
        return _time_graph(fn, replays)
    fn()
    start = time.perf_counter()
    for _ in range(replays):
        fn()
    return 1e3 * (time.perf_counter() - start) / replays


def expander(text: str):
    """An expand variant from its name: "BLOCK_NxPER_PROGRAMxWARPS"; "r" appended: over summed partials. Returns
    (fn(partials, b, scalings, layout, slices, out), summed)."""
    summed = text.endswith("r")
    block_n, per_program, warps = (int(v) for v in text.removesuffix("r").split("x"))
    return (lambda p, b, sc, lay, sl, out: lora_expand(p, b, sc, lay, sl, out, block_n=block_n,
                                                       per_program=per_program, num_warps=warps)), summed


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8, help="distinct adapters among the rows")
    ap.add_argument("--slots", type=int, default=8, help="adapter slots on the device (--max-loras-per-batch)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--shape", default="4096,4096,1024,14336", help="hidden,q,kv,intermediate")
    ap.add_argument("--expand", nargs="+", default=["128x1x4r", "128x4x4r", "64x1x4r", "256x1x8r", "128x1x4",
                                                       "128x4x4"],
                    help="expand variants (benchmarks.lora_kernels.expander); the first is the default tiling")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None)
    ns = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = modules(*(int(v) for v in ns.shape.split(",")))
    layout, mods, scalings = build(ns.batch, ns.adapters, ns.slots, ns.rank, shapes, torch.bfloat16, dev)
    partials = {name: lora_shrink(m["x"], m["a"], layout, reduce=False) for name, m in mods.items()}  # K parts
    result = {"bench": "lora_kernels", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "batch": ns.batch,
              "adapters": ns.adapters, "slots": ns.slots, "rank": ns.rank, "layers": ns.layers, "shape": ns.shape,
              "runs": []}

    def shrinks():
        for _ in range(ns.layers):
            for m in mods.values():
                lora_shrink(m["x"], m["a"], layout, reduce=False)

    def summed_shrinks():
        for _ in range(ns.layers):
            for m in mods.values():
                lora_shrink(m["x"], m["a"], layout, reduce=True)

    for label, fn in (("shrink", shrinks), ("shrink+sum", summed_shrinks)):
        ms = time_graph(fn, ns.replays)
        result["runs"].append({"kernel": label, "ms_per_step": ms, "us_per_kernel": 1e3 * ms / (4 * ns.layers)})
        print(f"{label:28s}{ms:7.3f} ms/step {1e3 * ms / (4 * ns.layers):7.2f} us/kernel", flush=True)
    summed = {name: lora_sum_partials(p) for name, p in partials.items()}
    first = None
    for text in ns.expand:
        expand, reduced = expander(text)
        parts = summed if reduced else partials

        def expands(expand=expand, parts=parts):
            for _ in range(ns.layers):
                for name, m in mods.items():
                    expand(parts[name], m["b"], scalings, layout, m["slices"], m["out"])

        once = {name: torch.zeros_like(m["out"]) for name, m in mods.items()}
        for name, m in mods.items():
            expand(parts[name], m["b"], scalings, layout, m["slices"], once[name])
        if first is None:
            first = once
        same = all(torch.equal(first[k], v) for k, v in once.items())
        ms = time_graph(expands, ns.replays)
        per_module = {}
        for name, m in mods.items():
            one = time_graph(lambda expand=expand, parts=parts, name=name, m=m: [expand(
                parts[name], m["b"], scalings, layout, m["slices"], m["out"]) for _ in range(ns.layers)], ns.replays)
            per_module[name] = 1e3 * one / ns.layers
        result["runs"].append({"kernel": "expand", "variant": text, "ms_per_step": ms,
                               "us_per_kernel": 1e3 * ms / (4 * ns.layers), "us_by_module": per_module,
                               "same_sums": same})
        print(f"expand {text:>10} {'' if same else '(sums differ)':>12} {ms:7.3f} ms/step "
              f"{1e3 * ms / (4 * ns.layers):7.2f} us/kernel  "
              + " ".join(f"{k} {v:.2f}" for k, v in per_module.items()), flush=True)
    if ns.out:
        ns.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
