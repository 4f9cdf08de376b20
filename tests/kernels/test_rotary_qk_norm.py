"""Qwen3's per-head q/k RMSNorm (and Gemma 3's, with offset weights; Command-R+'s, StableLM 2's and Phi's LayerNorms)
inside the rotary launch (kernels.rotary `qk_norm`), alone and fused with the KV store, against the twin (kernels.norm's
twin on q and k, then the rotary twin), and the twin against what the engine does without the kernel
(engine.layers.norm.RMSNorm / GemmaRMSNorm / HeadLayerNorm, then engine.layers.rotary). Partial rotary (the leading dimensions of a head rotate, the rest pass through): bit for bit
without a norm. Head sizes that leave masked lanes (24), grouped-query ratios 1 to 7, several heads per program (the
`wide` launch). In Triton's interpreter without CUDA, on the GPU with it.

In float32 the kernel's statistics add the head's halves in another order: within 1e-5. In bfloat16 a normed value
may round to the neighbour of the twin's (then the rotation moves the output by about an ulp): nearly every element
equal, none off by more than a few ulps."""

from __future__ import annotations

import pytest
import torch

from radixmesh import kernels
import radixmesh.kernels.rotary
from radixmesh.engine.cache.kv_pool import KVPool
from radixmesh.engine.layers.norm import GemmaRMSNorm, HeadLayerNorm, LayerNorm, RMSNorm
from radixmesh.engine.layers.rotary import RopeInputs, RotaryEmbedding, _kernel_norm
from radixmesh.engine.layers.rotary import apply_rotary as engine_rotary
from radixmesh.kernels.rotary import (Pairs, QKNorm, apply_rotary, apply_rotary_reference, rotary_store_kv,
                                      rotary_store_kv_reference)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
CASES = [(1, 4, 2, 16), (3, 7, 1, 24), (2, 8, 8, 32)]  # (tokens, heads, kv_heads, head_dim)




def _inputs(n: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, offset: bool = False,
            rotary_dim: int | None = None):
    """offset: Gemma's norm (weights around 0, applied as 1 + weight); rotary_dim: a partial table."""
    gen = torch.Generator().manual_seed(n * 100 + heads * 10 + head_dim)
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype)  # strided, as the model's
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    base = 0.0 if offset else 1.0
    norm = QKNorm((base + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype),
                  (base + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype), EPS, offset)
    positions = torch.randint(0, 500, (n,), generator=gen)
    rope = RotaryEmbedding(rotary_dim or head_dim, 512, 1e6, None, torch.device("cpu"))
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
@pytest.mark.parametrize("offset", [False, True], ids=["qwen3", "gemma"])
def test_norm_then_rotary_in_one_launch_matches_the_twin(n, heads, kv_heads, head_dim, dtype, wide, offset,
                                                         monkeypatch):
    """wide: several heads per program (partly masked), as with many tokens; narrow: one head per program."""
    if wide:
        monkeypatch.setattr(kernels.rotary, "_MIN_PROGRAMS", 1)
    q, k, _, norm, positions, rope = _inputs(n, heads, kv_heads, head_dim, dtype, offset)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    got_q, got_k = apply_rotary(dev(q), dev(k), dev(rope.cos), dev(rope.sin), dev(positions),
                                qk_norm=QKNorm(*map(dev, norm[:2]), EPS, offset))
    want_q, want_k = apply_rotary_reference(q, k, rope.cos, rope.sin, positions, norm)
    _close(got_q.cpu(), want_q)
    _close(got_k.cpu(), want_k)
    plain_q, _ = apply_rotary_reference(q, k, rope.cos, rope.sin, positions)
    assert not torch.allclose(plain_q.float(), want_q.float(), atol=0.1)  # the norm did something


