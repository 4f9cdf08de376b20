"""Qwen3's per-head q/k RMSNorm inside the rotary launch (kernels.rotary `qk_norm`), alone and fused with the KV
store, against the twin (kernels.norm's twin on q and k, then the rotary twin), and the twin against what the engine
does without the kernel (engine.layers.norm.RMSNorm, then engine.layers.rotary). Head sizes that leave masked lanes
(24), grouped-query ratios 1 to 7, several heads per program (the `wide` launch). In Triton's interpreter without
CUDA, on the GPU with it.

In float32 the kernel's statistics add the head's halves in another order: within 1e-5. In bfloat16 a normed value
may round to the neighbour of the twin's (then the rotation moves the output by about an ulp): nearly every element
equal, none off by more than a few ulps."""

from __future__ import annotations

import pytest
import torch

from radixmesh import kernels
import radixmesh.kernels.rotary
from radixmesh.engine.cache.kv_pool import KVPool
from radixmesh.engine.layers.norm import RMSNorm
from radixmesh.engine.layers.rotary import RopeInputs, RotaryEmbedding
from radixmesh.kernels.rotary import (QKNorm, apply_rotary, apply_rotary_reference, rotary_store_kv,
                                      rotary_store_kv_reference)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
CASES = [(1, 4, 2, 16), (3, 7, 1, 24), (2, 8, 8, 32)]  # (tokens, heads, kv_heads, head_dim)




def _inputs(n: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(n * 100 + heads * 10 + head_dim)
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype)  # strided, as the model's
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    norm = QKNorm((1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype),
                  (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype), EPS)
    positions = torch.randint(0, 500, (n,), generator=gen)
    rope = RotaryEmbedding(head_dim, 512, 1e6, None, torch.device("cpu"))
    return (q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim), v.view(n, kv_heads, head_dim), norm,
            positions, rope)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    differ = (got != want).float().mean().item()
    assert differ <= 0.02, f"{differ:.1%} of the elements differ from the twin"
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=4e-2)


@pytest.mark.parametrize("n,heads,kv_heads,head_dim", CASES)
@pytest.mark.parametrize("dtype,wide", [(torch.float32, True), (torch.bfloat16, False), (torch.bfloat16, True)],
                         ids=["float32-wide", "bfloat16-narrow", "bfloat16-wide"])
def test_norm_then_rotary_in_one_launch_matches_the_twin(n, heads, kv_heads, head_dim, dtype, wide, monkeypatch):
    """wide: several heads per program (partly masked), as with many tokens; narrow: one head per program."""
    if wide:
        monkeypatch.setattr(kernels.rotary, "_MIN_PROGRAMS", 1)
    q, k, _, norm, positions, rope = _inputs(n, heads, kv_heads, head_dim, dtype)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    got_q, got_k = apply_rotary(dev(q), dev(k), dev(rope.cos), dev(rope.sin), dev(positions),
                                qk_norm=QKNorm(*map(dev, norm[:2]), EPS))
    want_q, want_k = apply_rotary_reference(q, k, rope.cos, rope.sin, positions, norm)
    _close(got_q.cpu(), want_q)
    _close(got_k.cpu(), want_k)
    plain_q, _ = apply_rotary_reference(q, k, rope.cos, rope.sin, positions)
    assert not torch.allclose(plain_q.float(), want_q.float(), atol=0.1)  # the norm did something


@pytest.mark.parametrize("n,heads,kv_heads,head_dim", CASES[1:])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_norm_rotary_and_the_kv_store_in_one_launch_match_the_twin(n, heads, kv_heads, head_dim, dtype):
    q, k, v, norm, positions, rope = _inputs(n, heads, kv_heads, head_dim, dtype)
    pool = KVPool(2, 16, 1, kv_heads, head_dim, dtype, torch.device("cpu"))
    for buf in pool.buffers():
        buf.fill_(float("nan"))
    loc = torch.randperm(pool.num_slots, generator=torch.Generator().manual_seed(n))[:n]
    k_ref, v_ref = pool.k[0].clone(), pool.v[0].clone()
    want_q = rotary_store_kv_reference(q, k, v, rope.cos, rope.sin, positions, k_ref, v_ref, loc, norm)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    k_cache, v_cache = dev(pool.k[0]), dev(pool.v[0])
    got_q = rotary_store_kv(dev(q), dev(k), dev(v), dev(rope.cos), dev(rope.sin), dev(positions), k_cache, v_cache,
                            dev(loc), qk_norm=QKNorm(*map(dev, norm[:2]), EPS))
    _close(got_q.cpu(), want_q)
    _close(k_cache.cpu()[loc], k_ref[loc])
    assert torch.equal(v_cache.cpu()[loc], v_ref[loc])
    untouched = torch.ones(pool.num_slots, dtype=torch.bool)
    untouched[loc] = False
    assert k_cache.cpu()[untouched].isnan().all() and v_cache.cpu()[untouched].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_twin_is_the_engines_norm_then_rotary(dtype):
    """What Qwen3's attention computes without the kernel (RMSNorm modules, then the looked-up rotation), bit for
    bit; and RopeInputs.norm_qk leaves the norm to the kernel only where the kernel rotates."""
    q, k, _, norm, positions, rope = _inputs(3, 4, 2, 32, dtype)
    q_norm, k_norm = RMSNorm(32, EPS).to(dtype), RMSNorm(32, EPS).to(dtype)
    with torch.no_grad():
        q_norm.weight.copy_(norm.q_weight)
        k_norm.weight.copy_(norm.k_weight)
    looked_up = RopeInputs(rope, positions, *rope.lookup(positions, dtype))
    normed_q, normed_k, same = looked_up.norm_qk(q, k, q_norm, k_norm)
    assert same is looked_up and same.qk_norm is None
    want = apply_rotary_reference(q, k, rope.cos, rope.sin, positions, norm)
    for got, ref in zip(looked_up.apply(normed_q, normed_k), want):
        assert torch.equal(got, ref)
    kernel_rope = RopeInputs(rope, positions, None, None)
    q2, k2, carried = kernel_rope.norm_qk(q, k, q_norm, k_norm)
    assert q2 is q and k2 is k and carried.qk_norm[0] is q_norm.weight and carried.qk_norm[2] == EPS


def test_norm_weights_of_another_shape_or_dtype_are_refused():
    q, k, _, norm, positions, rope = _inputs(1, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="q/k norm weights"):
        apply_rotary(q, k, rope.cos, rope.sin, positions, qk_norm=QKNorm(norm.q_weight[:8], norm.k_weight, EPS))
    with pytest.raises(ValueError, match="q/k norm weights"):
        apply_rotary(q, k, rope.cos, rope.sin, positions,
                     qk_norm=QKNorm(norm.q_weight, norm.k_weight.to(torch.bfloat16), EPS))
