"""kernels.moe_gate: a sparse layer's residual add, RMSNorm, router product and routing at one token in one launch,
against its twin (Triton's interpreter on CPU, the GPU where there is one)."""

from __future__ import annotations

import pytest
import torch

from radixmesh.kernels.moe_gate import (moe_gate, moe_gate_grouped, moe_gate_grouped_reference, moe_gate_reference,
                                        new_counter)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(d: int, experts: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, d, generator=g).to(dtype)
    residual = torch.randn(1, d, generator=g).to(dtype)
    norm = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    router = (torch.randn(experts, d, generator=g) * 0.3).to(dtype)
    return hidden, residual, norm, router


@pytest.mark.parametrize("d,experts,top_k,renormalize,weights_dtype,dtype", [
    (256, 128, 8, True, torch.float32, torch.float32),  # Qwen3-MoE's routing (at a small hidden size)
    (200, 60, 4, False, None, torch.float32),  # a hidden size off a power of two; Mixtral's float32 weights
    (256, 128, 8, True, torch.bfloat16, torch.bfloat16),
    (2048, 128, 8, True, torch.bfloat16, torch.bfloat16),  # Qwen3-30B-A3B's gate
    (128, 256, 8, True, torch.bfloat16, torch.bfloat16)])  # past 128 experts: the rounds of max and argmax
def test_the_gate_equals_its_twin(d, experts, top_k, renormalize, weights_dtype, dtype):
    """The normed row and the residual sum as the norm kernel rounds them, the same experts in the same order, the
    weights within float32 rounding of the twin's (an ulp of their dtype at most)."""
    args = _inputs(d, experts, dtype, seed=d + experts)
    want = moe_gate_reference(*args[:3], 1e-6, args[3], top_k, renormalize, weights_dtype)
    counter = new_counter(torch.device(DEVICE))
    got = [t.cpu() for t in moe_gate(*(t.to(DEVICE) for t in args[:3]), 1e-6, args[3].to(DEVICE), top_k,
                                     renormalize, weights_dtype, counter)]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)  # the normed row
    assert torch.equal(got[1], want[1])  # the residual sum: one rounding of an exact float32 sum
    # the order among equal probabilities (ties of bfloat16 logits) is by expert id; torch.topk's is its own
    logits = (want[0].float() @ args[3].float().t()).to(dtype)
    order = torch.sort(torch.softmax(logits.float(), -1), descending=True, stable=True).indices[:, :top_k]
    assert sorted(want[3][0].tolist()) == sorted(order[0].tolist())
    assert got[2].dtype == want[2].dtype and torch.equal(got[3], order)
    torch.testing.assert_close(got[2].float(), want[2].float(), rtol=tol, atol=tol)
    assert int(counter.item()) == 0  # the last program set it back for the next launch


@pytest.mark.parametrize("d,experts,top_k,dtype", [(256, 32, 4, torch.float32), (2880, 32, 4, torch.bfloat16)],
                         ids=["float32", "gpt-oss-20b"])
def test_the_router_bias_is_added_before_the_logits_round(d, experts, top_k, dtype):
    """GPT-OSS's biased router: the bias (large enough to change which experts win) added to each logit in float32
    before its rounding; the same experts in the same order as the twin, weights within a rounding."""
    args = _inputs(d, experts, dtype, seed=d)
    bias = (torch.randn(experts, generator=torch.Generator().manual_seed(5)) * 4).to(dtype)
    want = moe_gate_reference(*args[:3], 1e-6, args[3], top_k, True, dtype, router_bias=bias)
    unbiased = moe_gate_reference(*args[:3], 1e-6, args[3], top_k, True, dtype)
    assert not torch.equal(want[3], unbiased[3])  # (the bias matters here)
    counter = new_counter(torch.device(DEVICE))
    got = [t.cpu() for t in moe_gate(*(t.to(DEVICE) for t in args[:3]), 1e-6, args[3].to(DEVICE), top_k, True, dtype,
                                     counter, router_bias=bias.to(DEVICE))]
    assert torch.equal(got[1], want[1]) and torch.equal(got[3], want[3])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got[2].float(), want[2].float(), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="router bias"):
        moe_gate(*args[:3], 1e-6, args[3], top_k, True, dtype, new_counter(torch.device("cpu")),
                 router_bias=bias[:-1])