@pytest.mark.parametrize("n,heads,kv_heads,head_dim", CASES[1:])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("offset", [False, True], ids=["qwen3", "gemma"])
def test_norm_rotary_and_the_kv_store_in_one_launch_match_the_twin(n, heads, kv_heads, head_dim, dtype, offset):
    q, k, v, norm, positions, rope = _inputs(n, heads, kv_heads, head_dim, dtype, offset)
    pool = KVPool(2, 16, 1, kv_heads, head_dim, dtype, torch.device("cpu"))
    for buf in pool.buffers():
        buf.fill_(float("nan"))
    loc = torch.randperm(pool.num_slots, generator=torch.Generator().manual_seed(n))[:n]
    k_ref, v_ref = pool.k[0].clone(), pool.v[0].clone()
    want_q = rotary_store_kv_reference(q, k, v, rope.cos, rope.sin, positions, k_ref, v_ref, loc, norm)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    k_cache, v_cache = dev(pool.k[0]), dev(pool.v[0])
    got_q = rotary_store_kv(dev(q), dev(k), dev(v), dev(rope.cos), dev(rope.sin), dev(positions), k_cache, v_cache,
                            dev(loc), qk_norm=QKNorm(*map(dev, norm[:2]), EPS, offset))
    _close(got_q.cpu(), want_q)
    _close(k_cache.cpu()[loc], k_ref[loc])
    assert torch.equal(v_cache.cpu()[loc], v_ref[loc])
    untouched = torch.ones(pool.num_slots, dtype=torch.bool)
    untouched[loc] = False
    assert k_cache.cpu()[untouched].isnan().all() and v_cache.cpu()[untouched].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("offset", [False, True], ids=["qwen3", "gemma"])
def test_the_twin_is_the_engines_norm_then_rotary(dtype, offset):
    """What Qwen3's (Gemma 3's) attention computes without the kernel (RMSNorm / GemmaRMSNorm modules, then the
    looked-up rotation), bit for bit; and RopeInputs.norm_qk leaves the norm to the kernel only where the kernel
    rotates."""
    q, k, _, norm, positions, rope = _inputs(3, 4, 2, 32, dtype, offset)
    kind = GemmaRMSNorm if offset else RMSNorm
    q_norm, k_norm = kind(32, EPS).to(dtype), kind(32, EPS).to(dtype)
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
    assert carried.qk_norm[3] is offset


PARTIAL = [(2, 4, 2, 24, 16), (1, 8, 2, 32, 16), (3, 6, 3, 40, 30), (2, 2, 1, 128, 64)]  # (..., head_dim, rotary_dim)


