"""fp8 experts' layout, shared by the grouped path (kernels.moe_fp8) and the few-token path (kernels.moe_decode_fp8):
the shape of their scales and the check of the operands both take."""

from __future__ import annotations

import torch

from radixmesh.kernels.fp8_quant import FP8


def scale_shape(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[int, ...]:
    """The scales of stacked fp8 expert weights w [experts, N, K]: [experts, N] (per row), else [experts,
    ceil(N/bn), ceil(K/bk)]."""
    e, n, k = w.shape
    return (e, n) if block is None else (e, -(-n // block[0]), -(-k // block[1]))


def check_experts(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                  block: tuple[int, int] | None) -> None:
    """ValueError unless block-wise blocks are powers of two with bk >= 32 and the experts' weights are contiguous fp8
    [experts, 2 x inter, hidden] and [experts, hidden, inter] with contiguous float32 scales of their layout."""
    if block is not None and (block[0] & (block[0] - 1) or block[1] & (block[1] - 1) or block[1] < 32):
        raise ValueError(f"fp8 experts' block-wise scales need power-of-two blocks with bk >= 32, got {block}")
    e, two_inter, hidden = w13.shape
    ok = (w13.dtype == FP8 and w2.dtype == FP8 and w2.shape == (e, hidden, two_inter // 2) and two_inter % 2 == 0
          and x.shape[-1] == hidden and w13.is_contiguous() and w2.is_contiguous())
    for w, s in ((w13, s13), (w2, s2)):
        ok = ok and tuple(s.shape) == scale_shape(w, block) and s.dtype == torch.float32 and s.is_contiguous()
    if not ok:
        raise ValueError(f"fp8 experts take contiguous fp8 w13 [experts, 2 x inter, hidden] and w2 [experts, hidden, "
                         f"inter] with float32 scales {scale_shape(w13, block)} and {scale_shape(w2, block)} (block "
                         f"{block}) for x [tokens, hidden]; got x {tuple(x.shape)}, w13 {tuple(w13.shape)} "
                         f"{w13.dtype}, w2 {tuple(w2.shape)} {w2.dtype}, scales {tuple(s13.shape)} {s13.dtype} and "
                         f"{tuple(s2.shape)} {s2.dtype}")
