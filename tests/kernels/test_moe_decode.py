"""The few-token expert path (kernels.moe_decode) against its plain-torch twin, against kernels.moe's grouped GEMMs
and against the transformers-order twin (fused_experts_reference): ragged sizes (K not a multiple of the load
chunk, columns not a multiple of the program's block), every k summed in the down launch, experts of other ranks
(-1), float32 routing weights (Mixtral), and which token counts fused_experts sends here. In Triton's interpreter
without CUDA, on the GPU with it."""

from __future__ import annotations

import pytest
import torch

from radixmesh.kernels.moe import fused_experts, fused_experts_reference, route_reference
from radixmesh.kernels.moe_extras import ExpertExtras
from radixmesh.kernels.moe_decode import (MAX_PAIRS, DecodeTiles, decode_experts, decode_experts_reference,
                                          use_decode_path)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = DecodeTiles(up_block_n=4, up_block_k=32, up_warps=1, down_block_n=8, down_block_k=16, down_warps=1)
WIDE = DecodeTiles(up_block_n=16, down_block_n=32)  # fewer programs: the interpreter runs them one by one
LOOP = [SMALL._replace(down_stacked=0), WIDE._replace(down_stacked=0)]  # the down launch's experts one by one


def _layer(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
           weight_dtype="same"):
    """x, w13, w2, routing weights (in `weight_dtype`: "same" is x's, None float32) and ids of one layer."""
    gen = torch.Generator().manual_seed(tokens * 1000 + experts * 10 + top_k)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = route_reference(logits, top_k, True, dtype if weight_dtype == "same" else weight_dtype)
    return x, w13, w2, weights, ids


def _on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


