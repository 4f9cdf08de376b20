"""The Triton attention kernels over an fp8 cache with per-layer K and V scales (engine.quantization.kv_scales)
against their plain-torch twins: the cache means stored * scale, in decode (one split and several) and in the prefix
part of extend (the new tokens are unscaled), with sliding windows and soft-capped scores too. The twins are checked
first against the cache dequantized by hand, so a kernel that skipped a scale could not match them."""

from __future__ import annotations

import pytest
import torch

from radixmesh.kernels.decode_attention import decode_attention, decode_attention_reference
from radixmesh.kernels.extend_attention import extend_attention, extend_attention_reference
from tests.kernels.test_attention import DEVICES, Pool, _check

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
SCALES = [(0.37, 5.5), (3.0, 1.0), (1.0, 0.02)]  # (k_scale, v_scale): both, keys only, values only


def _fp8_pool(lens, kv_heads, head_dim, dtype, kv_dtype, device, seed) -> Pool:
    pool = Pool(lens, kv_heads, head_dim, 16, dtype, device, seed)
    pool.k, pool.v = pool.k.to(kv_dtype), pool.v.to(kv_dtype)
    return pool


def _decode(lens, dtype, kv_dtype, device, scales, splits, window=None, softcap=None, seed=0):
    heads, kv_heads, head_dim = 8, 2, 64
    k_scale, v_scale = scales
    pool = _fp8_pool(lens, kv_heads, head_dim, dtype, kv_dtype, device, seed)
    q = torch.randn((len(lens), heads, head_dim), generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    q, seq_lens = q.to(device), torch.tensor(lens, device=device)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, pool.k, pool.v, pool.req_to_token, pool.rows, seq_lens, head_dim ** -0.5, splits, out=out,
                     window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale)
    cpu = (q.cpu(), pool.k.cpu(), pool.v.cpu(), pool.req_to_token.cpu(), pool.rows.cpu(), seq_lens.cpu(),
           head_dim ** -0.5)
    ref = decode_attention_reference(*cpu, window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale)
    by_hand = decode_attention_reference(cpu[0], cpu[1].float() * k_scale, cpu[2].float() * v_scale, *cpu[3:],
                                         window=window, softcap=softcap)
    assert torch.allclose(ref.float(), by_hand.float(), rtol=1e-5, atol=1e-6)
    _check(out.cpu(), ref, dtype)


def _extend(prefixes, extends, dtype, kv_dtype, device, scales, window=None, softcap=None, seed=0):
    heads, kv_heads, head_dim = 8, 2, 64
    k_scale, v_scale = scales
    pool = _fp8_pool([p + e for p, e in zip(prefixes, extends)], kv_heads, head_dim, dtype, kv_dtype, device, seed)
    gen, n = torch.Generator().manual_seed(seed + 1), sum(extends)
    q, k_new, v_new = (torch.randn((n, h, head_dim), generator=gen).to(dtype).to(device)
                       for h in (heads, kv_heads, kv_heads))
    v_new = v_new * v_scale  # new values on the cache's scale, so both parts of the sum count
    ext = torch.tensor(extends, device=device)
    args = (q, k_new, v_new, pool.k, pool.v, pool.req_to_token, pool.rows, torch.tensor(prefixes, device=device),
            ext, ext.cumsum(0) - ext)
    out = torch.full_like(q, float("nan"))
    extend_attention(*args, max(extends), head_dim ** -0.5, out=out, window=window, softcap=softcap,
                     k_scale=k_scale, v_scale=v_scale)
    cpu = [a.cpu() for a in args]
    ref = extend_attention_reference(*cpu, head_dim ** -0.5, window=window, softcap=softcap, k_scale=k_scale,
                                     v_scale=v_scale)
    cpu[3], cpu[4] = cpu[3].float() * k_scale, cpu[4].float() * v_scale
    by_hand = extend_attention_reference(*cpu, head_dim ** -0.5, window=window, softcap=softcap)
    assert torch.allclose(ref.float(), by_hand.float(), rtol=1e-5, atol=1e-6)
    _check(out.cpu(), ref, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scales", SCALES, ids=["both", "keys", "values"])
@pytest.mark.parametrize("kv", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_reads_a_scaled_fp8_cache(device, scales, kv, dtype):
    _decode([5, 40, 17], DTYPES[dtype], FP8[kv], device, scales, splits=1)
    _decode([5, 40, 17], DTYPES[dtype], FP8[kv], device, scales, splits=3, seed=1)  # partial sums merged


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scales", SCALES, ids=["both", "keys", "values"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_reads_a_scaled_fp8_prefix(device, scales, dtype):
    _extend([0, 30, 9], [12, 5, 20], DTYPES[dtype], torch.float8_e4m3fn, device, scales)


@pytest.mark.parametrize("device", DEVICES)
def test_scales_with_windows_and_soft_capped_scores(device):
    """The key scale folds into the score scale before the cap (the cap sees q . k * scale * k_scale)."""
    for window, softcap in ((7, None), (None, 2.0), (9, 1.5)):
        _decode([5, 40, 17], torch.float32, torch.float8_e4m3fn, device, (2.5, 0.3), splits=3, window=window,
                softcap=softcap)
        _extend([0, 30, 9], [12, 5, 20], torch.float32, torch.float8_e5m2, device, (2.5, 0.3), window=window,
                softcap=softcap)
