"""Tune the mixture-of-experts grouped GEMMs (kernels.moe) for one model's layer shape on this GPU, and save the best
tiles as data (kernels/configs/moe-<GPU>.json), which kernels.moe.tiles reads at run time, as SGLang keeps its
fused-MoE configs.

    python -m radixmesh.benchmarks.tune_moe --model-path benchmarks/configs/qwen3-30b-a3b --tp-size 1 \\
        --tokens 1 64 256 2048 [--out radixmesh/kernels/configs]

Per token count: random routing (uniform over the experts), bfloat16 weights; for each BLOCK_M that suits the count,
every tile of the grid for the gate/up GEMM and for the down GEMM, each checked against the default tiles' output
and timed (triton.testing.do_bench, median); the BLOCK_M whose two best GEMMs sum to the least wins. Under tensor
parallelism a rank holds 1/tp of each expert's intermediate rows: tune with --tp-size."""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from radixmesh.engine.model_config import ModelConfig
from radixmesh.kernels.moe import (CONFIG_DIR, Tiles, _grouped_gemm, align_by_expert, config_path, layer_key,
                                   route_reference)

GRID = [Tiles(n, k, 4, s) for n, k, s in itertools.product((64, 128), (64, 128, 256), (3, 4))]


def _block_ms(tokens: int) -> list[int]:
    return [16] if tokens <= 64 else [16, 32] if tokens <= 512 else [32, 64]


def _best(run, want: torch.Tensor) -> tuple[Tiles, float]:
    best = (Tiles(), float("inf"))
    for t in GRID:
        try:
            out = run(t)
        except Exception:  # noqa: BLE001 - a tile too large for the GPU's shared memory
            continue
        if not torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2):
            raise AssertionError(f"tiles {t} disagree with the default tiles")
        ms = triton.testing.do_bench(lambda: run(t), warmup=5, rep=40, return_mode="median")
        best = min(best, (t, ms), key=lambda b: b[1])
    return best


def tune(experts: int, hidden: int, inter: int, top_k: int, tokens: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * inter ** -0.5).to(torch.bfloat16)
    weights, ids = route_reference(torch.randn(tokens, experts, device="cuda", generator=gen), top_k, True,
                                   torch.bfloat16)
    n_slots, flat_w = tokens * top_k, weights.flatten().contiguous()
    act = torch.randn(n_slots, inter, device="cuda", generator=gen).to(torch.bfloat16)
    rows = []
    for bm in _block_ms(tokens):
        slots, blocks = align_by_expert(ids, experts, bm)
        up = lambda t: _grouped_gemm(x, w13, slots, blocks, n_slots, top_k, None, False, bm, t)  # noqa: E731
        down = lambda t: _grouped_gemm(act, w2, slots, blocks, n_slots, 1, flat_w, False, bm, t)  # noqa: E731
        (up_t, up_ms), (down_t, down_ms) = _best(up, up(Tiles())), _best(down, down(Tiles()))
        rows.append({"block_m": bm, "up": up_t._asdict(), "down": down_t._asdict(), "ms": up_ms + down_ms,
                     "up_ms": up_ms, "down_ms": down_ms})
        print(json.dumps({"tokens": tokens, **rows[-1]}), flush=True)
    return min(rows, key=lambda r: r["ms"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 2048])
    ap.add_argument("--out", default=str(CONFIG_DIR))
    args = ap.parse_args()
    cfg = ModelConfig.from_path(args.model_path)
    if cfg.moe is None:
        ap.error(f"{cfg.architecture} has no mixture-of-experts layers")
    inter = cfg.moe.intermediate_size // args.tp_size
    device = torch.cuda.get_device_name()
    path = config_path(device, args.out)
    saved = json.loads(path.read_text()) if path.exists() else {"device": device, "shapes": {}}
    key = layer_key(cfg.moe.num_experts, 2 * inter, cfg.hidden_size)
    entries = saved["shapes"].setdefault(key, {})
    for tokens in args.tokens:
        entries[str(tokens)] = tune(cfg.moe.num_experts, cfg.hidden_size, inter, cfg.moe.top_k, tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(saved, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
