"""The mixture-of-experts kernels (kernels.moe) against their plain-torch twin: slots grouped by expert and padded to
whole blocks (every slot exactly once), and the two grouped GEMMs with SiLU-and-mul and the routing weights, for
several expert counts, top-k, token counts (one token, experts no token picks) and dtypes. In Triton's interpreter
without CUDA, on the GPU with it."""

from __future__ import annotations

import pytest
import torch

from radixmesh.kernels.moe import (BLOCK_M, align_by_expert, align_by_expert_reference, fused_experts,
                                   fused_experts_reference, route, route_grouped, route_grouped_reference,
                                   route_reference)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _routing(tokens: int, experts: int, top_k: int, seed: int, used: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen)
    if used is not None:  # only the first `used` experts can win: the others get no token
        logits[:, used:] = -1e4
    return logits


@pytest.mark.parametrize("align", [align_by_expert, align_by_expert_reference], ids=["kernel", "twin"])
def test_align_by_expert_groups_every_slot_once_in_whole_blocks(align):
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2], [2, 0]], device=DEVICE)
    slots, block_experts = align(ids, num_experts=5, block_m=4)
    slots, block_experts, ids = slots.cpu(), block_experts.cpu(), ids.cpu()
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
    if align is align_by_expert_reference:  # the kernel places a group's slots in any order (atomic cursors)
        for e in (0, 2, 3):
            mine = [s for s in slots.tolist() if s < n and flat[s] == e]
            assert mine == sorted(mine)


@pytest.mark.parametrize("tokens,experts,top_k,block_m,other_ranks", [
    (1, 128, 8, 16, False), (64, 128, 8, 16, False), (300, 60, 4, 16, True), (3000, 8, 2, 16, False),
    (5, 3, 2, 4, True)])
def test_the_align_kernel_makes_the_twins_groups(tokens, experts, top_k, block_m, other_ranks):
    """Same blocks, same expert per block, the same slots in each block (in any order), the same padding; ids of -1
    (experts of other ranks, under expert parallelism) in no block that runs. Chunks of 1024 slots and of blocks
    are crossed by the larger cases."""
    gen = torch.Generator().manual_seed(tokens + experts)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    if other_ranks:
        ids = torch.where(ids >= experts // 2, -1, ids)
    slots, block_experts = align_by_expert(ids.to(DEVICE), experts, block_m)
    want_slots, want_experts = align_by_expert_reference(ids, experts, block_m)
    assert torch.equal(block_experts.cpu(), want_experts)
    got, want = slots.cpu().view(-1, block_m), want_slots.view(-1, block_m)
    for group in sorted(set(want_experts.tolist())):  # a group's slots may fill its blocks in any order
        mine = want_experts == group
        assert torch.equal(got[mine].flatten().sort().values, want[mine].flatten().sort().values), group


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,used", [
    (1, 4, 2, 32, 48, None), (7, 8, 2, 64, 32, None), (33, 6, 3, 48, 80, 4), (20, 4, 1, 32, 16, None),
    (40, 4, 2, 32, 16, None), (130, 4, 2, 32, 48, None),  # untuned shapes' 32- and 64-row blocks (default_tiles)
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fused_experts_match_the_twin(tokens, experts, top_k, hidden, inter, used, dtype):
    gen = torch.Generator().manual_seed(tokens * 100 + experts)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(dtype)
    weights, ids = route_reference(_routing(tokens, experts, top_k, seed=tokens, used=used), top_k, True, dtype)
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
    weights, ids = route_reference(_routing(9, 4, 2, seed=3), 2, True, None)
    assert weights.dtype == torch.float32
    want = fused_experts_reference(x, w13, w2, weights, ids)
    got = fused_experts(*[t.to(DEVICE) for t in (x, w13, w2, weights, ids)]).cpu()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_block_size_is_what_align_pads_to():
    _, block_experts = align_by_expert(torch.zeros(3, 1, dtype=torch.int64, device=DEVICE), 2)
    assert block_experts.tolist()[0] == 0 and BLOCK_M >= 16  # tl.dot needs 16 rows or more


def test_slots_of_another_ranks_experts_add_nothing():
    """Expert parallelism: ids of -1 (experts another rank holds) are skipped by both the kernel and the twin."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(10, 32, generator=gen)
    w13 = torch.randn(3, 32, 32, generator=gen) * 0.2
    w2 = torch.randn(3, 32, 16, generator=gen) * 0.2
    weights, ids = route_reference(_routing(10, 6, 2, seed=4), 2, True, torch.float32)
    local = torch.where(ids >= 3, ids - 3, -1)  # this rank holds experts 3..5
    want = fused_experts_reference(x, w13, w2, weights, local)
    got = fused_experts(*[t.to(DEVICE) for t in (x, w13, w2, weights, local)]).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (want[(local < 0).all(dim=1)] == 0).all()  # a token with no local expert gets nothing here


@pytest.mark.parametrize("tokens,experts,top_k,renormalize,dtype", [
    (1, 128, 8, True, torch.bfloat16), (64, 128, 8, False, torch.bfloat16), (9, 8, 2, True, None),
    (33, 60, 4, False, torch.float32), (5, 6, 3, True, torch.float32), (3, 256, 8, True, torch.bfloat16)])
def test_the_route_kernel_picks_the_twins_experts_and_weights(tokens, experts, top_k, renormalize, dtype):
    """One launch for softmax, top-k, renormalization and the cast: the same experts in the same order (largest
    first), weights within float32 rounding of the twin's (a ulp of the dtype at most after the cast)."""
    logits = _routing(tokens, experts, top_k, seed=experts + top_k) * 3
    want_w, want_i = route_reference(logits, top_k, renormalize, dtype)
    got_w, got_i = route(logits.to(DEVICE), top_k, renormalize, dtype)
    assert got_w.dtype == want_w.dtype and got_i.dtype == torch.int64
    assert torch.equal(got_i.cpu(), want_i)
    tol = 1e-6 if want_w.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_w.cpu().float(), want_w.float(), rtol=tol, atol=tol)


