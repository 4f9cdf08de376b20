"""The elementwise kernels (RMSNorm, rotary, SiLU-and-mul, KV store) against their plain-torch twins, and the twins
against the engine's torch layers. Without CUDA the kernels run in Triton's interpreter on small shapes; with CUDA the
same cases run on the GPU, plus the Llama-3.1-8B shapes (hidden 4096, intermediate 14336, 32 / 8 heads of 128,
1 to 8192 tokens) marked `gpu`.

Rotary, the KV store and the residual add are exactly rounded elementwise ops: the kernels must equal the twins bit for
bit. RMSNorm's statistics and SiLU's exp are computed in another order / with another exp than PyTorch's: in float32
the relative error is bounded; in bfloat16 / float16 the kernel's rounded intermediate (the normalized row, silu(gate))
may sit 1 ulp from the twin's on a tiny fraction of elements, and the output must equal the twin's last multiply
applied to that neighbour.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from radixmesh import kernels
import radixmesh.kernels.activation
import radixmesh.kernels.kv_store
import radixmesh.kernels.norm
import radixmesh.kernels.rotary
from radixmesh.engine.cache.kv_pool import KVPool
from radixmesh.engine.layers.norm import RMSNorm
from radixmesh.engine.layers.rotary import RotaryEmbedding, apply_rotary as engine_apply_rotary
from radixmesh.engine.models.llama import MLP
from radixmesh.kernels.activation import (gelu_tanh_and_mul, gelu_tanh_and_mul_reference, silu_and_mul,
                                         silu_and_mul_reference)
from radixmesh.kernels.kv_store import store_kv, store_kv_reference
from radixmesh.kernels.norm import (fused_add_rmsnorm, fused_add_rmsnorm_reference, gemma_rmsnorm,
                                    gemma_rmsnorm_reference, gemma_sandwich, gemma_sandwich_reference, olmo2_post_add,
                                    olmo2_post_add_reference, olmo2_rmsnorm, olmo2_rmsnorm_reference, rmsnorm,
                                    rmsnorm_reference)
from radixmesh.kernels.rotary import apply_rotary, apply_rotary_reference, rotary_store_kv, rotary_store_kv_reference

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in (torch.float32, torch.bfloat16, torch.float16)]
EPS = 1e-5
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
# float32: largest relative error against the twin. Measured in the interpreter (0.2M to 2M elements per case):
# rmsnorm 3.2e-7 to 4.1e-7, silu_and_mul 3.5e-7; silu's bound leaves room for the GPU's exp (ex2.approx of x*log2 e).
NORM_FP32_RTOL, SILU_FP32_RTOL = 1e-6, 2e-6
# bfloat16 / float16: largest fraction of output elements that may differ from the twin (each by the twin's last
# multiply applied to a 1-ulp neighbour of its intermediate). Measured in the interpreter over 0.2M to 2M elements per
# case: rmsnorm bf16 0 to 3.8e-6, fp16 2.9e-6 to 4.4e-5; silu_and_mul bf16 0, fp16 2.2e-4 to 2.4e-4.
NORM_HALF_FRACTION, SILU_HALF_FRACTION = 1e-3, 2e-3


def _cases(small: list[tuple], large: list[tuple]) -> list:
    """Small cases on the kernel device (the interpreter without CUDA); the engine's real shapes on CUDA only."""
    return ([pytest.param(KERNEL_DEVICE, *c, id=f"small-{'-'.join(map(str, c))}") for c in small]
            + [pytest.param("cuda", *c, id=f"large-{'-'.join(map(str, c))}", marks=pytest.mark.gpu) for c in large])


