"""The online softmax shared by the attention kernels (flash-attention style, in log2 units), in two halves so a
kernel loads a block's values between them, after the scores (the order the kernels were measured with)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softmax_step(q, k, visible, m_i, l_i, scale_log2, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Scores of one block of keys against a tile of query rows, folded into the running max and normalizer.

    q [ROWS, D]; k [BLOCK_N, D]; visible broadcasts to [ROWS, BLOCK_N] (False: masked key); m_i, l_i [ROWS].
    Returns (p [ROWS, BLOCK_N] unnormalized weights, alpha [ROWS] rescale of the old accumulator, new m_i, new l_i).
    Every row must see at least one key before its first fully masked block, or its max stays -inf."""
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def accumulate(acc, p, alpha, v, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc [ROWS, D] float32 rescaled and the block's weighted values v [BLOCK_N, D] added."""
    if UPCAST:
        v = v.to(tl.float32)
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