def test_the_route_kernel_takes_the_lowest_expert_first_among_equals():
    """Logits with many equal values: the kernel's order is by probability, then expert id (torch.topk's order among
    equals is its own), the same on every rank and in the few-token path's folded routing."""
    logits = torch.randint(-2, 3, (16, 60), generator=torch.Generator().manual_seed(1)).float()
    weights, ids = route(logits.to(DEVICE), 4, True, torch.float32)
    probs = torch.softmax(logits, dim=-1)
    for t in range(logits.shape[0]):
        assert ids[t].tolist() == sorted(range(60), key=lambda e: (-probs[t, e].item(), e))[:4]
    picked = probs.gather(1, ids.cpu())
    torch.testing.assert_close(weights.cpu(), picked / picked.sum(1, keepdim=True), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tokens,experts,top_k,groups,top_groups,renormalize,scale,softmax,norm_min,group_best", [
    (1, 128, 8, 1, 1, True, 1.0, False, 0.0, 2),  # GLM-4.5-Air: one group
    (7, 160, 8, 1, 1, True, 2.5, False, 0.0, 2),  # GLM-4.5: 160 experts (not a power of two), scaled
    (3, 256, 8, 8, 4, True, 2.5, False, 0.0, 2),  # DeepSeek-V3's shape of the rule
    (33, 8, 3, 2, 1, True, 2.5, False, 0.0, 2), (5, 64, 6, 4, 2, False, 1.0, False, 0.0, 2),
    (2, 6, 2, 3, 3, False, 1.0, False, 0.0, 2),
    (9, 64, 6, 1, 1, True, 1.0, True, 1e-12, 2),  # ERNIE 4.5: softmax scores, the sum clamped below
    (4, 8, 2, 1, 1, True, 1.0, True, 0.9, 2),  # (a clamp that bites: two softmax scores of eight sum under 0.9)
    # DeepSeek-V2's group_limited_greedy (a group scores its best expert; no bias: zeros below), and V2-Lite's greedy
    (3, 160, 6, 8, 3, False, 16.0, True, 0.0, 1), (5, 12, 3, 4, 2, False, 1.0, True, 0.0, 1),
    (2, 64, 6, 1, 1, False, 1.0, True, 0.0, 1)])
