"""KV pages between two workers' pools: the layout a decode worker sends the prefill worker (one base address per
KV buffer and the bytes per page), the writes that move a request's pages, and a checksum of pages for
--disaggregation-verify-kv (computed on both sides; a mismatch means the transfer corrupted the KV)."""

from __future__ import annotations

import hashlib
from typing import NamedTuple, Sequence

import torch

from radixmesh.engine.cache.kv_pool import KVPool
from radixmesh.engine.disaggregation.transfer import TransferBackend, Write, page_writes
from radixmesh.engine.quantization import kv_scales
from radixmesh.engine.quantization.kv_scales import KvScales


class KvLayout(NamedTuple):
    """Where a pool's pages live: page p of buffer i is [bases[i] + p * page_bytes, + page_bytes)."""

    bases: tuple[int, ...]
    page_bytes: int


def layout_of(pool: KVPool) -> KvLayout:
    return KvLayout(tuple(t.data_ptr() for t in pool.buffers()), pool.page_bytes)


def register_pool(backend: TransferBackend, pool: KVPool) -> None:
    """Make every KV buffer of the pool reachable by peers."""
    for t in pool.buffers():
        backend.register(t.data_ptr(), t.numel() * t.element_size())


def check_layouts(src: KvLayout, dst: KvLayout) -> None:
    """ValueError unless pages of `src` can move to `dst` (as many buffers, as many bytes a page)."""
    if len(src.bases) != len(dst.bases) or src.page_bytes != dst.page_bytes:
        raise ValueError(f"KV layouts differ: {len(src.bases)} buffers of {src.page_bytes} B/page here, "
                         f"{len(dst.bases)} of {dst.page_bytes} B/page at the peer (another model or page size?)")


def kv_format(pool: KVPool) -> str:
    """What a page's bytes mean beyond the layout's sizes: the cache dtype and, for an fp8 cache, a digest of its
    per-layer scales. Two workers of one model and page size can differ in these (fp8_e4m3 and fp8_e5m2 pages have
    the same bytes; scales come from the checkpoint or a --quantization-param-path file)."""
    dtype = str(pool.buffers()[0].dtype).removeprefix("torch.")
    if not dtype.startswith("float8"):
        return dtype
    return f"{dtype} with scales {kv_scales.digest([KvScales(tuple(pool.k_scale), tuple(pool.v_scale))]) or '1.0'}"


def check_kv_format(mine: str, theirs: str) -> None:
    """ValueError unless a peer's pages (kv_format `theirs`; empty: a peer too old to say) mean what ours do."""
    if theirs and theirs != mine:
        raise ValueError(f"the decode worker's KV cache holds {theirs} and this prefill worker's {mine}: the workers "
                         "of a prefill/decode pair must use the same --kv-cache-dtype and KV cache scales (the same "
                         "checkpoint and --quantization-param-path)")


def kv_writes(src: KvLayout, dst: KvLayout, src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[Write]:
    """The batched writes that copy src_pages to dst_pages in every buffer (runs of consecutive pages merged)."""
    check_layouts(src, dst)
    writes: list[Write] = []
    for s_base, d_base in zip(src.bases, dst.bases):
        writes += page_writes(s_base, d_base, src.page_bytes, src_pages, dst_pages)
    return writes


def pages_digest(buffers: Sequence[torch.Tensor], page_size: int, pages: Sequence[int]) -> str:
    """A digest of the pages' bytes in every buffer ([slots, heads, head_dim] each), in page order."""
    index = torch.as_tensor(list(pages), dtype=torch.int64)
    h = hashlib.blake2b(digest_size=16)
    for t in buffers:
        by_page = t.view(-1, page_size, *t.shape[1:])
        h.update(by_page[index.to(t.device)].contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def page_checksum(pool: KVPool, pages: Sequence[int]) -> str:
    """A digest of the pages' bytes in every buffer of the pool, in page order."""
    return pages_digest(pool.buffers(), pool.page_size, pages)
