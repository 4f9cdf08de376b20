"""Dynamic fp8 (e4m3) quantization of activations: one float32 scale per `group` consecutive elements of a row (the
per-token-group quantization a block-wise fp8 GEMM takes, group = the weights' block width), or per row (group = the
row's length: the per-token quantization a per-channel fp8 GEMM takes), and its plain-torch twin.

scale = max(amax of the group, EPS) / 448 and q = x / scale rounded to e4m3, to nearest even, saturating at +-448;
x ~ q * scale. The rounding to e4m3's grid is computed in float32 by the kernel itself (rounding the 3 mantissa bits
of normals in the integer bits, subnormals by a float addition) and only the exact result is converted: Triton's
interpreter (seen in 3.9) converts float32 -> fp8 by rounding half up without carrying into the exponent (127.9
became 64), so a kernel that relied on the cast would be tested against a converter the GPU does not have; an exact
value converts exactly in both (checked for all 255 finite codes in tests/kernels/test_fp8_quant.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
EPS = 1e-10  # the smallest amax a scale is made from: an all-zero group gets a tiny scale, not a division by zero
_SUBNORMAL = 2.0 ** -6  # e4m3's smallest normal
_MAGIC = 1.5 * 2.0 ** 14  # float32's spacing at this magnitude is 2^-9, e4m3's subnormal step


@triton.jit
def round_e4m3(x):
    """float32 x (|x| <= 448 after the caller's scaling) -> float32 on e4m3's grid, to nearest even, clamped to
    +-448; exactly representable in e4m3. Rounded as a magnitude with x's sign put back, so a negative x that rounds
    to zero gives -0.0 (code 0x80) as torch's cast does."""
    xbits = x.to(tl.int32, bitcast=True)
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    # keep 3 of float32's 23 mantissa bits, half to even; a carry moves into the exponent as it should
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = (a + 24576.0) - 24576.0  # _MAGIC: rounds to a multiple of 2^-9, half to even
    r = tl.minimum(tl.where(a < 0.015625, subnormal, normal), 448.0)
    return (r.to(tl.int32, bitcast=True) | (xbits & -0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _group_quant_kernel(X, Q, S, K, stride_xm, stride_qm, stride_sm, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                        EPS_: tl.constexpr):
    # program (row, group): the group's amax in a first pass, its quantized values in a second
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * GROUP
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, GROUP, BLOCK):
        k = start + k0 + offs
        mask = (k0 + offs < GROUP) & (k < K)
        x = tl.load(X + row * stride_xm + k, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.div_rn(tl.maximum(tl.max(amax, 0), EPS_), 448.0)
    tl.store(S + row * stride_sm + tl.program_id(1), scale)
    for k0 in range(0, GROUP, BLOCK):
        k = start + k0 + offs
        mask = (k0 + offs < GROUP) & (k < K)
        x = tl.load(X + row * stride_xm + k, mask=mask, other=0.0).to(tl.float32)
        q = round_e4m3(tl.div_rn(x, scale))
        tl.store(Q + row * stride_qm + k, q.to(Q.dtype.element_ty), mask=mask)


def group_quant(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] (unit stride along k) -> (q [m, k] float8_e4m3fn, scales [m, ceil(k / group)] float32); group None:
    one scale per row ([m, 1]). One launch, no host sync (CUDA graphs capture it)."""
    m, k = x.shape
    group = group or k
    if x.stride(1) != 1 or group <= 0:
        raise ValueError(f"group_quant takes x [m, k] with unit stride along k and a positive group; got strides "
                         f"{x.stride()} and group {group}")
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        block = min(triton.next_power_of_2(group), 1024)
        _group_quant_kernel[(m, groups)](x, q, s, k, x.stride(0), q.stride(0), s.stride(0), GROUP=group,
                                         BLOCK=block, EPS_=EPS, num_warps=4 if block >= 512 else 1)
    return q, s


def group_quant_reference(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch twin of group_quant: the same scales (float32 amax / 448) and torch's rounding to e4m3."""
    m, k = x.shape
    group = group or k
    groups = -(-k // group)
    padded = torch.zeros((m, groups * group), dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    amax = padded.view(m, groups, group).abs().amax(dim=2)
    # a tensor divisor, not the Python float: on CUDA torch computes `tensor / python_float` as a product with the
    # float's reciprocal, up to a bit off the correctly rounded quotient the kernel computes (and torch on a CPU): why
    # every test_group_quant_matches_its_twin case failed on an H100 (2026-12-05; all 18 passed there after this)
    s = amax.clamp(min=EPS) / torch.full_like(amax, FP8_MAX)
    q = (padded.view(m, groups, group) / s[:, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return q.view(m, -1)[:, :k].to(FP8), s


def dequantize_groups(q: torch.Tensor, s: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """float32 [m, k] of group_quant's output (with the same `group`): each group's values times its scale."""
    k = q.shape[1]
    return q.float() * s.repeat_interleave(group or k, dim=1)[:, :k]


def dequantize_weight(q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float32 [n, k] of an fp8 weight: each value times its block's scale (scales [ceil(n/bn), ceil(k/bk)]) or its
    row's (scales [n] or [n, 1]; block None). The twins' weights."""
    n, k = q.shape
    if block is None:
        return q.float() * scales.float().reshape(n, 1)
    bn, bk = block
    return q.float() * scales.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