def test_the_grouped_route_kernel_picks_the_twins_experts_and_weights(tokens, experts, top_k, groups, top_groups,
                                                                      renormalize, scale, softmax, norm_min,
                                                                      group_best):
    """Routing by scores plus a choice bias in one launch (GLM-4.5, DeepSeek-V3; ERNIE 4.5 and DeepSeek-V2 by
    softmax): the same experts in the same order as the twin (largest choice first), float32 weights within float32
    rounding."""
    gen = torch.Generator().manual_seed(experts + top_k)
    logits = torch.randn(tokens, experts, generator=gen) * 2
    bias = torch.randn(experts, generator=gen) * (0.05 if softmax else 0.5)
    if group_best == 1:  # (DeepSeek-V2 routes without a bias)
        bias = torch.zeros(experts)
    args = (top_k, groups, top_groups, renormalize, scale, softmax, norm_min, group_best)
    want_w, want_i = route_grouped_reference(logits, bias, *args)
    got_w, got_i = route_grouped(logits.to(DEVICE), bias.to(DEVICE), *args)
    assert got_w.dtype == torch.float32 and got_i.dtype == torch.int64
    assert torch.equal(got_i.cpu(), want_i)
    torch.testing.assert_close(got_w.cpu(), want_w, rtol=1e-6, atol=1e-6)
    if groups > 1:  # every token's experts lie in top_groups groups
        assert all(len({e // (experts // groups) for e in row}) <= top_groups for row in got_i.tolist())


def test_grouped_routing_that_cannot_fill_its_top_k_is_refused():
    for experts, top_k, groups, top_groups in [(8, 3, 3, 1), (8, 5, 2, 1), (8, 2, 8, 1), (8, 2, 2, 3)]:
        with pytest.raises(ValueError, match="group-limited routing"):
            route_grouped_reference(torch.zeros(1, experts), torch.zeros(experts), top_k, groups, top_groups, True,
                                    1.0)


def test_tuned_tiles_are_picked_at_the_nearest_token_count_at_or_above():
    from radixmesh.kernels.moe import Tiles, pick

    entry = lambda bm, n: {"block_m": bm, "up": Tiles(block_n=n)._asdict(), "down": Tiles(block_k=n)._asdict()}  # noqa: E731
    entries = {"1": entry(16, 64), "64": entry(16, 128), "2048": entry(64, 128)}
    assert pick(entries, 1) == (16, Tiles(block_n=64), Tiles(block_k=64))
    assert pick(entries, 2)[0:2] == (16, Tiles(block_n=128))
    assert pick(entries, 65)[0] == 64 and pick(entries, 100000)[0] == 64  # past the largest: the largest


def test_untuned_shapes_take_larger_blocks_as_experts_get_more_slots():
    """A shape tuned nowhere: 16-row blocks for a few slots an expert, 32 from 16 slots, 64 from 64 (what the tuner
    chose for Qwen3-30B-A3B's layer at like counts), on CPU too (no tuned file applies there)."""
    from radixmesh.kernels.moe import BLOCK_M, Tiles, default_tiles, tiles

    assert default_tiles(4) == (BLOCK_M, Tiles(), Tiles())
    assert default_tiles(16)[0] == 32 and default_tiles(63.9)[0] == 32
    assert default_tiles(64) == (64, Tiles(128, 64, 4, 3), Tiles(128, 64, 4, 3))
    w13 = torch.empty(32, 2 * 8, 8)
    assert tiles(torch.empty(0), w13, 8192, 4)[0] == 64 and tiles(torch.empty(0), w13, 64, 4)[0] == BLOCK_M