def _close(got: torch.Tensor, want: torch.Tensor, same_rounding: bool = False) -> None:
    """float32: within its sums' order. bfloat16: a product may round to the neighbour of the other's; against a
    computation with the same roundings (`same_rounding`: the twin) nearly every element is equal."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    if same_rounding:
        assert (got != want).float().mean().item() <= 0.05


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,tiles", [
    (1, 8, 2, 64, 48, WIDE), (2, 6, 3, 40, 24, SMALL), (2, 16, 4, 72, 20, WIDE),
    (1, 8, 2, 64, 48, LOOP[1]), (2, 6, 3, 40, 24, LOOP[0]), (1, 16, 8, 72, 20, WIDE)],
    ids=["wide", "small", "wide-k4", "loop-wide", "loop-small-k3", "wide-k8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_decode_experts_match_the_twin(tokens, experts, top_k, hidden, inter, tiles, dtype):
    """SMALL tiles cut K into several unrolled chunks with a ragged last one (40 = 32 + 8, 24 = 16 + 8) and leave
    columns past the end in the last program's block."""
    layer = _layer(tokens, experts, top_k, hidden, inter, dtype)
    got = decode_experts(*_on_device(*layer), tiles=tiles).cpu()
    _close(got, decode_experts_reference(*layer), same_rounding=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_decode_experts_match_the_grouped_gemms_and_transformers_order(dtype):
    layer = _layer(2, 8, 3, 32, 16, dtype)
    got = decode_experts(*_on_device(*layer), tiles=WIDE).cpu()
    _close(got, fused_experts(*_on_device(*layer), decode_path=False).cpu(), same_rounding=True)
    _close(got, fused_experts_reference(*layer))


def test_float32_routing_weights_weigh_as_mixtral_does():
    """Mixtral's weights stay float32: the bf16 down-projection times a float32 weight, rounded once."""
    layer = _layer(2, 8, 2, 32, 32, torch.bfloat16, weight_dtype=None)
    assert layer[3].dtype == torch.float32
    got = decode_experts(*_on_device(*layer), tiles=WIDE).cpu()
    _close(got, decode_experts_reference(*layer), same_rounding=True)
    _close(got, fused_experts_reference(*layer))


def test_experts_of_other_ranks_add_nothing():
    """Expert parallelism: ids of -1 load nothing and add nothing; a token with no local expert gets zeros."""
    x, w13, w2, weights, ids = _layer(3, 6, 2, 32, 16, torch.float32)
    w13, w2 = w13[3:], w2[3:]  # this rank holds experts 3..5
    local = torch.where(ids >= 3, ids - 3, -1)
    local[0, 0], local[1] = 1, -1  # token 0: one expert here, one elsewhere; token 1: none here
    want = fused_experts_reference(x, w13, w2, weights, local)
    for tiles in (WIDE, LOOP[1]):
        got = decode_experts(*_on_device(x, w13, w2, weights, local), tiles=tiles).cpu()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (got[1] == 0).all() and got[0].abs().sum() > 0


def test_the_stacked_down_launch_equals_the_expert_loop():
    """down_stacked (the default) sums the weighted rows of the top_k experts in a tree's order instead of k's:
    float32 sums rounded once, so in bfloat16 nearly every element is the loop's, and in float32 all are within a
    few ulps."""
    for dtype in (torch.float32, torch.bfloat16):
        layer = _on_device(*_layer(2, 16, 8, 64, 40, dtype))
        loop = decode_experts(*layer, tiles=LOOP[1])
        stacked = decode_experts(*layer, tiles=WIDE)
        _close(stacked, loop, same_rounding=True)


def _extras(experts: int, hidden: int, inter: int, dtype: torch.dtype, down_bias: bool = True, limit: float = 0.4):
    """GPT-OSS's extras at a small limit (most gate and up values clamped) with biases away from zero."""
    gen = torch.Generator().manual_seed(9)
    b13 = (0.3 * torch.randn(experts, 2 * inter, generator=gen)).to(dtype)
    b2 = (0.3 * torch.randn(experts, hidden, generator=gen)).to(dtype) if down_bias else None
    return ExpertExtras(b13, b2, 1.702, limit)


def _moved(extras):
    return ExpertExtras(*_on_device(extras.b13), extras.b2.to(DEVICE) if extras.b2 is not None else None,
                        extras.swiglu_alpha, extras.swiglu_limit)


@pytest.mark.parametrize("tiles", [WIDE, LOOP[0], SMALL], ids=["stacked", "loop", "small"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_biases_and_the_clamped_swiglu_match_the_twin_and_the_grouped_gemms(tiles, dtype):
    """GPT-OSS's experts (kernels.moe_extras.ExpertExtras) on the few-token launches: the twin's roundings (bfloat16
    nearly element for element), the grouped GEMMs' path and the transformers-order twin within rounding; without the
    down bias (a tensor-parallel rank other than 0) too; the biases and the clamp each change the result."""
    layer = _layer(2, 8, 3, 40, 24, dtype)
    extras = _extras(8, 40, 24, dtype)
    got = decode_experts(*_on_device(*layer), tiles=tiles, extras=_moved(extras)).cpu()
    _close(got, decode_experts_reference(*layer, extras=extras), same_rounding=True)
    _close(got, fused_experts(*_on_device(*layer), decode_path=False, extras=_moved(extras)).cpu())
    _close(got, fused_experts_reference(*layer, extras))
    no_down = _extras(8, 40, 24, dtype, down_bias=False)
    got = decode_experts(*_on_device(*layer), tiles=tiles, extras=_moved(no_down)).cpu()
    _close(got, fused_experts_reference(*layer, no_down))
    no_up = ExpertExtras(torch.zeros_like(no_down.b13), None, no_down.swiglu_alpha, no_down.swiglu_limit)
    for other in (_extras(8, 40, 24, dtype, down_bias=False, limit=1e4), no_up, None):
        assert (got - fused_experts_reference(*layer, other).to(got.dtype)).abs().max() > 1e-2


@pytest.mark.parametrize("with_bias", [True, False], ids=["biased", "unbiased"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_grouped_paths_bias_and_activation_launches_equal_their_twins(with_bias, dtype):
    """kernels.moe_activation.biased_activation (the gate/up bias and the clamped SwiGLU) and add_weighted_bias (the
    routing weight times the down bias) each in one launch: their twins' torch ops element for element (an id of -1,
    another rank's expert, takes no bias), within float32's last bits (torch's sigmoid against Triton's exp), all
    but a few bfloat16 elements equal."""
    from radixmesh.kernels.moe_activation import (add_weighted_bias, add_weighted_bias_reference,
                                                  biased_activation, biased_activation_reference)

    gen = torch.Generator().manual_seed(4)
    extras = _extras(8, 40, 600, dtype)  # (600 columns: more than one program's block)
    extras = extras if with_bias else ExpertExtras(None, None, extras.swiglu_alpha, extras.swiglu_limit)
    ids = torch.randint(0, 8, (5, 3), generator=gen)
    ids[1, 2] = -1
    gate_up = torch.randn(15, 1200, generator=gen).to(dtype)
    got = biased_activation(*_on_device(gate_up, ids), _moved(extras) if with_bias else extras).cpu()
    want = biased_activation_reference(gate_up, ids, extras)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.bfloat16:  # each op rounded to bfloat16: torch's sigmoid and Triton's exp rarely part
        assert (got != want).float().mean().item() < 0.01
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    if not with_bias:
        return
    down, weights = torch.randn(15, 40, generator=gen).to(dtype), torch.rand(5, 3, generator=gen)
    got = add_weighted_bias(*_on_device(down.clone(), ids, weights), extras.b2.to(DEVICE)).cpu()
    assert torch.equal(got, add_weighted_bias_reference(down.clone(), ids, weights, extras.b2))
    assert torch.equal(got[1 * 3 + 2], down[1 * 3 + 2])  # the id of -1: nothing added


def test_the_tiles_can_be_set_from_the_environment(monkeypatch):
    """RADIXMESH_MOE_DECODE_TILES (a JSON object of DecodeTiles fields) overrides the defaults on a GPU; a bad value is
    a clear error naming the fields; the interpreter keeps its own tiles."""
    from radixmesh.kernels import moe_decode

    monkeypatch.setattr(moe_decode, "interpreting", lambda: False)
    monkeypatch.setenv(moe_decode.TILES_ENV, '{"down_stacked": 0, "down_warps": 8}')
    assert moe_decode.default_tiles() == DecodeTiles(down_stacked=0, down_warps=8) != DecodeTiles()
    monkeypatch.setenv(moe_decode.TILES_ENV, '{"down_stack": 1}')
    with pytest.raises(ValueError, match="RADIXMESH_MOE_DECODE_TILES=.*up_block_n, up_block_k"):
        moe_decode.default_tiles()
    monkeypatch.delenv(moe_decode.TILES_ENV)
    assert moe_decode.default_tiles() == DecodeTiles()
    monkeypatch.setattr(moe_decode, "interpreting", lambda: True)
    monkeypatch.setenv(moe_decode.TILES_ENV, '{"down_stacked": 0}')
    assert moe_decode.default_tiles() == moe_decode.INTERPRETER_TILES


def test_which_token_counts_take_the_decode_path():
    assert use_decode_path(1, 8, 128) and use_decode_path(4, 8, 128) and not use_decode_path(5, 8, 128)  # E / 4
    assert use_decode_path(MAX_PAIRS // 8, 8, 256) and not use_decode_path(MAX_PAIRS // 8 + 1, 8, 256)
    assert not use_decode_path(MAX_PAIRS // 8 + 1, 8, 1024)  # never past MAX_PAIRS
    assert use_decode_path(1, 2, 8) and not use_decode_path(2, 2, 8)  # Mixtral: one token
    assert use_decode_path(1, 3, 4) and not use_decode_path(2, 3, 4)  # one token always does


def test_fused_experts_sends_a_few_tokens_here_and_more_to_the_grouped_gemms():
    """The two paths round differently (other float32 sums); fused_experts equals, bit for bit, the one its token
    count picks."""
    few = _on_device(*_layer(1, 8, 2, 32, 8, torch.float32))
    decode, grouped = decode_experts(*few), fused_experts(*few, decode_path=False)
    assert not torch.equal(decode, grouped)  # otherwise the check below could not tell the paths apart
    assert torch.equal(fused_experts(*few), decode)
    many = _on_device(*_layer(3, 8, 2, 32, 8, torch.float32))
    decode, grouped = fused_experts(*many, decode_path=True), fused_experts(*many, decode_path=False)
    assert not torch.equal(decode, grouped)
    assert torch.equal(fused_experts(*many), grouped)


def test_decode_experts_refuse_mismatched_shapes():
    x, w13, w2, weights, ids = _layer(1, 4, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="decode_experts takes"):
        decode_experts(x, w13, w2.transpose(1, 2), weights, ids)
    with pytest.raises(ValueError, match="decode_experts takes"):
        decode_experts(x, w13.to(torch.bfloat16), w2, weights, ids)
