"""The host <-> device page copy against its plain-torch twin, both ways: page sizes 1/16/64, odd head counts, pages
out of order and repeated runs, a layer in the middle, and nothing touched outside the pages named. On CPU the
kernel runs in Triton's interpreter; on CUDA the host side is pinned memory read and written in place."""

from __future__ import annotations

import pytest
import torch

from radixmesh.kernels.kv_pages import copy_kv_pages, copy_kv_pages_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pools(page: int, heads: int, dim: int, layers: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    host = torch.randn((9, 2 * layers, page, heads, dim), generator=gen).to(dtype)
    if DEVICE == "cuda":
        host = host.pin_memory()
    k = torch.randn((7 * page, heads, dim), generator=gen).to(dtype).to(DEVICE)
    v = torch.randn((7 * page, heads, dim), generator=gen).to(dtype).to(DEVICE)
    return host, k, v


@pytest.mark.parametrize("page,heads,dim", [(1, 1, 8), (16, 3, 24), (64, 8, 128)], ids=["p1", "p16-odd", "p64"])
@pytest.mark.parametrize("to_host", [False, True], ids=["load", "backup"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("programs", [None, 3], ids=["wide", "3-programs-loop"])
def test_matches_reference(page, heads, dim, to_host, dtype, programs):
    layers, layer = 3, 1
    host, k, v = _pools(page, heads, dim, layers, dtype, seed=page + heads)
    host_pages = torch.tensor([5, 2, 3, 8], dtype=torch.int64)
    dev_pages = torch.tensor([6, 1, 2, 4], dtype=torch.int64)  # out of order; device pages 0, 3, 5 untouched
    want = [t.clone() for t in (host, k, v)]
    copy_kv_pages_reference(*want, layer, host_pages, dev_pages, to_host)
    got = [host, k, v]
    copy_kv_pages(*got, layer, host_pages.to(DEVICE), dev_pages.to(DEVICE), to_host, programs)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w.cpu())
    # the copy really moved the bytes (the reference could have been a no-op too)
    if to_host:
        assert torch.equal(host[5, 2 * layer].cpu(), k.view(-1, page, heads, dim)[6].cpu())
        assert torch.equal(host[8, 2 * layer + 1].cpu(), v.view(-1, page, heads, dim)[4].cpu())
    else:
        assert torch.equal(k.view(-1, page, heads, dim)[1].cpu(), host[2, 2 * layer].cpu())
        assert torch.equal(v.view(-1, page, heads, dim)[2].cpu(), host[3, 2 * layer + 1].cpu())


@pytest.mark.parametrize("to_host", [False, True], ids=["load", "backup"])
def test_latent_pages_one_buffer_a_layer(to_host):
    """A latent cache (K and V one buffer, engine.models.deepseek): host pages [pages, layers, ...] and v None; the
    kernel moves layer l's one buffer to or from block l of the page and nothing else."""
    page, layers, layer = 16, 3, 2
    gen = torch.Generator().manual_seed(7)
    host = torch.randn((9, layers, page, 1, 72), generator=gen).to(torch.bfloat16)
    host = host.pin_memory() if DEVICE == "cuda" else host
    latent = torch.randn((7 * page, 1, 72), generator=gen).to(torch.bfloat16).to(DEVICE)
    host_pages, dev_pages = torch.tensor([5, 2, 8], dtype=torch.int64), torch.tensor([6, 1, 4], dtype=torch.int64)
    want = [host.clone(), latent.clone()]
    copy_kv_pages_reference(want[0], want[1], None, layer, host_pages, dev_pages, to_host)
    copy_kv_pages(host, latent, None, layer, host_pages.to(DEVICE), dev_pages.to(DEVICE), to_host, 3)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(host, want[0]) and torch.equal(latent.cpu(), want[1].cpu())
    pages = latent.view(-1, page, 1, 72).cpu()
    assert torch.equal(host[8, layer], pages[4]) and torch.equal(host[2, layer], pages[1])
    with pytest.raises(ValueError, match="layer 3 outside the host pages' 3 layers"):
        copy_kv_pages(host, latent, None, 3, host_pages.to(DEVICE), dev_pages.to(DEVICE), to_host)


def test_empty_page_list_copies_nothing():
    host, k, v = _pools(16, 2, 8, 1, torch.float32, seed=0)
    before = k.clone()
    none = torch.empty(0, dtype=torch.int64, device=DEVICE)
    copy_kv_pages(host, k, v, 0, none, none, to_host=False)
    assert torch.equal(k, before)


def test_mismatched_arguments_are_clear_errors():
    host, k, v = _pools(16, 2, 8, 2, torch.float32, seed=0)
    pages = torch.tensor([1], dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="layer 2"):
        copy_kv_pages(host, k, v, 2, pages, pages, to_host=False)
    with pytest.raises(ValueError, match="dtypes"):
        copy_kv_pages(host, k.to(torch.bfloat16), v.to(torch.bfloat16), 0, pages, pages, to_host=False)
    with pytest.raises(ValueError, match="one length"):
        copy_kv_pages(host, k, v, 0, pages, torch.tensor([1, 2], device=DEVICE), to_host=False)
