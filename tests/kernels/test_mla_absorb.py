"""kernels.mla_absorb: DeepSeek's absorbed products for a few decode rows, each head's query carried into the latent
space (with the query and key rows kernels.mla_decode reads, as kernels.mla_rope writes them) and each head's attention
output carried back out, against their float32 twins and against the engine's torch.bmm path, for V2's, V3's and
rotate-half RoPE, odd head counts and widths that are not powers of two, and strided inputs as the projections and
the attention leave them. In Triton's interpreter without CUDA."""

from __future__ import annotations

import pytest
import torch

from radixmesh.kernels.mla_absorb import (MAX_ROWS, absorbed_query_key, absorbed_query_key_reference, absorbed_values,
                                          absorbed_values_reference)
from radixmesh.kernels.mla_rope import mla_query_key_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROPES = {"v2": (True, True, torch.float32), "v3": (True, False, None), "half": (False, True, None)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (rows, heads, nope, rank, v_dim, rope): one decode row of DeepSeek-V2-Lite's per-head shape, and a ragged one
SHAPES = {"one-row": (1, 16, 128, 512, 128, 64), "ragged": (5, 3, 24, 80, 18, 16)}


def _on(*args):
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in args]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Float32 sums in another order: float32 to a few ulps, bfloat16 to one rounding step of the result."""
    tol = dict(rtol=1e-5, atol=1e-5) if want.dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(got, want, **tol)


def _inputs(shape, dtype, rope_kind, seed):
    n, heads, nope, rank, v_dim, dim = shape
    interleaved, upcast, table = ROPES[rope_kind]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, nope + dim, generator=gen).to(dtype)  # q_proj's rows: nope then rope
    kv = torch.randn(n, rank + dim, generator=gen).to(dtype)  # kv_a's rows: the latent then the rope part
    weight = (torch.randn(heads * (nope + v_dim), rank, generator=gen) / nope ** 0.5).to(dtype)
    angle = torch.rand(n, 1, dim, generator=gen) * 40
    angle = angle[..., ::2].repeat_interleave(2, dim=-1) if interleaved else torch.cat([angle[..., :dim // 2]] * 2, -1)
    cos, sin = (f(angle).to(table or dtype) for f in (torch.cos, torch.sin))
    return (q[..., :nope], weight, v_dim, q[..., nope:], kv[:, :rank], kv[:, rank:], cos, sin, interleaved, upcast)


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_absorbed_query_and_the_key_match_their_twin_and_the_bmm_path(rope, dtype, shape):
    args = _inputs(SHAPES[shape], DTYPES[dtype], rope, seed=len(rope) + len(shape))
    q_nope, weight, v_dim, q_pe, latent, k_pe, cos, sin, interleaved, upcast = args
    query, key = (t.cpu() for t in absorbed_query_key(*_on(*args)))
    want_q, want_k = absorbed_query_key_reference(*args)
    n, heads, nope = q_nope.shape
    rank = weight.shape[1]
    assert query.shape == want_q.shape == (n, heads, rank + q_pe.shape[-1]) and key.shape == want_k.shape
    assert query.dtype == key.dtype == q_nope.dtype
    # the rope parts and the key: bit for bit kernels.mla_rope's rows; the absorbed part: float32 sums
    assert torch.equal(query[..., rank:], want_q[..., rank:]) and torch.equal(key, want_k)
    _close(query[..., :rank], want_q[..., :rank])
    # the engine's path before the kernel: torch.bmm over the heads, then the rows
    w_uk = weight.view(heads, nope + v_dim, rank)[:, :nope]
    bmm = torch.bmm(q_nope.transpose(0, 1).float(), w_uk.float()).transpose(0, 1).to(q_nope.dtype)
    _close(query, mla_query_key_reference(bmm, q_pe, latent, k_pe, cos, sin, interleaved, upcast)[0])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_values_match_their_twin_and_the_bmm_path(dtype, shape):
    n, heads, nope, rank, v_dim, dim = SHAPES[shape]
    gen = torch.Generator().manual_seed(n + heads)
    dt = DTYPES[dtype]
    out = torch.randn(n, heads, rank + dim, generator=gen).to(dt)  # attention's rows: the latent part, then rope
    weight = (torch.randn(heads * (nope + v_dim), rank, generator=gen) / rank ** 0.5).to(dt)
    got = absorbed_values(*_on(out, weight), nope, v_dim).cpu()
    want = absorbed_values_reference(out, weight, nope, v_dim)
    assert got.shape == want.shape == (n, heads * v_dim) and got.dtype == dt
    _close(got, want)
    w_uv = weight.view(heads, nope + v_dim, rank)[:, nope:]
    bmm = torch.bmm(out[..., :rank].transpose(0, 1).float(), w_uv.transpose(1, 2).float()).transpose(0, 1)
    _close(got, bmm.to(dt).reshape(n, heads * v_dim))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_latents_norm_in_the_launch_matches_the_norm_kernels_twin(dtype):
    """With kv_a_layernorm's weight and epsilon the launch norms the latent itself (a strided view as the projection
    leaves it): the key rows as kernels.norm's twin then the rows' twin make them (one rounding step in bfloat16, the
    statistics summed in another order), the rope parts and the query unchanged."""
    args = _inputs(SHAPES["one-row"], DTYPES[dtype], "v3", seed=6)
    rank = args[1].shape[1]
    weight = (1 + 0.3 * torch.randn(rank, generator=torch.Generator().manual_seed(7))).to(DTYPES[dtype])
    query, key = (t.cpu() for t in absorbed_query_key(*_on(*args), norm=(weight.to(DEVICE), 1e-6)))
    want_q, want_k = absorbed_query_key_reference(*args, norm=(weight, 1e-6))
    plain_q, plain_k = (t.cpu() for t in absorbed_query_key(*_on(*args)))
    assert torch.equal(query, plain_q) and torch.equal(key[..., rank:], want_k[..., rank:])
    _close(key[..., :rank], want_k[..., :rank])
    assert not torch.allclose(key[..., :rank].float(), plain_k[..., :rank].float(), atol=1e-2)  # (it did norm)


def test_a_row_is_computed_alone():
    """Each row's result is the same beside other rows as alone (the programs run the rows one after another)."""
    args = _inputs(SHAPES["ragged"], torch.float32, "v3", seed=3)
    together = absorbed_query_key(*_on(*args))[0].cpu()
    alone = absorbed_query_key(*_on(args[0][2:3], args[1], args[2], args[3][2:3], args[4][2:3], args[5][2:3],
                                    args[6][2:3], args[7][2:3], *args[8:]))[0].cpu()
    assert torch.equal(together[2:3], alone)