@pytest.mark.parametrize("n,heads,kv_heads,head_dim,rotary_dim", PARTIAL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("norm_kind", [None, "qwen3", "gemma"])
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_partial_rotary_in_one_launch_matches_the_twin(n, heads, kv_heads, head_dim, rotary_dim, dtype, norm_kind,
                                                       wide, monkeypatch):
    """Phi-4-mini's, GLM-4.5's, MiniMax-M2's layout: the leading rotary_dim dimensions rotate (rotary_dim / 2 need not
    be a power of two: 15), the rest pass through, normed over the whole head first with a norm; with the KV store.
    Without a norm the kernel is the twin bit for bit, and the twin is the engine's partial rotation."""
    if wide:
        monkeypatch.setattr(kernels.rotary, "_MIN_PROGRAMS", 1)
    q, k, v, norm, positions, rope = _inputs(n, heads, kv_heads, head_dim, dtype, norm_kind == "gemma", rotary_dim)
    assert rope.cos.shape[1] == rotary_dim
    norm = None if norm_kind is None else norm
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    dev_norm = None if norm is None else QKNorm(*map(dev, norm[:2]), EPS, norm.offset)
    want_q, want_k = apply_rotary_reference(q, k, rope.cos, rope.sin, positions, norm)
    got_q, got_k = apply_rotary(dev(q), dev(k), dev(rope.cos), dev(rope.sin), dev(positions), qk_norm=dev_norm)
    pool = KVPool(2, 16, 1, kv_heads, head_dim, dtype, torch.device("cpu"))
    for buf in pool.buffers():
        buf.fill_(float("nan"))
    loc = torch.randperm(pool.num_slots, generator=torch.Generator().manual_seed(n))[:n]
    k_cache, v_cache = dev(pool.k[0]), dev(pool.v[0])
    stored_q = rotary_store_kv(dev(q), dev(k), dev(v), dev(rope.cos), dev(rope.sin), dev(positions), k_cache, v_cache,
                               dev(loc), qk_norm=dev_norm)
    assert torch.equal(stored_q, got_q) and torch.equal(k_cache[dev(loc)], got_k)
    assert torch.equal(v_cache.cpu()[loc], v)
    untouched = torch.ones(pool.num_slots, dtype=torch.bool)
    untouched[loc] = False
    assert k_cache.cpu()[untouched].isnan().all() and v_cache.cpu()[untouched].isnan().all()
    if norm is None:
        assert torch.equal(got_q.cpu(), want_q) and torch.equal(got_k.cpu(), want_k)
        cos, sin = rope.lookup(positions, dtype)
        engine_q, engine_k = engine_rotary(q, k, cos, sin)
        assert torch.equal(engine_q, want_q) and torch.equal(engine_k, want_k)
        assert torch.equal(want_q[..., rotary_dim:], q[..., rotary_dim:])  # the tail passed through
        assert not torch.equal(want_q[..., :rotary_dim], q[..., :rotary_dim])
    else:
        _close(got_q.cpu(), want_q)
        _close(got_k.cpu(), want_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_store_through_a_slot_map_writes_the_mapped_rows(dtype):
    """A sliding layer's pool addressed by full slots (engine.cache.swa_pool): the row is slot_map[loc], looked up in
    the launch; bit for bit the twin, which stores at slot_map[loc]; no other row touched."""
    q, k, v, _, positions, rope = _inputs(3, 4, 2, 16, dtype)
    pool = KVPool(2, 8, 1, 2, 16, dtype, torch.device("cpu"))
    for buf in pool.buffers():
        buf.fill_(float("nan"))
    gen = torch.Generator().manual_seed(7)
    slot_map = torch.randperm(pool.num_slots, generator=gen).repeat(3)  # full slots -> the sliding pool's 16
    loc = torch.tensor([3, 20, 41])
    k_ref, v_ref = pool.k[0].clone(), pool.v[0].clone()
    want_q = rotary_store_kv_reference(q, k, v, rope.cos, rope.sin, positions, k_ref, v_ref, loc, slot_map=slot_map)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    k_cache, v_cache = dev(pool.k[0]), dev(pool.v[0])
    got_q = rotary_store_kv(dev(q), dev(k), dev(v), dev(rope.cos), dev(rope.sin), dev(positions), k_cache, v_cache,
                            dev(loc), slot_map=dev(slot_map))
    assert torch.equal(got_q.cpu(), want_q)
    rows = slot_map[loc]
    assert torch.equal(k_cache.cpu()[rows], k_ref[rows]) and torch.equal(v_cache.cpu()[rows], v)
    untouched = torch.ones(pool.num_slots, dtype=torch.bool)
    untouched[rows] = False
    assert k_cache.cpu()[untouched].isnan().all() and v_cache.cpu()[untouched].isnan().all()
    with pytest.raises(ValueError, match="slot_map"):
        rotary_store_kv(q, k, v, rope.cos, rope.sin, positions, pool.k[0], pool.v[0], loc, slot_map=slot_map.float())


INTERLEAVED = [(2, 4, 2, 16, 16), (3, 6, 3, 24, 24), (1, 8, 2, 32, 16), (2, 2, 1, 128, 64)]


@pytest.mark.parametrize("n,heads,kv_heads,head_dim,rotary_dim", INTERLEAVED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("upcast", [True, False], ids=["cohere", "glm"])
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_interleaved_pairs_in_one_launch_match_the_twin_bit_for_bit(n, heads, kv_heads, head_dim, rotary_dim, dtype,
                                                                    upcast, wide, monkeypatch):
    """GPT-J's pairs (Cohere's in float32, GLM-4's in the model dtype; GLM's half-rotary heads), alone and with the
    KV store: bit for bit the twin, and the twin the engine's interleaved rotation."""
    if wide:
        monkeypatch.setattr(kernels.rotary, "_MIN_PROGRAMS", 1)
    q, k, v, _, positions, _ = _inputs(n, heads, kv_heads, head_dim, dtype)
    rope = RotaryEmbedding(rotary_dim, 512, 1e4, None, torch.device("cpu"), interleaved=True, upcast_pairs=upcast)
    pairs = Pairs(upcast)
    want_q, want_k = apply_rotary_reference(q, k, rope.cos, rope.sin, positions, pairs=pairs)
    cos, sin = rope.lookup(positions, dtype)
    engine_q, engine_k = engine_rotary(q, k, cos, sin, interleaved=True, upcast_pairs=upcast)
    assert torch.equal(engine_q, want_q) and torch.equal(engine_k, want_k)
    assert not torch.equal(want_q, apply_rotary_reference(q, k, rope.cos, rope.sin, positions)[0])
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    got_q, got_k = apply_rotary(dev(q), dev(k), dev(rope.cos), dev(rope.sin), dev(positions), pairs=pairs)
    assert torch.equal(got_q.cpu(), want_q) and torch.equal(got_k.cpu(), want_k)
    pool = KVPool(2, 16, 1, kv_heads, head_dim, dtype, torch.device("cpu"))
    loc = torch.randperm(pool.num_slots, generator=torch.Generator().manual_seed(n))[:n]
    k_cache, v_cache = dev(pool.k[0]), dev(pool.v[0])
    stored_q = rotary_store_kv(dev(q), dev(k), dev(v), dev(rope.cos), dev(rope.sin), dev(positions), k_cache, v_cache,
                               dev(loc), pairs=pairs)
    assert torch.equal(stored_q.cpu(), want_q) and torch.equal(k_cache.cpu()[loc], want_k)
    assert torch.equal(v_cache.cpu()[loc], v)


LAYER = [(2, 4, 2, 16, 16, False), (3, 6, 3, 24, 12, False), (1, 8, 2, 32, 16, True), (2, 2, 1, 128, 32, True)]


def _layer_norm(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, per_head: bool, gen):
    """Command-R+'s / StableLM 2's per-head LayerNorm (a float32 weight row a head, no bias), or Phi's (one weight and
    one bias of the model dtype for every head)."""
    if per_head:
        return QKNorm(1 + 0.3 * torch.randn(heads, head_dim, generator=gen),
                      1 + 0.3 * torch.randn(kv_heads, head_dim, generator=gen), 1e-5, layer=True)
    weights = [(1 + 0.3 * torch.randn(head_dim, generator=gen)).to(dtype) for _ in range(2)]
    biases = [(0.2 * torch.randn(head_dim, generator=gen)).to(dtype) for _ in range(2)]
    return QKNorm(*weights, 1e-5, layer=True, q_bias=biases[0], k_bias=biases[1])


@pytest.mark.parametrize("n,heads,kv_heads,head_dim,rotary_dim,interleaved", LAYER)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("per_head", [True, False], ids=["cohere", "phi"])
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_a_layer_norm_per_head_then_rotary_in_one_launch_matches_the_twin(n, heads, kv_heads, head_dim, rotary_dim,
                                                                          interleaved, dtype, per_head, wide,
                                                                          monkeypatch):
    """Command-R+'s LayerNorm of each head (its own weight row; interleaved pairs in float32), StableLM 2's (partial
    heads), Phi's (a shared weight and bias): the mean removed, then rotated, alone and with the KV store, against
    the twin; the twin is HeadLayerNorm's arithmetic (the engine's module, bit for bit) and near torch's LayerNorm
    with the bias."""
    if wide:
        monkeypatch.setattr(kernels.rotary, "_MIN_PROGRAMS", 1)
    q, k, v, _, positions, _ = _inputs(n, heads, kv_heads, head_dim, dtype)
    q, k = q + 2.0, k - 1.5  # a mean to remove
    gen = torch.Generator().manual_seed(n + head_dim)
    norm = _layer_norm(heads, kv_heads, head_dim, dtype, per_head, gen)
    rope = RotaryEmbedding(rotary_dim, 512, 1e4, None, torch.device("cpu"), interleaved=interleaved)
    pairs = Pairs(True) if interleaved else None
    want_q, want_k = apply_rotary_reference(q, k, rope.cos, rope.sin, positions, norm, pairs)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    dev_norm = QKNorm(dev(norm.q_weight), dev(norm.k_weight), norm.eps, layer=True,
                      q_bias=None if norm.q_bias is None else dev(norm.q_bias),
                      k_bias=None if norm.k_bias is None else dev(norm.k_bias))
    got_q, got_k = apply_rotary(dev(q), dev(k), dev(rope.cos), dev(rope.sin), dev(positions), qk_norm=dev_norm,
                                pairs=pairs)
    _close(got_q.cpu(), want_q)
    _close(got_k.cpu(), want_k)
    pool = KVPool(2, 16, 1, kv_heads, head_dim, dtype, torch.device("cpu"))
    loc = torch.randperm(pool.num_slots, generator=torch.Generator().manual_seed(n))[:n]
    k_cache, v_cache = dev(pool.k[0]), dev(pool.v[0])
    stored_q = rotary_store_kv(dev(q), dev(k), dev(v), dev(rope.cos), dev(rope.sin), dev(positions), k_cache, v_cache,
                               dev(loc), qk_norm=dev_norm, pairs=pairs)
    assert torch.equal(stored_q, got_q) and torch.equal(k_cache[dev(loc)], got_k)
    assert torch.equal(v_cache.cpu()[loc], v)
    # the twin's norm is the engine's (HeadLayerNorm bit for bit; Phi's nn.LayerNorm with its bias within an ulp)
    unrotated = apply_rotary_reference(q, k, rope.cos[:, :0], rope.sin[:, :0], positions, norm)
    if per_head:
        module = HeadLayerNorm(heads, head_dim, norm.eps)
        with torch.no_grad():
            module.weight.copy_(norm.q_weight)
        assert torch.equal(module(q), unrotated[0])
    else:
        module = LayerNorm(head_dim, norm.eps, bias=True).to(dtype)
        with torch.no_grad():
            module.weight.copy_(norm.q_weight)
            module.bias.copy_(norm.q_bias)
        _close(module(q), unrotated[0])
    assert not torch.allclose(unrotated[0].float(), q.float(), atol=0.1)  # the norm did something


def test_the_engine_leaves_layer_norms_per_head_to_the_kernel():
    """RopeInputs.norm_qk carries Command-R+'s HeadLayerNorms and Phi's LayerNorms (weight and bias) to the kernel
    where it rotates; a LayerNorm without its weight (nothing to carry), one wider than a head or a mixed pair is
    applied in torch."""
    q, k, _, _, positions, rope = _inputs(2, 4, 2, 16, torch.bfloat16)
    kernel_rope = RopeInputs(rope, positions, None, None)
    heads = HeadLayerNorm(4, 16, 1e-5), HeadLayerNorm(2, 16, 1e-5)
    q2, k2, carried = kernel_rope.norm_qk(q, k, *heads)
    assert q2 is q and k2 is k and carried.qk_norm.layer and carried.qk_norm.q_weight is heads[0].weight
    assert carried.qk_norm.q_bias is None
    phi = LayerNorm(16, 1e-5, bias=True), LayerNorm(16, 1e-5, bias=True)
    carried = kernel_rope.norm_qk(q, k, *phi)[2]
    assert carried.qk_norm.layer and carried.qk_norm.k_bias is phi[1].bias
    bare = LayerNorm(16, 1e-5, bias=False, weight=False), LayerNorm(16, 1e-5, bias=False, weight=False)
    for pair in (bare, (heads[0], phi[1])):
        assert kernel_rope.norm_qk(q.float(), k.float(), *pair)[2].qk_norm is None
    wide = LayerNorm(64, 1e-5, bias=True), LayerNorm(32, 1e-5, bias=True)  # (a norm over every head at once)
    assert _kernel_norm(q, *wide) is None


def test_layer_norm_weights_of_another_shape_are_refused():
    q, k, _, _, positions, rope = _inputs(1, 4, 2, 16, torch.float32)
    gen = torch.Generator().manual_seed(0)
    norm = _layer_norm(4, 2, 16, torch.float32, True, gen)
    with pytest.raises(ValueError, match="LayerNorm weights"):
        apply_rotary(q, k, rope.cos, rope.sin, positions, qk_norm=norm._replace(k_weight=norm.k_weight[:1]))
    shared = _layer_norm(4, 2, 16, torch.float32, False, gen)
    with pytest.raises(ValueError, match="LayerNorm weights"):
        apply_rotary(q, k, rope.cos, rope.sin, positions, qk_norm=shared._replace(k_bias=None))
    with pytest.raises(ValueError, match="no biases"):
        apply_rotary(q, k, rope.cos, rope.sin, positions, qk_norm=shared._replace(layer=False))


def test_a_table_wider_than_the_head_or_odd_is_refused():
    q, k, _, _, positions, rope = _inputs(1, 4, 2, 16, torch.float32, rotary_dim=32)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary(q, k, rope.cos, rope.sin, positions)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary(q, k, rope.cos[:, :7], rope.sin[:, :7], positions)


def test_norm_weights_of_another_shape_or_dtype_are_refused():
    q, k, _, norm, positions, rope = _inputs(1, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="q/k norm weights"):
        apply_rotary(q, k, rope.cos, rope.sin, positions, qk_norm=QKNorm(norm.q_weight[:8], norm.k_weight, EPS))
    with pytest.raises(ValueError, match="q/k norm weights"):
        apply_rotary(q, k, rope.cos, rope.sin, positions,
                     qk_norm=QKNorm(norm.q_weight, norm.k_weight.to(torch.bfloat16), EPS))
