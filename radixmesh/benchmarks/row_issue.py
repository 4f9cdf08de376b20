"""What a one-row decode product costs the SMs' instruction issue, read from its sm_90 machine code on any machine
(no GPU): kernels.fp8_gemv's and kernels.gemv's one-row kernels compiled by Triton for an H100/H200 with the tiles
asked, then their registers a thread (cuobjdump), spilled bytes, and instructions a thread by opcode (nvdisasm, the
tools Triton's wheel carries). From those: the weight bytes a program reads, the instructions a warp issues per weight
byte, the programs an SM holds (registers and warps), and the weight stream an H100 could issue for at most (132 SMs,
four warp instructions a clock each, 1.755 GHz) if issue were the only limit.

Why (issue 52, nineteenth session): inside the 8B batch-1 step the fp8 one-row products stream at 1.10-1.42x their
floors where the bf16 ones of the same shapes run 0.96-1.11x; the fp8 kernel does twice the multiply-adds a byte and
converts every weight (e4m3x2 -> f16x2 -> f32), so its tiles are worth comparing in instructions a byte before any
device time is spent. A static count: it says nothing of memory latency, and a loop the compiler did not unroll is
counted once (every tile here unrolls fully: the K loop is a static_range). The code is this machine's Triton's
(recorded in each row); a GPU machine's Triton may allocate registers differently.

    python -m radixmesh.benchmarks.row_issue [--k 4096 14336] [--fp8-tiles 2,4096,8 8,512,2] [--bf16-tiles 2,2048,4]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

SMS, ISSUE_PER_CLOCK, CLOCK_HZ = 132, 4 * 32, 1.755e9  # H100 SXM: thread-instructions an SM issues a clock
MAX_WARPS, REGISTERS = 64, 65536  # an sm_90 SM's resident warps and registers
# the one-row plans' tiles (engine.decode_products: FP8_ROW_TILES and what an 8B step chose on an H100, 2026-12-06;
# kernels.gemv.ROW_CONFIG), then tiles with more rows or fewer threads a row
FP8_TILES = ("2,2048,4", "2,4096,4", "4,2048,4", "2,4096,8", "8,1024,4", "4,4096,8", "4,2048,8", "8,512,2", "4,512,2",
             "16,256,4", "2,2048,4,16", "4,2048,4,16", "8,1024,4,16", "2,1024,2,16")  # (the last four: products
# summed 16 at a time first, kernels.fp8_gemv's GROUP)
BF16_TILES = ("2,2048,4",)
ALIGNED = ("X", "W", "S", "B", "Y", "N", "stride_wn")  # what a launch finds divisible by 16


def _tools() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_row(kind: str, k: int, block_n: int, block_k: int, warps: int, group: int = 1):
    """The one-row kernel of `kind` ("fp8": per-channel scales, each thread's `group` consecutive products summed
    first, or "bf16") for weights [n, k], compiled for sm_90 under programmatic dependent launch: Triton's
    CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from radixmesh.kernels import fp8_gemv, gemv

    block_k = min(block_k, triton.next_power_of_2(k))
    if kind == "fp8":
        fn, pointers = fp8_gemv._fp8_gemv_row_kernel, dict(X="*bf16", W="*fp8e4nv", S="*fp32", B="*bf16", Y="*bf16")
        constexprs = dict(K=k, BLOCK_N=block_n, BLOCK_K=block_k, BN=1, BK=1, BLOCKWISE=False, PDL=True,
                          HAS_BIAS=False, GROUP=min(group, block_k))
    elif kind == "bf16" and group == 1:
        fn, pointers = gemv._gemv_row_kernel, dict(X="*bf16", W="*bf16", B="*bf16", Y="*bf16")
        constexprs = dict(K=k, BLOCK_N=block_n, BLOCK_K=block_k, PREFETCH_LINES=0, LINE_ELEMS=64, PDL=True,
                          HAS_BIAS=False)
    else:
        raise ValueError(f"kind is 'fp8' or 'bf16' (without groups), got {kind!r} (group {group})")
    signature = {n: pointers.get(n) or ("constexpr" if n in constexprs else "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in ALIGNED}
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1})


def machine_code(cubin: bytes) -> tuple[int, int, collections.Counter]:
    """(registers a thread, stack bytes a thread (where registers spill), instructions by opcode, NOPs left out) of
    a one-kernel cubin, by Triton's cuobjdump and nvdisasm."""
    tools = _tools()
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z0-9_]+)", sass, re.M)
    return regs, stack, collections.Counter(op for op in ops if op != "NOP")


def row_cost(kind: str, k: int, block_n: int, block_k: int, warps: int, group: int = 1) -> dict:
    """One tile's static cost (module docstring)."""
    kernel = compile_row(kind, k, block_n, block_k, warps, group)
    import triton

    regs, stack, ops = machine_code(kernel.asm["cubin"])
    weight_bytes = block_n * k * (1 if kind == "fp8" else 2)  # a program's rows
    per_byte = sum(ops.values()) * 32 * warps / weight_bytes  # thread-instructions a weight byte
    programs = min(REGISTERS // (max(regs, 1) * 32 * warps), MAX_WARPS // warps)
    bound = SMS * ISSUE_PER_CLOCK * CLOCK_HZ / per_byte / 1e12
    return {"kind": kind, "k": k, "tile": [block_n, block_k, warps] + ([group] if group > 1 else []),
            "triton": triton.__version__,
            "registers": regs, "stack_bytes": stack, "instructions_per_thread": sum(ops.values()),
            "instructions_per_byte": round(per_byte, 2), "programs_per_sm": programs,
            "issue_bound_tbps": round(bound, 2), "opcodes": dict(ops.most_common())}


def _tile(text: str) -> tuple[int, ...]:
    try:
        tile = tuple(int(v) for v in text.split(","))
    except ValueError:
        tile = ()
    if len(tile) not in (3, 4):
        raise argparse.ArgumentTypeError(f"a tile is BLOCK_N,BLOCK_K,num_warps[,GROUP]; got {text!r}")
    return tile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, nargs="+", default=[4096, 14336], help="the weights' K (the 8B shape's)")
    p.add_argument("--fp8-tiles", type=_tile, nargs="*", default=[_tile(t) for t in FP8_TILES])
    p.add_argument("--bf16-tiles", type=_tile, nargs="*", default=[_tile(t) for t in BF16_TILES])
    p.add_argument("--result-file", help="append one JSON line a tile")
    ns = p.parse_args()
    for k in ns.k:
        for kind, tiles in (("fp8", ns.fp8_tiles), ("bf16", ns.bf16_tiles)):
            for tile in tiles:
                row = row_cost(kind, k, *tile)
                print(f"{kind:4} K={k:5} {str(tuple(row['tile'])):15} {row['registers']:3} registers, "
                      f"{row['stack_bytes']:5} B stack, {row['programs_per_sm']:2} programs an SM, "
                      f"{row['instructions_per_byte']:5.2f} instructions a weight byte: issue bound "
                      f"{row['issue_bound_tbps']:5.2f} TB/s")
                if ns.result_file:
                    with open(ns.result_file, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
