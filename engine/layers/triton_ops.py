"""Where a layer's elementwise work runs: the Triton kernels of `kernels/` for CUDA tensors when Triton imports,
plain torch otherwise (CPU, where the torch ops carry the reference numerics the parity tests check)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda and _triton_importable()


def set_pdl(enabled: bool) -> None:
    """Programmatic dependent launch of the kernels (and with it kernels.gemv for decode-sized products) on or off
    for this process (kernels.runtime); nothing to set without Triton."""
    if _triton_importable():
        from kernels.runtime import use_pdl

        use_pdl(enabled)
