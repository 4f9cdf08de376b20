"""Pull a weight into the GPU's L2 cache ahead of the matrix product that reads it, and its plain-torch twin.

A batch-1 decode step streams every weight once, and between the products the memory bus idles: rotary, the KV
store and attention take ~10 us a layer and read almost nothing. Reading the o_proj weight (32 MiB for the 8B shape,
under an H100's 50 MiB L2) on a side stream in that window lets the product that follows find it in L2.

Two ways to pull, one result: `mode="load"` reads the lines and sums them (the sum is the kernel's checkable
output, and this mode runs in Triton's interpreter); `mode="hint"` issues one `prefetch.global.L2` per 128-byte
line and keeps nothing (compiled CUDA only; it writes zeros as its sums).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LINE_BYTES = 128


@triton.jit
def _pull_kernel(ptr, n_elems, sums, BLOCK: tl.constexpr, ITERS: tl.constexpr, HINT: tl.constexpr,
                 LINE: tl.constexpr):
    # Program p reads blocks p, p + P, p + 2P, ... (P programs): neighbouring programs read neighbouring memory.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        offs = (pid + i * nprog).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if HINT:
            # offs count lines here (LINE elements each); past the end, the last line again (a hint never faults
            # on a mapped address)
            first = tl.minimum(offs * LINE, n_elems - 1)
            addr = ptr + first
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                      [addr], dtype=tl.int32, is_pure=False, pack=1)
        else:
            x = tl.load(ptr + offs, mask=offs < n_elems, other=0.0, cache_modifier=".cg")
            acc += x.to(tl.float32)
    tl.store(sums + pid, tl.sum(acc, 0))


def pull_grid(weight: torch.Tensor, programs: int, mode: str = "load") -> tuple[int, int, int]:
    """(programs, block, iterations) that cover `weight` with `programs` programs."""
    n = weight.numel()
    if mode == "hint":
        lines = triton.cdiv(n * weight.element_size(), LINE_BYTES)
        block = 256
        return programs, block, triton.cdiv(lines, programs * block)
    block = 4096 if n >= 4096 * programs else max(16, triton.next_power_of_2(triton.cdiv(n, programs)))
    return programs, block, triton.cdiv(n, programs * block)


def pull_into_l2(weight: torch.Tensor, sums: torch.Tensor, mode: str = "load") -> torch.Tensor:
    """Read `weight` (contiguous) so that its lines sit in L2; `sums` [programs] float32 receives each program's sum
    of the elements it read ("load"), or zeros ("hint"). The grid is `sums`' length, so a CUDA graph keeps it."""
    if not weight.is_contiguous():
        raise ValueError("pull_into_l2 needs a contiguous weight")
    if mode not in ("load", "hint"):
        raise ValueError(f"mode must be 'load' or 'hint', got {mode!r}")
    programs, block, iters = pull_grid(weight, sums.numel(), mode)
    _pull_kernel[(programs,)](weight, weight.numel(), sums, BLOCK=block, ITERS=iters, HINT=mode == "hint",
                              LINE=LINE_BYTES // weight.element_size(), num_warps=8 if block >= 2048 else 4)
    return sums


def pull_into_l2_reference(weight: torch.Tensor, programs: int) -> torch.Tensor:
    """The twin of mode "load": each program's float32 sum of the blocks it reads."""
    _, block, iters = pull_grid(weight, programs)
    flat = weight.reshape(-1).float()
    padded = torch.zeros(programs * block * iters, dtype=torch.float32, device=weight.device)
    padded[:flat.numel()] = flat
    # block index = pid + i * programs  ->  [iters, programs, block]
    return padded.view(iters, programs, block).sum(dim=(0, 2))
