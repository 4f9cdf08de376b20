"""Where fp8 weights stay fp8 (engine.quantization.fp8_load.kernels_wanted, SGLang's --fp8-gemm-backend): `triton`
everywhere it is allowed; `auto` on CUDA GPUs with fp8 conversions (compute capability 8.9+: Ada, Hopper, Blackwell),
dequantized on a CPU and on older GPUs."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.quantization import fp8_load


@pytest.mark.parametrize("capability,held", [((9, 0), True), ((8, 9), True), ((8, 0), False), ((7, 5), False)])
def test_auto_holds_fp8_on_gpus_with_fp8_conversions(monkeypatch, capability, held):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert fp8_load.kernels_wanted("auto", torch.device("cuda", 0)) is held
    assert fp8_load.kernels_wanted("triton", torch.device("cuda", 0)) is True


def test_auto_dequantizes_on_a_cpu():
    assert fp8_load.kernels_wanted("auto", torch.device("cpu")) is False
    assert fp8_load.kernels_wanted("triton", torch.device("cpu")) is True  # the config allows it in the interpreter
