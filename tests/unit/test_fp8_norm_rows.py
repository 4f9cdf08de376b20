"""benchmarks.fp8_norm_rows' chain (what it times on the GPU) on CPU in Triton's interpreter at a tiny shape: the
norm in the product's launch gives what the two launches give, layer after layer, through the residual buffers it
ping-pongs (the fused kernel must not write the sum over an input it is still reading)."""

from __future__ import annotations

import torch

from radixmesh.benchmarks.fp8_norm_rows import _chain
from radixmesh.engine.quantization.fp8 import quantize


def _layers(block, hidden=64):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(3):
        layer = {}
        for role, n in (("qkv", 96), ("gate_up", 128)):
            q, scale = quantize(torch.randn((n, hidden), generator=g) / hidden ** 0.5, block)
            layer[role] = (q, scale.reshape(n) if block is None else scale,
                           (1 + 0.1 * torch.randn((hidden,), generator=g)))
        out.append(layer)
    return out


def test_the_fused_chain_follows_the_two_launch_chain():
    for block in (None, (32, 32)):
        layers = _layers(block)
        h, d = torch.randn((1, 64)), torch.randn((1, 64))
        bufs = [torch.empty_like(h) for _ in range(2)]
        want = [t.clone() for t in _chain(layers, block, h, d, bufs, None, {"qkv": (2, 64, 2)})]
        got = _chain(layers, block, h, d, bufs, (4, 2), {})
        assert len(got) == len(want) == 6
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
