"""Tile sweep of kernels.extend_attention on this GPU: a multi-turn wave's extend (REQS requests of NEW new tokens
over PREFIX cached tokens each, in scattered 64-token pages; Llama-3.1-8B heads) timed under each (BLOCK_M, BLOCK_N,
num_warps, num_stages). Each configuration's output is checked against the default tiles' before it is timed; ones
that do not compile (shared memory) or disagree are reported and skipped. Prints the fastest as
`best RADIXMESH_EXTEND_TILES=...` (the variable kernels.extend_attention reads).

    python -m radixmesh.benchmarks.extend_tiles [--reqs 16] [--new 512] [--prefix 2304] [--only M,N,W,S ...] \
        [--result-file F]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from radixmesh.kernels.extend_attention import _blocks, extend_attention

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 64


def _inputs(reqs: int, new: int, prefix: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    dev = torch.device("cuda")
    pages_each = -(-(prefix + new) // PAGE)
    total = reqs * pages_each + 1
    perm = torch.randperm(total - 1, generator=gen) + 1
    table = torch.zeros((reqs, pages_each * PAGE), dtype=torch.int64)
    for b in range(reqs):
        pages = perm[b * pages_each:(b + 1) * pages_each]
        table[b] = (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
    k_buf = torch.randn((total * PAGE, KV_HEADS, HEAD_DIM), generator=gen).to(torch.bfloat16).to(dev)
    v_buf = torch.randn_like(k_buf)
    n = reqs * new
    q = torch.randn((n, HEADS, HEAD_DIM), generator=gen).to(torch.bfloat16).to(dev)
    k_new = torch.randn((n, KV_HEADS, HEAD_DIM), generator=gen).to(torch.bfloat16).to(dev)
    v_new = torch.randn_like(k_new)
    lens = lambda v: torch.full((reqs,), v, dtype=torch.int64, device=dev)  # noqa: E731
    return (q, k_new, v_new, k_buf, v_buf, table.to(dev), torch.arange(reqs, device=dev), lens(prefix), lens(new),
            torch.arange(0, n, new, device=dev), new, HEAD_DIM ** -0.5)


def _time_ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reqs", type=int, default=16)
    p.add_argument("--new", type=int, default=512)
    p.add_argument("--prefix", type=int, default=2304)
    p.add_argument("--only", nargs="+", metavar="M,N,W,S", help="time only these tiles (and the default)")
    p.add_argument("--result-file")
    args = p.parse_args(argv)
    inputs = _inputs(args.reqs, args.new, args.prefix)
    default = _blocks(HEAD_DIM, torch.bfloat16, torch.device("cuda"))
    want = extend_attention(*inputs, tiles=default)
    # FLOPs: each new token's scores and values over the prefix and, causally, the new tokens before it
    keys = args.reqs * (args.new * args.prefix + args.new * (args.new + 1) / 2)
    flops = 4 * keys * HEADS * HEAD_DIM
    rows = []
    grid = [tuple(int(x) for x in t.split(",")) for t in args.only] if args.only else \
        list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)))
    for tiles in grid + ([default] if default not in grid else []):
        try:
            got = extend_attention(*inputs, tiles=tiles)
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            if err > 1e-2:
                rows.append({"tiles": tiles, "error": f"disagrees with the default tiles: relative {err:.2e}"})
                continue
            ms = _time_ms(lambda: extend_attention(*inputs, tiles=tiles))
        except Exception as e:  # noqa: BLE001 - a configuration this GPU cannot run (shared memory, registers)
            rows.append({"tiles": tiles, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        rows.append({"tiles": tiles, "ms": ms, "tflops": flops / ms / 1e9, "default": tiles == default})
        print(f"tiles {tiles}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s{' (default)' if tiles == default else ''}",
              flush=True)
    timed = [r for r in rows if "ms" in r]
    best = min(timed, key=lambda r: r["ms"])
    base = next(r for r in timed if r["default"])
    print(f"default {default}: {base['ms']:.3f} ms; best {best['tiles']}: {best['ms']:.3f} ms "
          f"({best['ms'] / base['ms'] - 1:+.1%})")
    print("best RADIXMESH_EXTEND_TILES=" + ",".join(map(str, best["tiles"])))
    if args.result_file:
        with open(args.result_file, "a") as f:
            f.write(json.dumps({"device": torch.cuda.get_device_name(), "reqs": args.reqs, "new": args.new,
                                "prefix": args.prefix, "default": default, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
