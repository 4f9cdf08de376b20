"""Without CUDA the kernels run in Triton's CPU interpreter, made to round float32 -> bfloat16 as the GPU does.

TRITON_INTERPRET is read when `@triton.jit` decorates a kernel, i.e. when a `kernels.*` module is imported; pytest
imports this file before the test modules of this folder, and tests/conftest.py sets the same default even earlier.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    _early = sorted(m for m in sys.modules if m.startswith("radixmesh.kernels."))
    if _early:
        raise RuntimeError(f"{_early} imported before TRITON_INTERPRET was set: their kernels would need a GPU")
    os.environ["TRITON_INTERPRET"] = "1"


def _round_bf16_to_nearest_even(convert):
    """Triton's interpreter (seen in 3.9) truncates float32 -> bfloat16 casts, while compiled kernels (cvt.rn.bf16.f32)
    and PyTorch round to nearest even; kernels that match PyTorch bit for bit need the rounding."""
    import triton.language as tl
    from triton._C.libtriton import ir

    def patched(values, src_dtype, dst_dtype, rounding_mode):
        if src_dtype != tl.float32 or dst_dtype != tl.bfloat16 or rounding_mode == ir.ROUNDING_MODE.RTZ:
            return convert(values, src_dtype, dst_dtype, rounding_mode)
        f32 = np.ascontiguousarray(values, dtype=np.float32)
        bits = f32.view(np.uint32)
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        rounded = np.where(np.isnan(f32), (bits >> np.uint32(16)) | np.uint32(0x40), rounded)  # NaN stays NaN
        return rounded.astype(np.uint16).reshape(np.shape(values))

    return patched


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    from triton.runtime import interpreter as _interpreter

    if not hasattr(_interpreter, "_convert_float"):
        raise RuntimeError("this Triton's interpreter has no _convert_float; recheck its bfloat16 rounding")
    if not getattr(_interpreter._convert_float, "rounds_bf16", False):
        _interpreter._convert_float = _round_bf16_to_nearest_even(_interpreter._convert_float)
        _interpreter._convert_float.rounds_bf16 = True
