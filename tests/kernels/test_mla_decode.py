"""kernels.mla_decode (decode attention over a latent KV cache: DeepSeek's multi-head latent attention) against its
plain-torch twin: head counts under, at and over a program's 16-head block, one and several splits (the shared stage
2 merging them), ragged lengths that leave splits empty, 16-bit and fp8 latents with a scale, draft trees' masks. In
Triton's
interpreter on CPU with a small latent (32 + 8); on CUDA with DeepSeek-V3's (512 + 64, 128 heads and 16)."""

from __future__ import annotations

import pytest
import torch

from radixmesh.kernels.mla_decode import latent_decode, latent_decode_reference
from tests.kernels.test_attention import Pool, _check

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _case(lens, heads, rank, rope, page, dtype, splits, kv_dtype=None, kv_scale=1.0, seed=0, tree=None):
    pool = Pool(lens, 1, rank + rope, page, torch.float32, DEVICE, seed)
    kv = pool.k.to(kv_dtype or dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    q = (torch.randn(len(lens), heads, rank + rope, generator=gen) * 0.3).to(dtype).to(DEVICE)
    seq_lens = torch.tensor(lens, device=DEVICE)
    scale = (rank + rope) ** -0.5
    tree = None if tree is None else torch.tensor(tree, dtype=torch.int64, device=DEVICE)
    out = latent_decode(q, kv, rank, pool.req_to_token, pool.rows, seq_lens, scale, splits, kv_scale=kv_scale,
                        tree=tree)
    want = latent_decode_reference(q, kv, rank, pool.req_to_token, pool.rows, seq_lens, scale, kv_scale=kv_scale,
                                   tree=tree)
    assert out.shape == (len(lens), heads, rank) and out.dtype == dtype
    _check(out, want, dtype)
    return out


@pytest.mark.parametrize("heads", [4, 16, 40])  # one block part-filled, one full, three (the last part-filled)
@pytest.mark.parametrize("splits", [1, 3])
def test_heads_and_splits(heads, splits):
    _case([37, 5, 70], heads, 32, 8, 4, torch.float32, splits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sixteen_bit_latents(dtype):
    _case([23, 64], 16, 32, 8, 16, dtype, 2)


def test_short_requests_leave_trailing_splits_empty():
    """Lengths under a split's block: most splits hold no key, and stage 2 merges only the ones the length fills."""
    _case([1, 2, 40], 8, 32, 8, 1, torch.float32, 8)


@pytest.mark.parametrize("splits", [1, 3])
def test_draft_tree_rows_see_the_keys_their_bits_show(splits):
    """Tree verify rows (engine.speculative.tree): past its span's start a row sees only the keys whose bits are
    set (its ancestors and itself). The first row (70 keys, three splits of 32) sees keys 0-31 and 64-69 only: its
    middle split sees none and merges as nothing (not NaN); the last row's span starts past its keys."""
    lens = [70, 12, 9]
    tree = [[32, 8, 9], [0b111111 << 32, 0b1111, 0]]
    out = _case(lens, 16, 32, 8, 4, torch.float32, splits, tree=tree)
    assert not out.isnan().any()
    plain = _case(lens, 16, 32, 8, 4, torch.float32, splits)
    assert not torch.allclose(out[0], plain[0]) and torch.equal(out[2], plain[2])


def test_an_fp8_latent_reads_back_times_its_scale():
    _case([30, 9], 16, 32, 8, 4, torch.bfloat16, 2, kv_dtype=torch.float8_e4m3fn, kv_scale=0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("bs,ctx,heads", [(1, 512, 128), (64, 2048, 16), (256, 1024, 128)])
def test_deepseek_v3_latent_cuda(bs, ctx, heads):
    lens = [ctx - 17 * (i % 5) for i in range(bs)]
    _case(lens, heads, 512, 64, 64, torch.bfloat16, 4 if bs == 1 else 2)
