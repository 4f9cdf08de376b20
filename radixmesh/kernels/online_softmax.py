"""The online softmax shared by the attention kernels (flash-attention style, in log2 units), in two halves so a
kernel loads a block's values between them, after the scores (the order the kernels were measured with).

Scores may be soft-capped (Gemma 2): s becomes cap * tanh(s / cap). In log2 units that is the same formula with the
cap in log2 units too (cap_log2 = cap * log2(e)), which is what the kernels pass.

An attention sink (GPT-OSS: a learned logit per query head) is one more term of the softmax's denominator that adds
no value: out = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^sink). `sink_normalizer` folds it in once a row's keys are all
seen (or a row's split-KV partials merged)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from radixmesh.kernels.runtime import interpreting

_TWO_LOG2E = tl.constexpr(2.8853900817779268)  # 2 * log2(e): e^(-2a) = 2^(-2 * log2(e) * a)
# Below this |x|, tanh's series (to x^5, next term < 4e-9 relative) replaces (1 - e^-2x) / (1 + e^-2x), whose
# numerator loses digits near 0.
_TANH_SERIES_BELOW = tl.constexpr(0.0625)


@triton.jit
def _tanh_exp2(x):
    """float32 tanh from exp2 (Triton's interpreter has no tanh of its own): odd, a few ulp from torch.tanh where exp2
    is exact (the interpreter's numpy). Compiled, exp2 is ex2.approx, whose error the form's cancellation near the
    series' edge magnifies: on an H100 it missed test_kernel_tanh_matches_torch's 4e-7 relative bound (2026-12-05), so
    compiled kernels use libdevice's."""
    a = tl.abs(x)
    t = tl.exp2(a * -_TWO_LOG2E)
    big = (1.0 - t) / (1.0 + t)
    a2 = a * a
    small = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0)))
    y = tl.where(a < _TANH_SERIES_BELOW, small, big)
    return tl.where(x < 0, -y, y)


if interpreting():
    tanh = _tanh_exp2
else:
    @triton.jit
    def tanh(x):
        """float32 tanh, compiled: libdevice's (within 2 ulp of the true value)."""
        return libdevice.tanh(x)


@triton.jit
def softmax_step(q, k, visible, m_i, l_i, scale_log2, cap_log2, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 CAPPED: tl.constexpr, SPARSE: tl.constexpr):
    """Scores of one block of keys against a tile of query rows, folded into the running max and normalizer.

    q [ROWS, D]; k [BLOCK_N, D]; visible broadcasts to [ROWS, BLOCK_N] (False: masked key); m_i, l_i [ROWS].
    CAPPED: scores are soft-capped at cap_log2 (log2 units). SPARSE: a row may see no key of a block before it has
    seen any (a sliding window's lower edge); otherwise every row must see a key of its first block, or its max stays
    -inf. Returns (p [ROWS, BLOCK_N] unnormalized weights, alpha [ROWS] rescale of the old accumulator, new m_i,
    new l_i)."""
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    if CAPPED:
        s = cap_log2 * tanh(s / cap_log2)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if SPARSE:  # a row that has seen nothing yet keeps p = 0 and alpha = 0 instead of NaN
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_new_safe[:, None])
        alpha = tl.exp2(m_i - m_new_safe)
    else:
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def accumulate(acc, p, alpha, v, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc [ROWS, D] float32 rescaled and the block's weighted values v [BLOCK_N, D] added."""
    if UPCAST:
        v = v.to(tl.float32)
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)


_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def sink_normalizer(m_i, l_i, sink):
    """A row's (rescale of its accumulator, denominator) once its attention sink (`sink`, a logit: natural units)
    joins the softmax: out = acc * factor / denom. m_i, l_i: its running max and normalizer (log2 units); a row that
    saw no key (m_i -inf) gets factor 0 and denominator 1, never NaN."""
    sink_log2 = sink.to(tl.float32) * _LOG2E
    m_new = tl.maximum(m_i, sink_log2)
    factor = tl.exp2(m_i - m_new)
    return factor, l_i * factor + tl.exp2(sink_log2 - m_new)
