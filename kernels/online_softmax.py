"""One step of the online softmax shared by the attention kernels (flash-attention style, in log2 units)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_block(q, k, v, visible, m_i, l_i, acc, scale_log2, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Fold one block of keys and values into the running state of a tile of query rows.

    q [ROWS, D]; k, v [BLOCK_N, D]; visible broadcasts to [ROWS, BLOCK_N] (False: masked key); m_i, l_i [ROWS] the
    running max (log2 units) and normalizer; acc [ROWS, D] float32 the unnormalized output. Every row must see at
    least one key over the whole walk before its first fully masked block, or its max stays -inf."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [ROWS, BLOCK_N]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc
