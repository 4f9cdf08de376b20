"""The projections of a decode step alone, chained as the model chains them, in one CUDA graph: cuBLAS (F.linear),
cuBLASLt (F.linear with PyTorch's BLAS backend switched to it) and kernels.gemv with and without programmatic dependent launch (and its L2 pull of the opening weight columns),
in ms per chain and as a fraction of the weight-read floor from this run's copy bandwidth.

The chain is the Llama-3.1-8B shape: per layer qkv [6144, 4096] -> o_proj [4096, 4096] -> gate_up [28672, 4096] ->
down [4096, 14336], 32 layers, then the LM head [128256, 4096]; 15.0 GB of weights, so every product streams from
HBM. Each product reads the previous one's output (sliced to its width), so a kernel cannot start its reads of x
before the one before has written it. First, each variant's products are checked against the float32 twin.

    python -m radixmesh.benchmarks.pdl_chain [--rows 1 8] [--result-file out.jsonl]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from radixmesh.kernels.gemv import gemv, gemv_reference
from radixmesh.kernels.runtime import pdl_supported

HIDDEN, INTER, QKV, VOCAB, LAYERS = 4096, 14336, 6144, 128256, 32


def _weights(dev) -> tuple[list[tuple[torch.Tensor, ...]], torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(0)

    def w(n, k):
        return (torch.randn((n, k), device=dev, dtype=torch.bfloat16, generator=g) / k ** 0.5).contiguous()

    layers = [(w(QKV, HIDDEN), w(HIDDEN, HIDDEN), w(2 * INTER, HIDDEN), w(HIDDEN, INTER)) for _ in range(LAYERS)]
    return layers, w(VOCAB, HIDDEN)


def _chain(product, layers, head, x):
    h = x
    for qkv, o, gate_up, down in layers:
        a = product(h, qkv)[:, :HIDDEN]
        b = product(a, o)
        c = product(b, gate_up)[:, :INTER]
        h = product(c, down)
    return product(h, head)


def _variants(configs: list[str]) -> dict:
    """cuBLAS, kernels.gemv with its default tiles and plain launches, and kernels.gemv with PDL per config
    "BLOCK_N up to 8192 columns,BLOCK_N above,BLOCK_K,warps,stages,L2-pulled columns"."""
    out = {"cublas": lambda x, w: F.linear(x, w), "cublaslt": _on_cublaslt, "triton": lambda x, w: gemv(x, w)}
    for text in configs:
        small, large, block_k, warps, stages, pre = (int(v) for v in text.split(","))

        def run(x, w, small=small, large=large, block_k=block_k, warps=warps, stages=stages, pre=pre):
            block_n = small if w.shape[0] <= 8192 else large
            return gemv(x, w, pdl=True, config=(block_n, min(block_k, w.shape[1]), warps, stages, pre))
        out[f"pdl {text}"] = run
    return out


def _on_cublaslt(x, w):
    """F.linear with PyTorch's BLAS backend set to cuBLASLt for this call (read per call, so a graph captures the
    cuBLASLt kernel); other calls keep the default (cuBLAS)."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, w)
    finally:
        torch.backends.cuda.preferred_blas_library(before)


ROLES = {(QKV, HIDDEN): "qkv", (HIDDEN, HIDDEN): "o", (2 * INTER, HIDDEN): "gate_up", (HIDDEN, INTER): "down",
         (VOCAB, HIDDEN): "head"}


def _mixes(mixes: list[str]) -> dict:
    """Per mix "role+role...": those roles' products (qkv, o, gate_up, down, head) on kernels.gemv under PDL with its
    default tiles, the others on cuBLAS."""
    out = {}
    for text in mixes:
        roles = set(text.split("+"))
        unknown = roles - set(ROLES.values())
        if unknown:
            raise SystemExit(f"--mixes: unknown roles {sorted(unknown)} (known: {sorted(ROLES.values())})")

        def run(x, w, roles=roles):
            return gemv(x, w, pdl=True) if ROLES[tuple(w.shape)] in roles else F.linear(x, w)
        out[f"mix gemv:{text}"] = run
    return out


