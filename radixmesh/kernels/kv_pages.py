"""Whole KV pages between the paged device pool and the host pool (L2 of the hierarchical cache), one layer per
launch, and the plain-torch twin.

Host page p is one block [2 * layers, page_size, kv_heads, head_dim] (layer 0 K, layer 0 V, ...), or [layers, ...]
for a latent cache (one buffer a layer, engine.cache.kv_pool's `parts`); device page d of a layer is rows
[d * page_size, (d + 1) * page_size) of that layer's K and V buffers [slots, kv_heads, head_dim]. On
CUDA the host pool is pinned memory, which a kernel reads and writes in place through unified addressing: a load
needs no staging copy on the device and no scatter after it, and each layer's part is a launch of its own, so a
forward can wait for layer l's pages alone (engine.cache.host_pool).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096  # elements one program copies per step (8 KB of bfloat16)
# Programs per launch, each looping over its share of the chunks. Few on purpose: a chunk read over PCIe keeps its
# program waiting ~2 us, and a grid of thousands such programs takes SM slots from the forward it overlaps; 64
# programs with a chunk in flight each still keep ~0.5 MB on the bus, more than PCIe's bandwidth-delay product.
PROGRAMS = 64


@triton.jit(do_not_specialize=["layer", "items"])  # one compiled kernel per direction and model, whatever the layer
def _kv_pages_kernel(host_ptr, k_ptr, v_ptr, host_pages_ptr, dev_pages_ptr, host_page_stride, layer, page_elems,
                     chunks, items, BLOCK: tl.constexpr, TO_HOST: tl.constexpr, PARTS: tl.constexpr):
    # Item t = (page i, K or V, chunk c) of this layer (PARTS 1: K alone); program p copies items p, p + programs, ...
    for t in range(tl.program_id(0), items, tl.num_programs(0)):
        i = t // (PARTS * chunks)
        kv = (t // chunks) % PARTS
        offs = (t % chunks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < page_elems
        hp = tl.load(host_pages_ptr + i).to(tl.int64)
        dp = tl.load(dev_pages_ptr + i).to(tl.int64)
        host = host_ptr + hp * host_page_stride + (PARTS * layer + kv).to(tl.int64) * page_elems + offs
        if kv == 0:
            dev = k_ptr + dp * page_elems + offs
        else:
            dev = v_ptr + dp * page_elems + offs
        if TO_HOST:
            tl.store(host, tl.load(dev, mask=mask), mask=mask)
        else:
            tl.store(dev, tl.load(host, mask=mask), mask=mask)


def copy_kv_pages(host: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, layer: int, host_pages: torch.Tensor,
                  dev_pages: torch.Tensor, to_host: bool, programs: int | None = None, check: bool = True) -> None:
    """Copies layer `layer` of host pages `host_pages[i]` into device pages `dev_pages[i]` of k and v, or the other way
    with `to_host`. host [pages, 2 * layers, page_size, kv_heads, head_dim] (each page one contiguous block; a pinned
    CPU tensor beside CUDA pools), k and v [slots, kv_heads, head_dim] contiguous (v None: a latent cache's one
    buffer a layer, host [pages, layers, ...]); the page lists int64 on k's
    device, of one length. `programs`: the launch's width (default PROGRAMS); `check` False skips the argument
    checks (a caller that checked the same pools and lists for another layer). Launches and returns (on CUDA, on the
    current stream)."""
    if check:
        check_kv_pages(host, k, v, layer, host_pages, dev_pages)
    n = host_pages.shape[0]
    page_elems = host[0, 0].numel()
    if n == 0:
        return
    parts = 1 if v is None else 2
    chunks = triton.cdiv(page_elems, _BLOCK)
    items = n * parts * chunks
    _kv_pages_kernel[(min(items, programs or PROGRAMS),)](
        host, k, k if v is None else v, host_pages, dev_pages, host.stride(0), layer, page_elems, chunks, items,
        BLOCK=_BLOCK, TO_HOST=to_host, PARTS=parts, num_warps=4)


def copy_kv_pages_reference(host: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, layer: int,
                            host_pages: torch.Tensor, dev_pages: torch.Tensor, to_host: bool) -> None:
    """Plain-torch twin of copy_kv_pages."""
    check_kv_pages(host, k, v, layer, host_pages, dev_pages)
    page = host.shape[2]
    hp, dp = host_pages.cpu(), dev_pages.to(k.device)
    bufs = (k,) if v is None else (k, v)
    for j, buf in enumerate(bufs):
        pages = buf.view(-1, page, *buf.shape[1:])
        if to_host:
            host[hp, len(bufs) * layer + j] = pages[dp].to(host.device)
        else:
            pages[dp] = host[hp, len(bufs) * layer + j].to(buf.device)


def check_kv_pages(host, k, v, layer, host_pages, dev_pages) -> None:
    """ValueError unless the host pool, the layer's buffers and the page lists fit together."""
    parts = 1 if v is None else 2
    v = k if v is None else v
    if host.dim() != 5 or not host[0].is_contiguous() or host.stride(-1) != 1:
        raise ValueError(f"host pages must be [pages, {parts} * layers, page, heads, dim] blocks, got "
                         f"{tuple(host.shape)}")
    if not 0 <= layer < host.shape[1] // parts:
        raise ValueError(f"layer {layer} outside the host pages' {host.shape[1] // parts} layers")
    if k.shape != v.shape or not k.is_contiguous() or not v.is_contiguous() or k.shape[1:] != host.shape[3:]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be contiguous [slots, "
                         f"{host.shape[3]}, {host.shape[4]}]")
    if k.shape[0] % host.shape[2]:
        raise ValueError(f"{k.shape[0]} slots are not whole pages of {host.shape[2]}")
    if len({host.dtype, k.dtype, v.dtype}) != 1:
        raise ValueError(f"dtypes differ: host {host.dtype}, k {k.dtype}, v {v.dtype}")
    if host_pages.shape != dev_pages.shape or host_pages.dim() != 1 or host_pages.dtype != torch.int64 \
            or dev_pages.dtype != torch.int64:
        raise ValueError("host_pages and dev_pages must be int64 vectors of one length")