@pytest.fixture
def gen(request) -> torch.Generator:
    """Fresh inputs per test case, reproducible from its id."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=["narrow", "wide"])
def tiles(request, monkeypatch) -> str:
    """narrow: the launch heuristics as they are (few rows: one row or head per program); wide: as with many rows
    (several rows or heads per program, partly masked), which small shapes would otherwise never reach."""
    if request.param == "wide":
        for module in (kernels.norm, kernels.rotary, kernels.activation, kernels.kv_store):
            monkeypatch.setattr(module, "_MIN_PROGRAMS", 1)
    return request.param


def _randn(shape, dtype, device, gen, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def _ulp_step(t: torch.Tensor, k: int) -> torch.Tensor:
    """t (bfloat16 / float16) moved k ulps along the number line (both zeros count as one point)."""
    bits = t.view(torch.int16).to(torch.int32)
    ordered = torch.where(bits < 0, -(bits & 0x7FFF), bits) + k
    bits = torch.where(ordered < 0, (-ordered) | 0x8000, ordered)
    return bits.to(torch.int16).view(t.dtype)


def _assert_rounding_close(out, ref, inter, last_op, fp32_rtol: float, half_fraction: float) -> None:
    """out vs the twin's ref = last_op(inter), where inter is the twin's rounded intermediate."""
    assert not out.isnan().any(), "an output element was never written"
    assert torch.equal(last_op(inter), ref), "the test's decomposition of the twin is wrong"
    if inter.dtype == torch.float32:
        rel = (out.double() - ref.double()).abs() / ref.double().abs().clamp_min(1e-30)
        rel = rel.max().item() if rel.numel() else 0.0
        assert rel <= fp32_rtol, f"max relative error {rel:.2e}"
        return
    near = (out == ref) | (out == last_op(_ulp_step(inter, -1))) | (out == last_op(_ulp_step(inter, 1)))
    assert near.all(), f"{(~near).sum().item()} elements off by more than 1 ulp of the intermediate"
    differ = (out != ref).sum().item()
    assert differ <= 1 + half_fraction * out.numel(), f"{differ} of {out.numel()} elements differ"


def _normalized(h: torch.Tensor) -> torch.Tensor:
    """The twin's intermediate: h / rms(h) rounded to h's dtype."""
    f = h.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)


def _norm_input(shape, strided: bool, dtype, device, gen) -> torch.Tensor:
    """x [*shape]; strided: a view into wider rows, like q out of the fused qkv projection."""
    if not strided:
        return _randn(shape, dtype, device, gen)
    n, rest = shape[0], shape[1:]
    wide = _randn((n, 3 * torch.Size(rest).numel()), dtype, device, gen)
    return wide[:, :torch.Size(rest).numel()].view(n, *rest)


NORM_CASES = _cases(
    small=[((0, 40), False), ((1, 40), False), ((5, 96), False), ((3, 100), False), ((2, 3, 5, 16), False),
           ((3, 7, 24), True), ((4, 2, 32), True)],
    large=[((1, 4096), False), ((7, 4096), False), ((8192, 4096), False), ((1, 32, 128), True),
           ((8192, 32, 128), True), ((8192, 8, 128), True)])


@pytest.mark.parametrize("device,shape,strided", NORM_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm(device, shape, strided, dtype, gen, tiles):
    x = _norm_input(shape, strided, dtype, device, gen)
    weight = _randn(shape[-1:], dtype, device, gen)
    out = torch.full(shape, float("nan"), dtype=dtype, device=device)
    assert rmsnorm(x, weight, EPS, out=out) is out
    ref = rmsnorm_reference(x, weight, EPS)
    _assert_rounding_close(out, ref, _normalized(x), lambda t: weight * t, NORM_FP32_RTOL, NORM_HALF_FRACTION)


@pytest.mark.parametrize("dtype", DTYPES[1:])
def test_rmsnorm_float32_weight_promotes(dtype, gen):
    """A float32 weight on a half-precision x gives a float32 result, as in the torch layer."""
    x = _randn((3, 100), dtype, KERNEL_DEVICE, gen)
    weight = _randn((100,), torch.float32, KERNEL_DEVICE, gen)
    out = rmsnorm(x, weight, EPS)
    ref = rmsnorm_reference(x, weight, EPS)
    assert out.dtype == ref.dtype == torch.float32
    _assert_rounding_close(out, ref, _normalized(x), lambda t: weight * t, NORM_FP32_RTOL, NORM_HALF_FRACTION)


@pytest.mark.parametrize("device,shape,strided", NORM_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rmsnorm(device, shape, strided, dtype, gen, tiles):
    x = _norm_input(shape, strided, dtype, device, gen)
    residual = _randn(shape, dtype, device, gen)
    weight = _randn(shape[-1:], dtype, device, gen)
    x_before, residual_before = x.clone(), residual.clone()
    out, res_out = (torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(2))
    fused_add_rmsnorm(x, residual, weight, EPS, out=out, residual_out=res_out)
    ref, ref_res = fused_add_rmsnorm_reference(x, residual, weight, EPS)
    assert torch.equal(res_out, ref_res)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)
    _assert_rounding_close(out, ref, _normalized(ref_res), lambda t: weight * t, NORM_FP32_RTOL, NORM_HALF_FRACTION)


def _assert_one_rounding_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """A result rounded once from float32 sums taken in another order: float32 to 1e-6 relative; a half dtype within
    one step of its precision of the twin, and most elements equal."""
    assert not out.isnan().any() and out.dtype == ref.dtype
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=NORM_FP32_RTOL, atol=1e-6)
        return
    step = 2 ** -7 if out.dtype == torch.bfloat16 else 2 ** -10
    torch.testing.assert_close(out.float(), ref.float(), rtol=step, atol=step * 1e-3)
    assert (out != ref).sum().item() <= 1 + 0.02 * out.numel()


@pytest.mark.parametrize("device,shape,strided", NORM_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rmsnorm(device, shape, strided, dtype, gen, tiles):
    """Gemma's (1 + weight) norm in float32, rounded once (per head too: Gemma 3's q/k norms on strided rows); with a
    residual, Gemma 1's sum first."""
    x = _norm_input(shape, strided, dtype, device, gen)
    weight = _randn(shape[-1:], dtype, device, gen)
    _assert_one_rounding_close(gemma_rmsnorm(x, weight, EPS), gemma_rmsnorm_reference(x, weight, EPS))
    residual = _randn(shape, dtype, device, gen)
    out, summed = gemma_rmsnorm(x, weight, EPS, residual=residual)
    assert torch.equal(summed, x + residual)
    _assert_one_rounding_close(out, gemma_rmsnorm_reference(x + residual, weight, EPS))


