"""Tune kernels.fp8_gemm's tiles for one model's block-wise fp8 weight shapes on this GPU, and save the winners as data
(kernels/configs/fp8-gemm-<GPU>.json), which kernels.fp8_gemm reads at run time, as SGLang keeps its kernels'
configs (and as benchmarks.tune_moe does for the experts).

    python -m radixmesh.benchmarks.tune_fp8_gemm --model-path benchmarks/configs/llama-3.1-8b [--tp-size 1] \\
        [--block 128 128] [--shapes 6144,4096 ...] [--out radixmesh/kernels/configs]

Per weight shape (the dense projections a rank holds: q/k/v, o, gate/up and down, including a mixture of experts'
dense layers and shared expert; or --shapes) and row bucket (kernels.fp8_gemm.BUCKETS, timed at the bucket's rows):
the bucket's candidate tiles (kernels.fp8_gemm.CANDIDATES, the first the default), each checked against the twin and
timed (triton.testing.do_bench, median), activations quantized per token group as engine.quantization.fp8_linear
does. A bucket keeps a tile only where it beats the default by MARGIN, so noise does not move it off the default;
entries of other shapes in the file are kept.

Why offline (twenty-first session): the same search at every engine start (engine.decode_products, twentieth
session) compiled ~22 kernels and timed ~80 graphs, over a minute of a user's first start on an H100.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.quantization.fp8 import quantize
from radixmesh.kernels.fp8_gemm import BUCKETS, CANDIDATES, config_path, fp8_gemm, fp8_gemm_reference
from radixmesh.kernels.fp8_quant import group_quant
from radixmesh.kernels.runtime import CONFIG_DIR

MARGIN = 0.97  # a tuned tile must take at most this share of the default's time


def dense_shapes(cfg: ModelConfig, tp: int) -> list[tuple[int, int]]:
    """The [n, k] weight shapes of a rank's dense projections under `tp`-way tensor parallelism (KV heads
    replicated where they are fewer than the ranks, as engine.layers.linear.QKVParallelLinear holds them)."""
    heads, kv = cfg.num_heads // tp, max(1, cfg.num_kv_heads // tp)
    shapes = [((heads + 2 * kv) * cfg.head_dim, cfg.hidden_size), (cfg.hidden_size, heads * cfg.head_dim)]
    inters = []
    moe = cfg.moe
    if moe is None or not all(moe.sparse(layer) for layer in range(cfg.num_layers)):
        inters.append(cfg.intermediate_size)
    if moe is not None and moe.shared_expert_intermediate_size:
        inters.append(moe.shared_expert_intermediate_size)
    for inter in inters:
        shapes += [(2 * inter // tp, cfg.hidden_size), (cfg.hidden_size, inter // tp)]
    return list(dict.fromkeys(shapes))


def tune_shape(n: int, k: int, block: tuple[int, int], dtype: torch.dtype = torch.bfloat16) -> dict[str, dict]:
    """{bucket: {"tiles", "ms", "default_ms"}} for one weight shape, timed on this GPU."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w, w_scales = quantize(torch.randn((n, k), device="cuda", generator=g) / k ** 0.5, block)
    w, w_scales = w.contiguous(), w_scales.contiguous()
    out = {}
    for rows in BUCKETS:
        a, a_scales = group_quant(torch.randn((rows, k), device="cuda", dtype=dtype, generator=g), block[1])
        want = fp8_gemm_reference(a, a_scales, w, w_scales, block, dtype)
        times = {}
        for tiles in CANDIDATES[rows]:
            got = fp8_gemm(a, a_scales, w, w_scales, block, dtype, config=tiles)
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
            times[tiles] = triton.testing.do_bench(
                lambda t=tiles: fp8_gemm(a, a_scales, w, w_scales, block, dtype, config=t), warmup=10, rep=50,
                return_mode="median")
        default = CANDIDATES[rows][0]
        best = min(times, key=times.get)
        keep = best if times[best] <= MARGIN * times[default] else default
        out[str(rows)] = {"tiles": list(keep), "ms": times[keep], "default_ms": times[default]}
        print(json.dumps({"shape": f"{n},{k}", "block": list(block), "rows": rows, **out[str(rows)],
                          "all_ms": {str(list(t)): round(ms, 5) for t, ms in times.items()}}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", help="a model folder (config.json) whose dense projections are tuned")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--shapes", nargs="+", default=[], help="N,K weight shapes, instead of or besides the model's")
    ap.add_argument("--block", type=int, nargs=2, default=[128, 128], help="the weights' scale block (bn bk)")
    ap.add_argument("--out", default=str(CONFIG_DIR))
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes]
    if args.model_path:
        shapes += dense_shapes(ModelConfig.from_path(args.model_path), args.tp_size)
    if not shapes:
        ap.error("name --model-path or --shapes")
    device = torch.cuda.get_device_name()
    path = config_path(device, args.out)
    saved = json.loads(path.read_text()) if path.exists() else {"device": device, "shapes": {}}
    path.parent.mkdir(parents=True, exist_ok=True)
    for n, k in dict.fromkeys(shapes):  # written after each shape: a run cut short keeps the shapes it finished
        saved["shapes"][f"{n},{k},{args.block[0]},{args.block[1]}"] = tune_shape(n, k, tuple(args.block))
        path.write_text(json.dumps(saved, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