@pytest.mark.parametrize("loc_dtype", [torch.int64, torch.int32])
def test_the_key_rows_go_into_a_latent_pool_at_the_steps_slots(loc_dtype):
    """With a latent pool's layer and the step's slots, the key rows are stored there (the KV store in the query's
    launch), equal to the rows the plain launch returns, every other slot untouched; the query the same."""
    args = _inputs(SHAPES["ragged"], torch.bfloat16, "v2", seed=5)
    n, width = args[0].shape[0], args[4].shape[1] + args[5].shape[1]
    pool = torch.randn(32, 1, width).to(torch.bfloat16)
    before = pool.clone()
    loc = torch.tensor([9, 3, 30, 17, 4], dtype=loc_dtype)[:n]
    query, key = (t.cpu() for t in absorbed_query_key(*_on(*args)))
    pool_d = pool.to(DEVICE)
    query2, none = absorbed_query_key(*_on(*args), cache=pool_d, loc=loc.to(DEVICE))
    assert none is None and torch.equal(query2.cpu(), query)
    pool = pool_d.cpu()
    assert torch.equal(pool[loc.long()], key)
    others = torch.ones(32, dtype=torch.bool)
    others[loc.long()] = False
    assert torch.equal(pool[others], before[others])
    with pytest.raises(ValueError, match="a latent cache for absorbed_query_key"):
        absorbed_query_key(*args, cache=torch.zeros(32, 1, width + 1, dtype=torch.bfloat16), loc=loc)


def test_bad_inputs_are_refused():
    args = list(_inputs(SHAPES["ragged"], torch.float32, "v3", seed=4))
    many = [torch.zeros((MAX_ROWS + 1,) + t.shape[1:]) if isinstance(t, torch.Tensor) and i != 1 else t
            for i, t in enumerate(args)]
    with pytest.raises(ValueError, match="absorbed_query_key takes"):
        absorbed_query_key(*many)
    with pytest.raises(ValueError, match="kv_b_proj's weight"):
        absorbed_query_key(args[0], args[1][:-1], *args[2:])
    with pytest.raises(ValueError, match="absorbed_values takes"):
        absorbed_values(torch.zeros(2, 3, 80, dtype=torch.bfloat16), args[1], 24, 18)
