"""kernels.gemv, the skinny decode product, and gemv_row, its one-row kind, against their float32 twin: ragged sizes
(K not a multiple of the tile, N not a multiple of the column block), 1-16 rows, an output view, bad shapes refused. On CUDA the Llama-3.1-8B projections
also run with programmatic dependent launch, chained inside a CUDA graph (each product reads the one before), and
must equal the same chain launched without it bit for bit."""

from __future__ import annotations

import pytest
import torch

from radixmesh.kernels.gemv import MAX_ROWS, gemv, gemv_reference, gemv_row
from radixmesh.kernels.runtime import pdl_supported
from tests.cuda_graphs import assert_pdl_graph_equals_eager

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _matches_twin(product, m: int, n: int, k: int, dtype: torch.dtype, with_bias: bool, **kw) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn((m, k), generator=g).to(KERNEL_DEVICE, dtype)
    w = (torch.randn((n, k), generator=g) / k ** 0.5).to(KERNEL_DEVICE, dtype)
    bias = torch.randn((n,), generator=g).to(KERNEL_DEVICE, dtype) if with_bias else None
    got, want = product(x, w, bias, **kw), gemv_reference(x, w, bias)
    assert got.shape == (m, n) and got.dtype == dtype
    # float32 sums in another order; bfloat16 outputs may round to the neighbour of the twin's
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,n,k", [(1, 40, 200), (3, 96, 64), (16, 17, 520), (8, 64, 1030)])
def test_gemv_matches_its_twin(m, n, k, dtype):
    _matches_twin(gemv, m, n, k, dtype, with_bias=m % 2 == 1)


def test_gemv_writes_into_a_view_and_refuses_bad_shapes():
    x = torch.randn((2, 64)).to(KERNEL_DEVICE)
    w = torch.randn((48, 64)).to(KERNEL_DEVICE)
    wide = torch.zeros((2, 80), device=KERNEL_DEVICE)
    gemv(x, w, out=wide[:, 16:64])
    torch.testing.assert_close(wide[:, 16:64], gemv_reference(x, w), rtol=1e-5, atol=1e-5)
    assert not wide[:, :16].any() and not wide[:, 64:].any()
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(torch.randn((MAX_ROWS + 1, 64)).to(KERNEL_DEVICE), w)
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(x, torch.randn((48, 32)).to(KERNEL_DEVICE))
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(x, w, bias=torch.zeros(47, device=KERNEL_DEVICE))
    with pytest.raises(ValueError, match="of x's dtype"):
        gemv(x, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, w, out=torch.empty((2, 47), device=KERNEL_DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,k,config", [(40, 200, (2, 64, 4)), (17, 1030, (4, 256, 4)), (96, 64, None),
                                        (5, 3000, (8, 1024, 8))])
def test_gemv_row_matches_its_twin(n, k, config, dtype):
    _matches_twin(gemv_row, 1, n, k, dtype, with_bias=n % 2 == 1, config=config)


def test_gemv_row_writes_into_a_view_and_refuses_bad_shapes():
    x = torch.randn((1, 64)).to(KERNEL_DEVICE)
    w = torch.randn((48, 64)).to(KERNEL_DEVICE)
    wide = torch.zeros((1, 80), device=KERNEL_DEVICE)
    gemv_row(x, w, out=wide[:, 16:64])
    torch.testing.assert_close(wide[:, 16:64], gemv_reference(x, w), rtol=1e-5, atol=1e-5)
    assert not wide[:, :16].any() and not wide[:, 64:].any()
    for bad in (lambda: gemv_row(torch.randn((2, 64)).to(KERNEL_DEVICE), w),
                lambda: gemv_row(x, torch.randn((48, 32)).to(KERNEL_DEVICE)),
                lambda: gemv_row(x, w, bias=torch.zeros(47, device=KERNEL_DEVICE)),
                lambda: gemv_row(x, w.to(torch.bfloat16))):
        with pytest.raises(ValueError, match="gemv_row takes"):
            bad()
    with pytest.raises(ValueError, match="out must be"):
        gemv_row(x, w, out=torch.empty((1, 47), device=KERNEL_DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_a_pdl_chain_in_a_graph_equals_the_plain_chain(rows):
    """Each product reads the previous one's output: launched early, a kernel that read x before its wait would see
    stale values and the chain would drift."""
    if not pdl_supported():
        pytest.skip("programmatic dependent launch needs Hopper and a Triton with gdc_wait")
    g = torch.Generator(device="cuda").manual_seed(rows)
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)] * 4 + [(128256, 4096)]
    ws = [torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=g) / s[1] ** 0.5 for s in shapes]
    x = torch.randn((rows, 4096), device="cuda", dtype=torch.bfloat16, generator=g)

    def chain(pdl: bool) -> torch.Tensor:
        h = x
        for w in ws:  # every output is at least as wide as the next product's input: take its first columns
            h = gemv(h[:, :w.shape[1]], w, pdl=pdl)
        return h

    assert_pdl_graph_equals_eager(chain)


@pytest.mark.gpu
def test_a_pdl_chain_of_row_products_in_a_graph_equals_the_plain_chain():
    """gemv_row under programmatic dependent launch: its weights are pulled before the wait, x only after it."""
    if not pdl_supported():
        pytest.skip("programmatic dependent launch needs Hopper and a Triton with gdc_wait")
    g = torch.Generator(device="cuda").manual_seed(5)
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)] * 4 + [(128256, 4096)]
    ws = [torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=g) / s[1] ** 0.5 for s in shapes]
    x = torch.randn((1, 4096), device="cuda", dtype=torch.bfloat16, generator=g)

    def chain(pdl: bool) -> torch.Tensor:
        h = x
        for w in ws:
            h = gemv_row(h[:, :w.shape[1]], w, pdl=pdl)
        return h

    assert torch.isfinite(assert_pdl_graph_equals_eager(chain)).all()