@pytest.mark.parametrize("device,shape,strided", NORM_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_sandwich(device, shape, strided, dtype, gen, tiles):
    """Gemma 2/3 between sublayers in one launch: the residual plus the sublayer's post-normed output (rounded as torch
    rounds the two), and the next norm of that sum. The post-norm may differ from the twin's by one rounding (its
    statistics summed in another order); where the residual nearly cancels it, that step is all of the sum (on the
    H100, 32-215 of 8-33M elements of the large cases, relative differences up to 1), so the sum is held to two steps
    of its two terms (the post-norm's rounding, then the sum's, which can fall on either side: 1.63 steps the most an
    H100 showed), and the next norm to one rounding of the norm of the sum it got."""
    x = _norm_input(shape, strided, dtype, device, gen)
    residual = _randn(shape, dtype, device, gen)
    post, weight = _randn(shape[-1:], dtype, device, gen), _randn(shape[-1:], dtype, device, gen)
    out, summed = gemma_sandwich(x, residual, post, weight, EPS)
    _, ref_sum = gemma_sandwich_reference(x, residual, post, weight, EPS)
    step = {torch.float32: NORM_FP32_RTOL, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    terms = gemma_rmsnorm_reference(x, post, EPS).float().abs() + residual.float().abs()
    assert ((summed.float() - ref_sum.float()).abs() <= 2 * step * terms + 1e-30).all()
    if dtype != torch.float32:  # (in float32 most sums' last bits follow the post-norm's)
        assert (summed != ref_sum).sum().item() <= 1 + 0.02 * summed.numel()
    _assert_one_rounding_close(out, gemma_rmsnorm_reference(summed, weight, EPS))  # (the norm of its own sum)


@pytest.mark.parametrize("device,shape,strided", NORM_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_olmo2_rmsnorm_and_post_add(device, shape, strided, dtype, gen, tiles):
    """OLMo 2's norm (the weight applied in float32, one rounding; strided rows: q and k out of the fused projection,
    normed over all their heads), and its `residual + norm(sublayer)` in one launch, held as gemma_sandwich's sum."""
    x = _norm_input(shape, strided, dtype, device, gen)
    weight = _randn(shape[-1:], dtype, device, gen)
    _assert_one_rounding_close(olmo2_rmsnorm(x, weight, EPS), olmo2_rmsnorm_reference(x, weight, EPS))
    residual = _randn(shape, dtype, device, gen)
    summed = olmo2_post_add(x, residual, weight, EPS)
    ref_sum = olmo2_post_add_reference(x, residual, weight, EPS)
    assert summed.shape == ref_sum.shape and summed.dtype == dtype
    step = {torch.float32: NORM_FP32_RTOL, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    terms = olmo2_rmsnorm_reference(x, weight, EPS).float().abs() + residual.float().abs()
    assert ((summed.float() - ref_sum.float()).abs() <= 2 * step * terms + 1e-30).all()
    if dtype != torch.float32:
        assert (summed != ref_sum).sum().item() <= 1 + 0.02 * summed.numel()
    if dtype != torch.float32 and x.numel() >= 200:  # (in a half dtype the one rounding shows against Llama's two)
        assert not torch.equal(olmo2_rmsnorm(x, weight, EPS), rmsnorm(x, weight, EPS))


def _positions(n: int, max_positions: int, gen) -> torch.Tensor:
    """n unsorted positions, half of them within 64 of max_positions (the table's last rows)."""
    far = torch.randint(0, max_positions, (n - n // 2,), generator=gen)
    near = max_positions - 1 - torch.randint(0, 64, (n // 2,), generator=gen)
    return torch.cat([near, far])[torch.randperm(n, generator=gen)]


def _qkv(n, heads, kv_heads, head_dim, dtype, device, gen):
    """q [n, heads, head_dim], k, v [n, kv_heads, head_dim]: strided views of one fused projection, as the engine's."""
    qkv = _randn((n, (heads + 2 * kv_heads) * head_dim), dtype, device, gen)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim), v.view(n, kv_heads, head_dim)


ROTARY_CASES = _cases(
    # (tokens, heads, kv_heads, head_dim, max_positions): GQA ratios 1, 2, 3, 4, 8; odd head counts; head_dim 24.
    # No token, one, and two (one position near the table's end, one anywhere): tokens are the grid's first axis,
    # each program one token's heads, so more tokens repeat the same program (narrow tiles: one per token and head)
    small=[(0, 4, 2, 16, 256), (1, 3, 1, 16, 256), (2, 7, 7, 32, 4096), (2, 8, 2, 16, 4096), (2, 8, 1, 24, 4096),
           (2, 4, 4, 64, 300)],
    large=[(1, 32, 8, 128, 131072), (7, 32, 8, 128, 131072), (8192, 32, 8, 128, 131072)])


@pytest.mark.parametrize("device,n,heads,kv_heads,head_dim,max_positions", ROTARY_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(device, n, heads, kv_heads, head_dim, max_positions, dtype, gen, tiles):
    rope = RotaryEmbedding(head_dim, max_positions, 500000.0, LLAMA3_SCALING, torch.device(device))
    q, k, _ = _qkv(n, heads, kv_heads, head_dim, dtype, device, gen)
    positions = _positions(n, max_positions, gen).to(device)
    q_out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
    k_out = torch.full(k.shape, float("nan"), dtype=dtype, device=device)
    apply_rotary(q, k, rope.cos, rope.sin, positions, q_out=q_out, k_out=k_out)
    q_ref, k_ref = apply_rotary_reference(q, k, rope.cos, rope.sin, positions)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


SILU_CASES = _cases(small=[(0, 40), (1, 40), (3, 100), (5, 96), (2, 1000)],
                    large=[(1, 14336), (7, 14336), (8192, 14336)])


@pytest.mark.parametrize("device,n,inter", SILU_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(device, n, inter, dtype, gen, tiles):
    gate_up = _randn((n, 2 * inter), dtype, device, gen, scale=2.0)
    out = torch.full((n, inter), float("nan"), dtype=dtype, device=device)
    silu_and_mul(gate_up, out=out)
    gate, up = gate_up.chunk(2, dim=-1)
    _assert_rounding_close(out, silu_and_mul_reference(gate_up), F.silu(gate), lambda t: t * up, SILU_FP32_RTOL,
                           SILU_HALF_FRACTION)


GELU_CASES = _cases(small=[(0, 40), (1, 40), (3, 100), (2, 1000)], large=[(1, 14336), (7, 15360), (8192, 14336)])
GELU_TAIL = -3.5  # below it 1 + tanh(...) cancels: the activation is tanh's error, not its own rounding (test below)


@pytest.mark.parametrize("device,n,inter", GELU_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul(device, n, inter, dtype, gen, tiles):
    """Gemma's GELU (tanh form) and multiply: as silu_and_mul, within a rounding of the twin's activation. Where the
    gate is below GELU_TAIL, 1 + tanh(...) cancels, and a tanh a few float32 ulps from torch's (the interpreter's is
    its own; compiled, libdevice's is CUDA's) moves the activation by more than its rounding: there the product is
    held to that error, 0.5 * |gate| * 4 ulp(1) * |up|, and a rounding of each step."""
    gate_up = _randn((n, 2 * inter), dtype, device, gen, scale=2.0)
    out = torch.full((n, inter), float("nan"), dtype=dtype, device=device)
    gelu_tanh_and_mul(gate_up, out=out)
    ref = gelu_tanh_and_mul_reference(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    # (in float32 every element: the cancellation grows gradually below 0)
    tail = gate.float() < (GELU_TAIL if dtype != torch.float32 else float("inf"))
    step = {torch.float32: 2 ** -23, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    err = (out.float() - ref.float()).abs()[tail]
    bound = (0.5 * gate.float().abs() * 4 * 2 ** -23 * up.float().abs() + 3 * step * ref.float().abs())[tail]
    assert not out.isnan().any() and (err <= bound + 1e-30).all(), f"{(err > bound).sum().item()} beyond tanh's error"
    if dtype == torch.float32:
        return
    inter_ref = F.gelu(gate, approximate="tanh")
    _assert_rounding_close(torch.where(tail, ref, out), ref, inter_ref, lambda t: t * up, SILU_FP32_RTOL,
                           SILU_HALF_FRACTION)


STORE_CASES = _cases(
    # (tokens, kv_heads, head_dim, pages of 16 slots); a program per token (and head, narrow): a few scattered
    # tokens show what more of them would
    small=[(0, 2, 16, 4), (5, 1, 16, 4), (3, 3, 24, 2), (3, 8, 32, 3), (4, 7, 16, 8)],
    large=[(1, 8, 128, 1100), (7, 8, 128, 1100), (8192, 8, 128, 1100)])


@pytest.mark.parametrize("device,n,kv_heads,head_dim,pages", STORE_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv(device, n, kv_heads, head_dim, pages, dtype, gen, tiles):
    pool = KVPool(pages, 16, 2, kv_heads, head_dim, dtype, torch.device(device))
    for buf in pool.buffers():
        buf.fill_(float("nan"))
    k = _randn((n, kv_heads, 2 * head_dim), dtype, device, gen)[..., :head_dim]  # strided: heads 2 * head_dim apart
    v = _randn((n, kv_heads, head_dim), dtype, device, gen)
    loc = torch.randperm(pool.num_slots, generator=gen)[:n].to(device)  # unsorted, scattered over the pool
    k_ref, v_ref = pool.k[1].clone(), pool.v[1].clone()
    store_kv(pool.k[1], pool.v[1], loc, k, v)
    store_kv_reference(k_ref, v_ref, loc, k, v)
    bits = {2: torch.int16, 4: torch.int32}[k.element_size()]
    assert torch.equal(pool.k[1].view(bits), k_ref.view(bits)) and torch.equal(pool.v[1].view(bits), v_ref.view(bits))
    assert pool.k[0].isnan().all() and pool.v[0].isnan().all()


@pytest.mark.parametrize("n", [1, 37])
def test_store_kv_latent_once(n, gen, tiles):
    """A latent pool (K and V one buffer, engine.models.deepseek) is written through K alone: the store leaves V's
    input unread (NaN here) and matches its twin bit for bit; the pool lists the buffer once a layer."""
    pool = KVPool(8, 16, 2, 1, 576, torch.bfloat16, torch.device(KERNEL_DEVICE), shared_kv=True)
    assert pool.parts == 1 and pool.buffers() == [pool.k[0], pool.k[1]] and pool.v[1] is pool.k[1]
    latent = _randn((n, 1, 576), torch.bfloat16, KERNEL_DEVICE, gen)
    loc = torch.randperm(pool.num_slots, generator=gen)[:n].to(KERNEL_DEVICE)
    ref = pool.k[1].clone()
    store_kv(pool.k[1], None, loc, latent, None)
    store_kv_reference(ref, None, loc, latent, None)
    assert torch.equal(pool.k[1].view(torch.int16), ref.view(torch.int16)) and not pool.k[0].any()
    pool.write(0, loc, latent, torch.full_like(latent, float("nan")))  # (the pool's own path: the kernel on CUDA)
    assert torch.equal(pool.k[0].view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("device,n,heads,kv_heads,head_dim,max_positions", ROTARY_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_store_kv(device, n, heads, kv_heads, head_dim, max_positions, dtype, gen, tiles):
    """Rotary and the KV store in one launch: bit for bit the two kernels' twins, k and v strided (slices of one qkv
    row, as the model hands them over), nothing written outside the tokens' slots."""
    rope = RotaryEmbedding(head_dim, max_positions, 500000.0, LLAMA3_SCALING, torch.device(device))
    q, k, v = _qkv(n, heads, kv_heads, head_dim, dtype, device, gen)
    positions = _positions(n, max_positions, gen).to(device)
    pool = KVPool(-(-max(n, 1) // 16) + 2, 16, 2, kv_heads, head_dim, dtype, torch.device(device))
    for buf in pool.buffers():
        buf.fill_(float("nan"))
    loc = torch.randperm(pool.num_slots, generator=gen)[:n].to(device)
    k_ref, v_ref = pool.k[1].clone(), pool.v[1].clone()
    q_out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
    got = rotary_store_kv(q, k, v, rope.cos, rope.sin, positions, pool.k[1], pool.v[1], loc, q_out=q_out)
    q_ref = rotary_store_kv_reference(q, k, v, rope.cos, rope.sin, positions, k_ref, v_ref, loc)
    bits = {2: torch.int16, 4: torch.int32}[q.element_size()]
    assert got is q_out and torch.equal(q_out, q_ref)
    assert torch.equal(pool.k[1].view(bits), k_ref.view(bits)) and torch.equal(pool.v[1].view(bits), v_ref.view(bits))
    assert pool.k[0].isnan().all() and pool.v[0].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_outputs_may_alias_inputs(dtype, gen):
    """residual_out=residual and q_out=q, k_out=k (contiguous) update in place."""
    x, residual = (_randn((3, 40), dtype, KERNEL_DEVICE, gen) for _ in range(2))
    weight = _randn((40,), dtype, KERNEL_DEVICE, gen)
    _, ref_res = fused_add_rmsnorm_reference(x, residual, weight, EPS)
    fused_add_rmsnorm(x, residual, weight, EPS, residual_out=residual)
    assert torch.equal(residual, ref_res)
    rope = RotaryEmbedding(16, 64, 10000.0, None, torch.device(KERNEL_DEVICE))
    q, k = _randn((3, 4, 16), dtype, KERNEL_DEVICE, gen), _randn((3, 2, 16), dtype, KERNEL_DEVICE, gen)
    positions = _positions(3, 64, gen).to(KERNEL_DEVICE)
    q_ref, k_ref = apply_rotary_reference(q, k, rope.cos, rope.sin, positions)
    apply_rotary(q, k, rope.cos, rope.sin, positions, q_out=q, k_out=k)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


# ---- The twins carry the engine's numerics: its torch layers, run on CPU (on CUDA the layers call these kernels) ----


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_twins_equal_the_engine_layers(dtype, gen):
    norm = RMSNorm(96, EPS).to(dtype=dtype)
    norm.weight.data.copy_(_randn((96,), dtype, "cpu", gen))
    hidden, attn_out = _randn((7, 96), dtype, "cpu", gen), _randn((7, 96), dtype, "cpu", gen)
    per_head = _randn((5, 3, 96), dtype, "cpu", gen)  # Qwen3's q/k norm over head_dim
    with torch.no_grad():
        summed = hidden + attn_out  # the decoder layer's hidden + self_attn(...)
        normed, new_residual = fused_add_rmsnorm_reference(attn_out, hidden, norm.weight, EPS)
        assert torch.equal(new_residual, summed) and torch.equal(normed, norm(summed))
        assert torch.equal(rmsnorm_reference(per_head, norm.weight, EPS), norm(per_head))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_twin_equals_the_engine(dtype, gen):
    rope = RotaryEmbedding(64, 4096, 500000.0, LLAMA3_SCALING, torch.device("cpu"))
    q, k, _ = _qkv(9, 8, 2, 64, dtype, "cpu", gen)
    positions = _positions(9, 4096, gen)
    expected = engine_apply_rotary(q, k, *rope.lookup(positions, dtype))
    got = apply_rotary_reference(q, k, rope.cos, rope.sin, positions)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_twin_equals_the_engine_mlp(dtype, gen):
    mlp = MLP(48, 80).to(dtype=dtype)
    for p in mlp.parameters():
        p.data.copy_(_randn(p.shape, dtype, "cpu", gen, scale=0.2))
    x = _randn((6, 48), dtype, "cpu", gen)
    with torch.no_grad():
        assert torch.equal(mlp.down_proj(silu_and_mul_reference(mlp.gate_up_proj(x))), mlp(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_twin_equals_the_pool_write(dtype, gen):
    pool = KVPool(4, 16, 2, 3, 16, dtype, torch.device("cpu"))
    for buf in pool.buffers():
        buf.copy_(_randn(buf.shape, dtype, "cpu", gen))
    k_ref, v_ref = pool.k[1].clone(), pool.v[1].clone()
    loc = torch.randperm(pool.num_slots, generator=gen)[:10]
    k, v = _randn((10, 3, 16), dtype, "cpu", gen), _randn((10, 3, 16), dtype, "cpu", gen)
    pool.write(1, loc, k, v)
    store_kv_reference(k_ref, v_ref, loc, k, v)
    assert torch.equal(pool.k[1], k_ref) and torch.equal(pool.v[1], v_ref)