def _role_ms(variants: dict, layers, head, m: int, dev, copy_gbps: float) -> list[dict]:
    """Each role's products alone, chained (32 of them; the LM head once): cuBLAS, cuBLASLt and every PDL config, us
    per product."""
    rows = []
    x = {k: torch.randn((m, k), device=dev, dtype=torch.bfloat16) for k in (HIDDEN, INTER)}
    by_role = {"qkv": [l[0] for l in layers], "o": [l[1] for l in layers], "gate_up": [l[2] for l in layers],
               "down": [l[3] for l in layers], "head": [head]}
    for name in ("cublas", "cublaslt", *[v for v in variants if v.startswith("pdl ")]):
        product = variants[name]
        for role, ws in by_role.items():
            ms = _time_graph(lambda: [product(x[w.shape[1]], w) for w in ws])
            us = ms * 1e3 / len(ws)
            floor_us = ws[0].numel() * 2 / copy_gbps / 1e3
            rows.append({"variant": name, "role": role, "rows": m, "us_per_product": us, "floor_us": floor_us,
                         "x_floor": us / floor_us})
            print(f"rows {m:2d} {name:>24} {role:>8}: {us:8.2f} us a product  {us / floor_us:.3f}x its floor")
    return rows


def _copy_gbps(dev) -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * 10 * a.numel() / (start.elapsed_time(end) / 1e3) / 1e9  # read + write


def write_rows(path: str | None, rows: list[dict]) -> None:
    """Append `rows` to `path` as JSON lines (nothing without a path)."""
    if path:
        with open(path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def _time_graph(fn, reps: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _check(variants, dev) -> dict:
    """Largest error of each variant's product against the float32 twin, over the five shapes at 1 and 8 rows, in
    units of the twin's largest magnitude (bf16 output: ~4e-3 is one rounding). A variant whose tiles do not fit the
    GPU is dropped from `variants`."""
    g = torch.Generator(device=dev).manual_seed(1)
    errs = {}
    for name, product in list(variants.items()):
        worst = 0.0
        for n, k in ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER), (VOCAB, HIDDEN)):
            w = torch.randn((n, k), device=dev, dtype=torch.bfloat16, generator=g) / k ** 0.5
            for m in (1, 8):
                x = torch.randn((m, k), device=dev, dtype=torch.bfloat16, generator=g)
                want = gemv_reference(x, w).float()
                try:
                    got = product(x, w).float()
                except OutOfResources as e:  # a tile too large for this GPU's shared memory
                    print(f"{name}: {e}")
                    del variants[name]
                    break
                worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
            if name not in variants:
                break
        errs[name] = worst
    return errs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--configs", nargs="+", default=["16,32,512,4,4,0", "16,32,512,4,4,1024",
                                                          "16,32,512,4,4,2048", "16,32,512,4,4,4096"],
                        help="kernels.gemv tiles with PDL: BLOCK_N (n <= 8192),BLOCK_N (larger),BLOCK_K,warps,"
                             "stages,columns of each program's weight rows pulled into L2 before the wait")
    parser.add_argument("--mixes", nargs="*", default=[],
                        help="role sets (qkv, o, gate_up, down, head joined by +) run on kernels.gemv with PDL, the "
                             "rest on cuBLAS, e.g. qkv+o")
    parser.add_argument("--per-role", action="store_true",
                        help="also time each role's products alone, chained: cuBLAS and every --configs entry "
                             "(--rounds 0: only that)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--result-file")
    ns = parser.parse_args()
    dev = torch.device("cuda")
    print(f"pdl supported: {pdl_supported()}")
    variants = {**_variants(ns.configs), **_mixes(ns.mixes)}
    errs = _check(variants, dev)
    print("largest error / largest output:", {k: f"{v:.2e}" for k, v in errs.items()})
    layers, head = _weights(dev)
    nbytes = sum(t.numel() * 2 for layer in layers for t in layer) + head.numel() * 2
    copy = _copy_gbps(dev)
    floor_ms = nbytes / copy / 1e6
    print(f"weights {nbytes / 1e9:.2f} GB, copy {copy:.0f} GB/s, floor {floor_ms:.3f} ms")
    rows = []
    if ns.per_role:
        for m in ns.rows:
            rows += [{**r, "copy_GBps": copy, "device": torch.cuda.get_device_name()}
                     for r in _role_ms(variants, layers, head, m, dev, copy)]
    for round_ in range(ns.rounds):
        for m in ns.rows:
            x = torch.randn((m, HIDDEN), device=dev, dtype=torch.bfloat16)
            for name, product in variants.items():
                ms = _time_graph(lambda: _chain(product, layers, head, x))
                row = {"variant": name, "rows": m, "round": round_, "ms": ms, "floor_ms": floor_ms,
                       "x_floor": ms / floor_ms, "copy_GBps": copy, "max_rel_err": errs[name],
                       "device": torch.cuda.get_device_name()}
                rows.append(row)
                print(f"round {round_} rows {m:2d} {name:>24}: {ms:.3f} ms  {ms / floor_ms:.3f}x floor")
    write_rows(ns.result_file, rows)


if __name__ == "__main__":
    main()
