"""What the kernels need to know about how Triton runs them."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, read when kernels are decorated)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_needs_upcast(dtype: torch.dtype) -> bool:
    """Triton's interpreter (seen in 3.9) returns garbage from `tl.dot` on bfloat16 tiles; there the attention kernels
    upcast their tiles to float32 first. Compiled kernels keep bfloat16 tensor-core dots."""
    return interpreting() and dtype == torch.bfloat16


# ---- programmatic dependent launch -----------------------------------------------------------------------------------
# A kernel launched with `launch_pdl=True` may start while the kernel before it on the stream still runs (Hopper and
# later). Every such kernel begins with `pdl_enter(PDL)` (or, like kernels.gemv, does what it needs first and then
# waits): it lets its own dependents launch, then waits until the kernel before has finished and its writes are
# visible. Nothing before the wait may read what an earlier kernel wrote or write anything at all; since each kernel
# waits before it can finish, the order of the stream holds transitively. Kernels launched without it (torch ops,
# cuBLAS) wait for the kernel before as usual.

_pdl: dict = {"enabled": True, "gemv": True, "row": {}}


def use_pdl(enabled: bool, gemv: bool | dict = True, row: dict | None = None) -> None:
    """Turn programmatic dependent launch on or off for the whole process (ModelRunner sets it from
    --disable-pdl; graphs captured after the call use the new setting); `gemv`: which decode-sized products run
    kernels.gemv under it (engine.layers.linear): True (all, kernels.gemv's default tiles), False (none: cuBLAS), or
    a plan by weight shape, {(n, k): kernels.gemv tiles (its `config`), or None for cuBLAS}, where shapes the plan
    does not name run cuBLAS (engine.decode_products.plan); `row`: the products of one row that run kernels.gemv's
    gemv_row instead, {(n, k): its tiles}, whatever `gemv` says for more rows."""
    _pdl["enabled"], _pdl["gemv"], _pdl["row"] = enabled, gemv, row or {}


@functools.cache
def pdl_supported(device_index: int = 0) -> bool:
    """Programmatic dependent launch needs a compiled kernel (not the interpreter), a Hopper-or-later GPU and a Triton
    that knows `gdc_wait` and the `launch_pdl` launch option."""
    if interpreting() or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    try:
        import triton.language.extra.cuda as tl_cuda
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return hasattr(tl_cuda, "gdc_wait") and "launch_pdl" in CUDAOptions.__dataclass_fields__


def pdl_enabled(device: torch.device) -> bool:
    """Whether programmatic dependent launch is on for kernels on `device` (CUDA, supported, not turned off)."""
    return _pdl["enabled"] and device.type == "cuda" and pdl_supported(device.index or 0)


def gemv_enabled(t: torch.Tensor) -> bool:
    """Whether any decode-sized product on `t` runs kernels.gemv (PDL on, and kernels.gemv not turned off)."""
    g = _pdl["gemv"]
    chosen = any(v is not None for v in g.values()) if isinstance(g, dict) else g
    return bool(chosen) and pdl_enabled(t.device)


def gemv_plan(t: torch.Tensor, shape: tuple[int, int]) -> tuple[bool, tuple | None]:
    """For a decode-sized product on `t` with a weight of `shape`: (whether it runs kernels.gemv, its tiles; None:
    kernels.gemv's defaults)."""
    g = _pdl["gemv"]
    if not g or not pdl_enabled(t.device):
        return False, None
    if g is True:
        return True, None
    config = g.get(shape)
    return config is not None, config


def row_plan(t: torch.Tensor, shape: tuple[int, int]) -> tuple | None:
    """For a product of one row on `t` with a weight of `shape`: gemv_row's tiles when the plan runs it there, else
    None."""
    return _pdl["row"].get(shape) if _pdl["row"] and pdl_enabled(t.device) else None


def pdl_on(t: torch.Tensor) -> bool:
    """Whether a kernel working on `t` launches as a programmatic dependent now: only while a CUDA graph is being
    captured. Launched one by one from Python the GPU waits for the CPU anyway, and on an H100 eager decode steps
    took 2-3x as long with it (44 against 18-24 ms at batch 1; cause not established)."""
    return pdl_enabled(t.device) and torch.cuda.is_current_stream_capturing()


def pdl_options(t: torch.Tensor) -> dict:
    """Keyword arguments for launching a kernel that takes `PDL: tl.constexpr` and begins with pdl_enter(PDL)."""
    return {"PDL": True, "launch_pdl": True} if pdl_on(t) else {"PDL": False}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


# Kernel tiles tuned per GPU and saved as data (benchmarks.tune_moe, benchmarks.tune_fp8_gemm)
CONFIG_DIR = Path(__file__).with_name("configs")


def config_file(kind: str, device: str, folder: Path | str = CONFIG_DIR) -> Path:
    """The file of `kind`'s tiles tuned for a GPU (its torch.cuda.get_device_name) in `folder`."""
    return Path(folder) / f"{kind}-{re.sub(r'[^a-z0-9]+', '-', device.lower()).strip('-')}.json"


LINE_BYTES = 128  # what one L2 prefetch pulls


@triton.jit
def prefetch_l2(ptrs):
    """One `prefetch.global.L2` per pointer (a hint: it binds no value, so it may run before a PDL wait on memory an
    earlier kernel may still write); the dummy result keeps the asm an elementwise op of Triton's."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)
