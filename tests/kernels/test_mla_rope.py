"""kernels.mla_rope: DeepSeek's query and key rows (the absorbed query and the normed latent beside their rotated rope
parts) in one launch, equal bit for bit to the engine's torch path (engine.layers.rotary.apply_rotary and two
concatenations) and to the kernel's twin, for each RoPE DeepSeek-style models use: V2's interleaved pairs in float32
from a float32 table, V3's in the model dtype, rotate-half (GLM-4.7-Flash without rope_interleave); strided rope parts
as the projections leave them. In Triton's interpreter without CUDA."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.layers.rotary import apply_rotary
from radixmesh.kernels.mla_rope import mla_query_key, mla_query_key_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROPES = {"v2": (True, True, torch.float32), "v3": (True, False, None), "half": (False, True, None),
         "half-f32-table": (False, True, torch.float32)}


def _engine_path(q_latent, q_pe, latent, k_pe, cos, sin, interleaved, upcast):
    """engine.models.deepseek's lines, as they were before the kernel."""
    q_pe, k_pe = apply_rotary(q_pe, k_pe[:, None, :], cos, sin, interleaved, upcast)
    key = torch.cat([latent, k_pe[:, 0].to(latent.dtype)], dim=-1)[:, None, :]
    return torch.cat([q_latent, q_pe.to(q_latent.dtype)], dim=-1), key


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("n, heads", [(1, 16), (5, 3)], ids=["one-token", "odd-heads"])
def test_query_and_key_equal_the_engine_path_bit_for_bit(rope, dtype, n, heads):
    interleaved, upcast, table = ROPES[rope]
    rank, nope, dim = 64, 24, 16
    gen = torch.Generator().manual_seed(n * 7 + heads)
    q = (torch.randn(n, heads, nope + dim, generator=gen) * 3).to(dtype)  # q_proj's rows: nope then rope
    kv = (torch.randn(n, rank + dim, generator=gen) * 3).to(dtype)  # kv_a's rows: the latent then the rope part
    q_latent = torch.randn(n, heads, rank, generator=gen).to(dtype)
    latent = kv[:, :rank].contiguous()
    angle = torch.rand(n, 1, dim, generator=gen) * 40
    if interleaved:
        angle = angle[..., ::2].repeat_interleave(2, dim=-1)
    else:
        angle = torch.cat([angle[..., :dim // 2]] * 2, dim=-1)
    cos, sin = (f(angle).to(table or dtype) for f in (torch.cos, torch.sin))
    args = (q_latent, q[..., nope:], latent, kv[:, rank:], cos, sin, interleaved, upcast)
    on = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in args]
    query, key = (t.cpu() for t in mla_query_key(*on))
    want_q, want_k = _engine_path(*args)
    assert query.dtype == key.dtype == dtype and query.shape == (n, heads, rank + dim) and key.shape == (n, 1, rank + dim)
    assert torch.equal(query, want_q) and torch.equal(key, want_k)
    assert all(torch.equal(a, b) for a, b in zip(mla_query_key_reference(*args), (want_q, want_k)))


def test_shapes_are_checked():
    q_latent, latent = torch.zeros(2, 4, 64), torch.zeros(2, 64)
    cos = torch.zeros(2, 1, 16)
    with pytest.raises(ValueError, match="mla_query_key takes"):
        mla_query_key(q_latent, torch.zeros(2, 4, 15), latent, torch.zeros(2, 15), cos, cos, True, True)
    with pytest.raises(ValueError, match="mla_query_key takes"):
        mla_query_key(q_latent, torch.zeros(2, 4, 16), torch.zeros(3, 64), torch.zeros(2, 16), cos, cos, True, True)
