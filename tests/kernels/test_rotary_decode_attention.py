"""Decode attention that rotates q itself and stores the step's keys and values (kernels.decode_attention with a
RopeStore: the rotary kernel's work folded into stage 1) against the twins of the kernels it replaces, one after the
other: kernels.rotary's rotation (with Qwen3's q/k norm), the KV store, then decode attention."""

from __future__ import annotations

import pytest
import torch

from radixmesh.kernels.decode_attention import RopeStore, decode_attention, decode_attention_reference, rope_fits
from radixmesh.kernels.rotary import QKNorm, rotary_store_kv_reference
from tests.kernels.test_attention import Pool, _check

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tables(max_pos: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("lens,heads,kv_heads,head_dim,dtype,norm,splits,window", [
    ([5, 40, 17], 8, 2, 64, torch.float32, True, 3, None),  # Qwen3's q/k norm; a split count past short lengths
    ([33, 1], 28, 4, 32, torch.float32, False, 1, None),  # a group of 7 (Qwen2-7B's ratio); one split
    ([70, 9], 4, 2, 64, torch.bfloat16, True, 2, 24),  # a sliding window
])
def test_rotating_in_stage_one_equals_rotary_then_store_then_attention(lens, heads, kv_heads, head_dim, dtype, norm,
                                                                       splits, window):
    pool = Pool(lens, kv_heads, head_dim, page=4, dtype=dtype, device=DEVICE, seed=len(lens) + heads)
    gen = torch.Generator().manual_seed(7)
    bsz = len(lens)
    # the step's q, k, v as strided views of one qkv row per request, as the model's split of its product gives
    qkv = torch.randn(bsz, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = (t.view(bsz, -1, head_dim) for t in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                              kv_heads * head_dim], dim=-1))
    seq_lens = torch.tensor(lens, device=DEVICE)
    table = pool.req_to_token.clone()
    loc = torch.stack([table[pool.rows[i], n - 1] for i, n in enumerate(lens)])  # each new token's slot
    positions = seq_lens - 1
    cos, sin = (t.to(DEVICE) for t in _tables(128, head_dim))
    qk_norm = QKNorm(*(1 + 0.2 * torch.randn(2, head_dim, generator=gen)).to(dtype).to(DEVICE), 1e-6) if norm \
        else None
    k_ref, v_ref = pool.k.clone(), pool.v.clone()
    q_rot = rotary_store_kv_reference(q, k, v, cos, sin, positions, k_ref, v_ref, loc, qk_norm)
    want = decode_attention_reference(q_rot, k_ref, v_ref, table, pool.rows, seq_lens, head_dim ** -0.5,
                                      window=window)
    assert rope_fits(q, pool.k, None)
    got = decode_attention(q, pool.k, pool.v, table, pool.rows, seq_lens, head_dim ** -0.5, splits, window=window,
                           rope=RopeStore(k, v, loc, cos, sin, positions, qk_norm))
    _check(got, want, dtype)
    # the new keys and values are in the pool as the rotary kernel's store leaves them (the norm's sum of squares
    # runs in another order than the twin's, so a normed key may round to its neighbour)
    torch.testing.assert_close(pool.k[loc].float(), k_ref[loc].float(), rtol=2e-2 if norm else 0,
                               atol=2e-2 if norm else 0)
    assert torch.equal(pool.v[loc], v_ref[loc])
    untouched = torch.ones(pool.k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert torch.equal(pool.k[untouched], k_ref[untouched]) and torch.equal(pool.v[untouched], v_ref[untouched])


def test_what_it_cannot_rotate_is_refused():
    """A head_dim off a power of two, a pool of another dtype (fp8), or a draft tree: rope_fits says no, and
    decode_attention refuses rather than computing it wrong."""
    q = torch.zeros(1, 2, 48)
    assert not rope_fits(q, torch.zeros(4, 1, 48), None)
    assert not rope_fits(torch.zeros(1, 2, 64), torch.zeros(4, 1, 64, dtype=torch.float8_e4m3fn), None)
    assert not rope_fits(torch.zeros(1, 2, 64), torch.zeros(4, 1, 64), torch.zeros(2, 1, dtype=torch.int64))
    cos = torch.zeros(8, 48)
    rope = RopeStore(torch.zeros(1, 1, 48), torch.zeros(1, 1, 48), torch.zeros(1, dtype=torch.int64), cos, cos,
                     torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        decode_attention(q, torch.zeros(4, 1, 48), torch.zeros(4, 1, 48), torch.zeros(1, 4, dtype=torch.int64),
                         torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 1.0, 1, rope=rope)
