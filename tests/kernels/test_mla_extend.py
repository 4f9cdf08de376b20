"""kernels.mla_extend (prefill over a latent KV cache: DeepSeek's multi-head latent attention) against its plain-torch
twin: ragged prefixes and extends (none, one token, several blocks), 16-bit latents, an fp8 prefix with its scale.
In Triton's interpreter on CPU with a small latent (32 + 8); on CUDA with DeepSeek-V2-Lite's (512 + 64, 16 heads)."""

from __future__ import annotations

import pytest
import torch

from radixmesh.kernels.mla_extend import latent_extend, latent_extend_reference
from tests.kernels.test_attention import Pool, _check

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(prefixes, extends, heads, rank, rope, page, dtype, kv_dtype=None, kv_scale=1.0, seed=0):
    pool = Pool([p + e for p, e in zip(prefixes, extends)], 1, rank + rope, page, torch.float32, DEVICE, seed)
    kv = pool.k.to(kv_dtype or dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    n = sum(extends)
    q = (torch.randn(n, heads, rank + rope, generator=gen) * 0.3).to(dtype).to(DEVICE)
    kv_new = torch.randn(n, 1, rank + rope, generator=gen).to(dtype).to(DEVICE)
    ext = torch.tensor(extends, device=DEVICE)
    args = (q, kv_new, kv, rank, pool.req_to_token, pool.rows, torch.tensor(prefixes, device=DEVICE), ext,
            ext.cumsum(0) - ext)
    scale = (rank + rope) ** -0.5
    out = latent_extend(*args, max(extends), scale, kv_scale=kv_scale)
    want = latent_extend_reference(*args, scale, kv_scale=kv_scale)
    assert out.shape == (n, heads, rank)
    _check(out, want, dtype)


@pytest.mark.parametrize("heads", [1, 3])
def test_ragged_prefixes_and_extends(heads):
    _case([0, 10, 33, 0], [7, 1, 40, 19], heads, 32, 8, 4, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sixteen_bit_latents(dtype):
    _case([21, 0], [18, 35], 2, 32, 8, 16, dtype, seed=3)


def test_an_fp8_prefix_reads_back_times_its_scale():
    _case([30, 12], [9, 20], 2, 32, 8, 4, torch.bfloat16, kv_dtype=torch.float8_e4m3fn, kv_scale=0.5)


@pytest.mark.gpu
def test_deepseek_v2_lite_latent_cuda():
    _case([0, 700, 2000], [1024, 300, 48], 16, 512, 64, 64, torch.bfloat16)
