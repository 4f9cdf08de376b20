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


def set_pdl(enabled: bool, gemv: bool | dict, row: dict | None = None) -> None:
    """Programmatic dependent launch of the kernels on or off for this process, and which decode-sized products run
    kernels.gemv under it (kernels.runtime.use_pdl: all, none, or a plan by weight shape; `row`: the shapes whose
    one-row products run gemv_row); nothing to set without Triton."""
    if _triton_importable():
        from radixmesh.kernels.runtime import use_pdl

        use_pdl(enabled, gemv, row)


def pdl_available(device: torch.device) -> bool:
    """Whether programmatic dependent launch is on for kernels on `device` (supported, and not turned off)."""
    if device.type != "cuda" or not _triton_importable():
        return False
    from radixmesh.kernels.runtime import pdl_enabled

    return pdl_enabled(device)
