"""The mixture-of-experts kernels (kernels.moe) against their plain-torch twin: slots grouped by expert and padded to
whole blocks (every slot exactly once), and the two grouped GEMMs with SiLU-and-mul and the routing weights, for
several expert counts, top-k, token counts (one token, experts no token picks) and dtypes. In Triton's interpreter
without CUDA, on the GPU with it."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.layers.moe import route
from radixmesh.kernels.moe import BLOCK_M, align_by_expert, fused_experts, fused_experts_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _routing(tokens: int, experts: int, top_k: int, seed: int, used: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen)
    if used is not None:  # only the first `used` experts can win: the others get no token
        logits[:, used:] = -1e4
    return logits


def test_align_by_expert_groups_every_slot_once_in_whole_blocks():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2], [2, 0]])
    slots, block_experts = align_by_expert(ids, num_experts=5, block_m=4)
    n = ids.numel()
    assert slots.numel() % 4 == 0 and block_experts.numel() == slots.numel() // 4
    real = slots[slots < n]
    assert sorted(real.tolist()) == list(range(n))  # every slot once
    flat = ids.flatten()
    for b, e in enumerate(block_experts.tolist()):
        rows = slots[b * 4:(b + 1) * 4]
        rows = rows[rows < n]
        if e < 0:
            assert rows.numel() == 0
        else:
            assert (flat[rows] == e).all()  # one expert per block
    assert set(block_experts.tolist()) - {-1} == {0, 2, 3}  # expert 1 and 4 get no block
    for e in (0, 2, 3):  # within an expert, slots keep their order
        mine = [s for s in slots.tolist() if s < n and flat[s] == e]
        assert mine == sorted(mine)


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,used", [
    (1, 4, 2, 32, 48, None), (7, 8, 2, 64, 32, None), (33, 6, 3, 48, 80, 4), (20, 4, 1, 32, 16, None),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fused_experts_match_the_twin(tokens, experts, top_k, hidden, inter, used, dtype):
    gen = torch.Generator().manual_seed(tokens * 100 + experts)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(dtype)
    weights, ids = route(_routing(tokens, experts, top_k, seed=tokens, used=used), top_k, True, dtype)
    want = fused_experts_reference(x, w13, w2, weights, ids)
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    got = fused_experts(*args).cpu()
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # the twin adds the top_k rows one at a time in bfloat16; the kernel sums them in float32
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_float32_routing_weights_weigh_as_mixtral_does():
    """Mixtral's weights stay float32: the bf16 down-projection times a float32 weight, rounded once."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 32, generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(4, 64, 32, generator=gen) * 0.2).to(torch.bfloat16)
    w2 = (torch.randn(4, 32, 32, generator=gen) * 0.2).to(torch.bfloat16)
    weights, ids = route(_routing(9, 4, 2, seed=3), 2, True, None)
    assert weights.dtype == torch.float32
    want = fused_experts_reference(x, w13, w2, weights, ids)
    got = fused_experts(*[t.to(DEVICE) for t in (x, w13, w2, weights, ids)]).cpu()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_block_size_is_what_align_pads_to():
    _, block_experts = align_by_expert(torch.zeros(3, 1, dtype=torch.int64), 2)
    assert block_experts.tolist()[0] == 0 and BLOCK_M >= 16  # tl.dot needs 16 rows or more


def test_slots_of_another_ranks_experts_add_nothing():
    """Expert parallelism: ids of -1 (experts another rank holds) are skipped by both the kernel and the twin."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(10, 32, generator=gen)
    w13 = torch.randn(3, 32, 32, generator=gen) * 0.2
    w2 = torch.randn(3, 32, 16, generator=gen) * 0.2
    weights, ids = route(_routing(10, 6, 2, seed=4), 2, True, torch.float32)
    local = torch.where(ids >= 3, ids - 3, -1)  # this rank holds experts 3..5
    want = fused_experts_reference(x, w13, w2, weights, local)
    got = fused_experts(*[t.to(DEVICE) for t in (x, w13, w2, weights, local)]).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (want[(local < 0).all(dim=1)] == 0).all()  # a token with no local expert gets nothing here
