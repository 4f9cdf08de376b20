"""A linear layer's product with its weight held in fp8 (engine.quantization.fp8_load puts it there): which kernel
runs it, by the number of rows.

  rows <= SKINNY_ROWS (decode)  W8A16, activations in their dtype: one row, kernels.fp8_gemv.fp8_gemv_row; 2-16 rows,
                                kernels.fp8_gemv_rows (each weight element read once for all rows), both with the
                                tiles engine.decode_products chose for the shape (and row count) on this GPU
  more rows, block-wise weights activations quantized per token and group of bk columns (kernels.fp8_quant), then
                                kernels.fp8_gemm's block-scaled GEMM
  more rows, per-channel        activations quantized per token, then torch._scaled_mm (cuBLAS's fp8 GEMM with row-wise
                                scales) on Hopper and later for bfloat16 outputs with N and K multiples of 16; kernels.fp8_gemm's
                                row-wise GEMM otherwise (float16, float32, the interpreter), its twin-tested fallback
Every path is device work only (no host sync), so CUDA graphs capture it. Static input scales in a checkpoint are
not used: activations are quantized per token, a finer scale than the checkpoint's one per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
SKINNY_ROWS = 16  # up to this many rows a product reads fp8 weights with 16-bit activations (memory-bound)


@dataclass(frozen=True, slots=True)
class Fp8Weights:
    """How a layer holds its fp8 weight: `weight` float8_e4m3fn [N, K] and the buffer `weight_scale` float32, [N]
    (one per output row) or [ceil(N/bn), ceil(K/bk)] (one per block of `block`)."""

    block: tuple[int, int] | None
    scaled_mm: bool  # per-channel products of many rows may run torch._scaled_mm (CUDA, sm90+, N and K % 16 == 0)


def scaled_mm_fits(device: torch.device, n: int, k: int) -> bool:
    """Whether torch._scaled_mm with row-wise scales (CUTLASS's, Hopper and later) runs an [n, k] weight's products
    on `device`."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0) and n % 16 == 0
            and k % 16 == 0)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, how: Fp8Weights,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (weight * scales)^T (+ bias) -> [..., N] in x's dtype (the module docstring says which kernel)."""
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m <= SKINNY_ROWS:
        from radixmesh.kernels.fp8_gemv import fp8_gemv_row
        from radixmesh.kernels.fp8_gemv_rows import fp8_gemv_rows

        y = (fp8_gemv_row if m == 1 else fp8_gemv_rows)(x2, weight, scales, how.block, bias, pdl=True)
        return y.reshape(*lead, n)
    from radixmesh.kernels.fp8_gemm import fp8_gemm
    from radixmesh.kernels.fp8_quant import group_quant

    a, a_scales = group_quant(x2, how.block[1] if how.block else None)
    if how.block is None and how.scaled_mm and x.dtype == torch.bfloat16:
        y = torch._scaled_mm(a, weight.t(), scale_a=a_scales, scale_b=scales.view(1, n), out_dtype=torch.bfloat16)
    else:
        y = fp8_gemm(a, a_scales, weight, scales, how.block, x.dtype)
    if bias is not None:
        y += bias
    return y.reshape(*lead, n)
