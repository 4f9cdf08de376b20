"""kernels.fp8_quant, the dynamic per-token-group (and per-token) fp8 quantization of activations, against its
plain-torch twin: scales equal, codes equal bit for bit (the kernel rounds to e4m3's grid itself, to nearest even,
so it does not lean on Triton's float32 -> fp8 conversion, which the interpreter gets wrong near a power of two)."""

from __future__ import annotations

import pytest
import torch

from radixmesh.kernels.fp8_quant import FP8, dequantize_groups, group_quant, group_quant_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_every_finite_e4m3_value_and_every_rounding_boundary_round_as_torch_rounds():
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    finite = codes[~codes.isnan()].sort().values
    mids = (finite[1:] + finite[:-1]) / 2  # ties: half to even
    near = torch.cat([mids, mids.nextafter(torch.tensor(-1e9)), mids.nextafter(torch.tensor(1e9))])
    values = torch.cat([finite, near, torch.tensor([127.97, -127.97, 447.9])])
    # rows of 63 values and a 448 (scale exactly 1: each value is rounded as it is), and rows of their own, padded
    # with zeros, for the two past 448 (a scale above 1); per-row scales (group None) as one group per value had
    # them, in 19 programs instead of one per value (the interpreter runs programs one by one)
    width = 64
    pad = -len(values) % (width - 1)
    body = torch.cat([values, torch.zeros(pad)]).view(-1, width - 1)
    body = torch.cat([body, torch.full((len(body), 1), 448.0)], dim=1)
    over = torch.zeros((2, width))
    over[:, 0], over[:, 1] = torch.tensor([449.0, 463.9]), 448.0
    x = torch.cat([body, over]).to(DEVICE)
    q, s = group_quant(x)
    want_q, want_s = group_quant_reference(x)
    assert torch.equal(want_s[:-2], torch.ones_like(want_s[:-2])) and (want_s[-2:] > 1).all()
    assert torch.equal(s, want_s)
    differ = (q.view(torch.uint8) != want_q.view(torch.uint8)).cpu()
    assert not differ.any(), x[differ]  # bit for bit: a negative value that rounds to zero is -0.0 (0x80)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("m,k,group", [(1, 256, 128), (5, 300, 128), (3, 2048, 128), (4, 96, 32), (7, 1500, None),
                                       (2, 64, None)])
def test_group_quant_matches_its_twin(m, k, group, dtype):
    g = torch.Generator().manual_seed(m * 100 + k)
    x = (torch.randn((m, k), generator=g) * torch.logspace(-3, 2, k)).to(DEVICE, dtype)
    x[0, : min(k, group or k)] = 0  # an all-zero group: a tiny scale, zero codes
    q, s = group_quant(x, group)
    want_q, want_s = group_quant_reference(x, group)
    assert q.dtype == FP8 and s.shape == (m, -(-k // (group or k)))
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    back = dequantize_groups(q, s, group)
    bound = x.float().abs() * 2 ** -4 + s.repeat_interleave(group or k, 1)[:, :k] * 2 ** -9
    assert ((back - x.float()).abs() <= bound).all()  # within half an e4m3 step


def test_group_quant_of_no_rows_and_bad_input():
    q, s = group_quant(torch.empty((0, 256), device=DEVICE), 128)
    assert q.shape == (0, 256) and s.shape == (0, 2)
    with pytest.raises(ValueError, match="unit stride"):
        group_quant(torch.randn((256, 4), device=DEVICE).t(), 128)
