"""What the kernels need to know about how Triton runs them."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, read when kernels are decorated)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_needs_upcast(dtype: torch.dtype) -> bool:
    """Triton's interpreter (seen in 3.9) returns garbage from `tl.dot` on bfloat16 tiles; there the attention kernels
    upcast their tiles to float32 first. Compiled kernels keep bfloat16 tensor-core dots."""
    return interpreting() and dtype == torch.bfloat16
