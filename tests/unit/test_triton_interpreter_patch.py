"""tests/triton_interpreter.py (installed by tests/conftest.py where Triton runs in its interpreter): a kernel whose
@triton.jit helpers run in a loop gives bit-identical outputs with the interpreter's per-helper repatch and without
it, equal to numpy's; the repatch is skipped inside the launch, and after the launch the language is as it was."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only")

triton = pytest.importorskip("triton")
tl = triton.language


@triton.jit
def _scaled(x, scale):
    return x * scale


@triton.jit
def _masked_max(x, mask):
    return tl.max(tl.where(mask, x, float("-inf")), axis=0)


@triton.jit
def _kernel(X, Out, n, BLOCK: tl.constexpr):
    """Out[row] = max over blocks of the row's scaled values, with the row's sum of squares: helpers in a loop,
    masks at the tail, a reduction."""
    row = tl.program_id(0)
    best = float("-inf")
    total = 0.0
    for start in tl.range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(X + row * n + offs, mask=mask, other=0.0)
        y = _scaled(x, 0.5)
        best = tl.maximum(best, _masked_max(y, mask))
        total += tl.sum(y * y, axis=0)
    tl.store(Out + 2 * row, best)
    tl.store(Out + 2 * row + 1, total)


def _run(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], 2, dtype=torch.float32)
    _kernel[(x.shape[0],)](x, out, x.shape[1], BLOCK=16)
    return out


def test_helpers_inside_a_launch_skip_the_repatch_and_outputs_stay_bit_identical(monkeypatch):
    from triton.runtime import interpreter

    from tests.triton_interpreter import install

    install()  # conftest did; a second call changes nothing
    assert getattr(interpreter._patch_lang, "_once_per_launch", False)
    x = torch.randn(3, 45, generator=torch.Generator().manual_seed(0))  # 45: a masked tail block

    scans = []
    real_builtin = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: scans.append(1) or real_builtin(*a))
    fast = _run(x)
    fast_scans = len(scans)
    scans.clear()
    with monkeypatch.context() as m:  # the interpreter as Triton ships it
        m.setattr(interpreter, "_patch_lang", interpreter._patch_lang.__wrapped__)
        m.setattr(interpreter.GridExecutor, "__call__", interpreter.GridExecutor.__call__.__wrapped__)
        slow = _run(x)
    slow_scans = len(scans)

    assert torch.equal(fast, slow)
    y = x.numpy() * 0.5
    want = np.stack([y.max(axis=1), (y * y).sum(axis=1)], axis=1)
    np.testing.assert_allclose(fast.numpy(), want, rtol=1e-6)
    # a launch scans tl, tl.tensor, tl.math and the descriptor base, tl.max's first call triton.language.core, its
    # tensor and the descriptor base again; without the patch every helper call scanned them all again
    # (how many a launch scans depends on what earlier tests loaded: 7 alone, 10 in a full run)
    assert 0 < fast_scans <= 12 and slow_scans > 5 * fast_scans, (fast_scans, slow_scans)


def _language_state() -> tuple:
    """What a launch patches: the language's functions, the tensor class's dunders, a builtin."""
    dunders = tuple(tl.tensor.__dict__.get(name) for name in ("__index__", "__bool__", "__repr__", "__str__", "T"))
    return tl.max, tl.sum, tl.range, tl.static_range, tl.arange, tl.where, dunders


def test_after_a_launch_the_language_is_as_before():
    _run(torch.ones(1, 20))  # a first launch: tl.max's own patch of triton.language.core stays, as Triton leaves it
    before = _language_state()
    _run(torch.ones(2, 40))
    assert _language_state() == before