def test_a_second_launch_on_the_same_counter_routes_again():
    """The counter a call site keeps is zero after each launch, so the next one (a CUDA graph's replay) routes the
    new token, not the old one's experts."""
    counter = new_counter(torch.device(DEVICE))
    for seed in (1, 2, 3):
        args = _inputs(64, 16, torch.float32, seed)
        want = moe_gate_reference(*args[:3], 1e-6, args[3], 2, True, None)
        got = moe_gate(*(t.to(DEVICE) for t in args[:3]), 1e-6, args[3].to(DEVICE), 2, True, None, counter)
        assert torch.equal(got[3].cpu(), want[3])


def test_the_lowest_expert_comes_first_among_equals():
    """Equal logits (a router row repeated): the order is by probability, then expert id, as kernels.moe.route's."""
    hidden, residual, norm, router = _inputs(32, 12, torch.float32, seed=5)
    router[7] = router[2]
    router[9] = router[2]
    _, _, _, ids = moe_gate(hidden.to(DEVICE), residual.to(DEVICE), norm.to(DEVICE), 1e-6, router.to(DEVICE), 12,
                            False, None, new_counter(torch.device(DEVICE)))
    ids = ids.cpu()[0].tolist()
    assert ids.index(2) < ids.index(7) < ids.index(9) and ids.index(9) == ids.index(2) + 2


def test_bad_input_is_refused():
    hidden, residual, norm, router = _inputs(32, 8, torch.float32, seed=6)
    counter = new_counter(torch.device("cpu"))
    with pytest.raises(ValueError, match="moe_gate takes"):
        moe_gate(hidden.repeat(2, 1), residual.repeat(2, 1), norm, 1e-6, router, 2, True, None, counter)
    with pytest.raises(ValueError, match="top_k 9"):
        moe_gate(hidden, residual, norm, 1e-6, router, 9, True, None, counter)
    with pytest.raises(ValueError, match="bfloat16"):
        moe_gate(hidden, residual, norm.bfloat16(), 1e-6, router, 2, True, None, counter)


@pytest.mark.parametrize("d,experts,top_k,groups,top_groups,group_best,renormalize,scale,softmax,norm_min,dtype", [
    (256, 64, 6, 1, 1, 1, False, 1.0, True, 0.0, torch.float32),  # DeepSeek-V2-Lite's rule (softmax, no groups)
    (2048, 64, 6, 1, 1, 1, False, 1.0, True, 0.0, torch.bfloat16),  # ... at its hidden size
    (192, 160, 6, 8, 3, 1, False, 16.0, True, 0.0, torch.bfloat16),  # DeepSeek-V2's group_limited_greedy
    (128, 256, 8, 8, 4, 2, True, 2.5, False, 0.0, torch.bfloat16),  # DeepSeek-V3's noaux_tc (sigmoid, bias)
    (5120, 64, 8, 1, 1, 2, True, 1.0, True, 1e-12, torch.bfloat16)])  # ERNIE's clamp; past 4,096: four warps
def test_the_grouped_gate_equals_its_twin(d, experts, top_k, groups, top_groups, group_best, renormalize, scale,
                                          softmax, norm_min, dtype):
    """The normed row and the residual sum as the norm kernel rounds them, the twin's experts in its order, the
    weights within float32 rounding (the logits are float32 sums in another order than torch's)."""
    hidden, residual, norm, router = _inputs(d, experts, dtype, seed=d + experts + groups)
    router = router.float()
    bias = torch.randn(experts, generator=torch.Generator().manual_seed(3)) * (0.0 if softmax else 0.1)
    rule = (top_k, groups, top_groups, renormalize, scale, softmax, norm_min, group_best)
    want = moe_gate_grouped_reference(hidden, residual, norm, 1e-6, router, bias, *rule)
    counter = new_counter(torch.device(DEVICE))
    got = [t.cpu() for t in moe_gate_grouped(*(t.to(DEVICE) for t in (hidden, residual, norm)), 1e-6,
                                             router.to(DEVICE), bias.to(DEVICE), *rule, counter)]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[3], want[3])  # (random logits: no near ties)
    assert got[2].dtype == torch.float32
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    assert int(counter.item()) == 0


def test_the_grouped_gate_refuses_what_it_cannot_route():
    hidden, residual, norm, router = _inputs(32, 8, torch.bfloat16, seed=6)
    counter, bias = new_counter(torch.device("cpu")), torch.zeros(8)
    with pytest.raises(ValueError, match="a float32 router"):
        moe_gate_grouped(hidden, residual, norm, 1e-6, router, bias, 2, 1, 1, True, 1.0, False, 0.0, 2, counter)
    with pytest.raises(ValueError, match="groups must be equal"):
        moe_gate_grouped(hidden, residual, norm, 1e-6, router.float(), bias, 2, 3, 1, True, 1.0, False, 0.0, 2,
                         counter)
