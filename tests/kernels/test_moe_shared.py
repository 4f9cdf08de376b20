"""kernels.moe_shared.gated_shared_add (Qwen2-MoE's gated shared expert joined to the routed output in one launch)
against its twin (the torch ops it replaces), and the twin against the engine's torch path. In Triton's interpreter
without CUDA, on the GPU with it."""

from __future__ import annotations

import pytest
import torch

from radixmesh.kernels.moe_shared import gated_shared_add, gated_shared_add_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(tokens: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + tokens * 7 + hidden)
    routed, shared, x = (torch.randn(tokens, hidden, generator=gen).to(dtype) for _ in range(3))
    gate = (torch.randn(1, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    return routed, shared, x, gate


@pytest.mark.parametrize("tokens,hidden", [(1, 64), (3, 96), (5, 2048), (2, 3584)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_gated_shared_add_matches_the_twin(tokens, hidden, dtype):
    """Each token's gate, its sigmoid, the scaled shared row and the sum, every step rounded as torch rounds it: in
    float32 within 1e-5; in bfloat16 nearly every element equal (the gate's float32 dot may round to the neighbour
    of the twin's), none off by more than a few ulps. Widths that leave masked lanes (96, 3584: Qwen2-57B-A14B)."""
    routed, shared, x, gate = _inputs(tokens, hidden, dtype)
    want = gated_shared_add_reference(routed, shared, x, gate)
    got = gated_shared_add(*(t.to(DEVICE) for t in (routed, shared, x, gate))).cpu()
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert (got != want).float().mean().item() <= 0.02
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=4e-2)
    assert not torch.allclose(want.float(), routed.float() + shared.float(), atol=0.1)  # the gate did something


def test_the_twin_is_the_engines_torch_path():
    """The twin is what engine.models.moe computes without the kernel: routed + sigmoid(linear(x, gate)) * shared,
    bit for bit in bfloat16 (a one-row product rounds its float32 sum once, as the twin's does)."""
    from radixmesh.engine.layers.linear import linear

    routed, shared, x, gate = _inputs(1, 64, torch.bfloat16, seed=3)
    engine = routed + torch.sigmoid(linear(x, gate)) * shared
    assert torch.equal(gated_shared_add_reference(routed, shared, x, gate), engine)


def test_inputs_that_do_not_fit_are_refused():
    routed, shared, x, gate = _inputs(2, 64, torch.float32)
    with pytest.raises(ValueError, match="gated_shared_add"):
        gated_shared_add(routed, shared[:1], x, gate)
    with pytest.raises(ValueError, match="gated_shared_add"):
        gated_shared_add(routed, shared, x, gate.to(torch.bfloat16))
    with pytest.raises(ValueError, match="gated_shared_add"):
        gated_shared_add(routed, shared, x, gate[:, :32])
    assert gated_shared_add(routed[:0], shared[:0], x[:0], gate).shape == (0, 64)
