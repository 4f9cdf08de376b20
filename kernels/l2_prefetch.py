"""A tensor pulled into L2 by the copy engine (TMA) while other kernels run: for a decode step's weights.

At batch 1 a decode step streams every weight once, and the memory is idle while the small kernels between the
products run (rotary, the KV store and decode attention take ~10 us a layer on an H100 or H200). A weight read
during that window comes to the next product from L2 instead of HBM. `prefetch_l2` issues one Hopper bulk prefetch
(`cp.async.bulk.prefetch.L2.global`) per `CHUNK_BYTES` of the tensor: a hint that binds no value and that the TMA
unit carries out without holding the issuing threads, so the kernel is done in a few hundred cycles.

Under programmatic dependent launch the kernel lets its dependents launch, issues its prefetches (the weights are
written by no kernel of the step) and then waits for the kernel before, so that the stream's order still holds for
the kernel after it (kernels.runtime). It needs sm_90 and a compiled kernel: elsewhere `prefetch_l2` does nothing.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.runtime import interpreting, pdl_options

# What one bulk prefetch asks for; a program issues PER_PROGRAM of them (one per thread of its one warp).
CHUNK_BYTES = 64 * 1024
PER_PROGRAM = 32


@triton.jit
def _bulk_prefetch_l2(ptrs, sizes):
    """One bulk L2 prefetch per (address, byte count) pair; the dummy result keeps the asm an elementwise op."""
    return tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                     [ptrs, sizes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(Base, nbytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    chunk = tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    offset = chunk.to(tl.int64) * CHUNK
    live = offset < nbytes
    size = tl.minimum(nbytes - offset, CHUNK).to(tl.int32)
    # a thread past the end asks again for the tensor's first 16 bytes (harmless) rather than branch around the asm
    base = Base.to(tl.pointer_type(tl.int8))  # byte offsets, whatever the tensor's dtype
    _bulk_prefetch_l2(tl.where(live, base + offset, base), tl.where(live, size, 16))
    if PDL:
        tl.extra.cuda.gdc_wait()


@functools.cache
def _supported(device_index: int) -> bool:
    return not interpreting() and torch.cuda.get_device_capability(device_index)[0] >= 9


def prefetch_l2(t: torch.Tensor) -> None:
    """Ask for `t` (contiguous, 16-byte aligned, on a CUDA device) to be pulled into L2 now, all but a tail of fewer
    than 16 bytes (a bulk prefetch moves 16-byte multiples). Returns at once; does nothing off sm_90+ or in Triton's
    interpreter, where there is no bulk prefetch."""
    if not t.is_cuda or not _supported(t.device.index or 0):
        return
    if not t.is_contiguous() or t.data_ptr() % 16:
        raise ValueError(f"prefetch_l2 needs a contiguous, 16-byte aligned tensor; got {tuple(t.shape)} {t.dtype} "
                         f"strides {t.stride()} at {t.data_ptr():#x}")
    nbytes = t.numel() * t.element_size() // 16 * 16
    if nbytes == 0:
        return
    grid = (triton.cdiv(triton.cdiv(nbytes, CHUNK_BYTES), PER_PROGRAM),)
    _prefetch_kernel[grid](t, nbytes, CHUNK=CHUNK_BYTES, PER_PROGRAM=PER_PROGRAM, num_warps=1, **pdl_options(t))
