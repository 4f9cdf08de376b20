"""The hybrid KV pool of models that mix sliding-window and full-attention layers (Gemma 2, Gemma 3, Qwen2 with
max_window_layers, ...): SGLang's hybrid SWA memory (--swa-full-tokens-ratio, --disable-hybrid-swa-memory).

A full-attention layer reads every earlier token's K and V; a sliding layer with a window of w tokens reads only the
last w. So the sliding layers get a KV pool of their own, `swa_full_tokens_ratio` times the full pool's tokens, whose
pages go back while requests run (engine.cache.swa_hybrid decides when).

One page table stays the truth: the request-to-token table of full-pool slots, which the radix tree, the cache
manager and the full layers read as before. A full page whose sliding-layer KV is held has a partner page in the
SWA pool, `swa_of[page]` (0: none, that KV was dropped); slot i of full page p is slot i of page swa_of[p] there.
Two device tensors follow the pairing:
- `slot_map` [full slots] int64: full slot -> SWA slot (a page without a partner -> the SWA pool's scratch page), for
  writing the new tokens (the forward's `out_cache_loc` are full slots) and for torch_native's gathers;
- the SWA page table (ReqToTokenPool.swa_device): each table entry translated when it is written, for the kernels
  that walk a table (Triton, FlashInfer's page lists). An entry whose partner was dropped after it was written names
  a page the SWA pool may have handed out again: only keys no window of that row reads lose their partner
  (engine.cache.swa_hybrid), and every backend reads a sliding layer only inside its window or masks the rest.
The scratch page 0 of each pool stays paired with the other's (padding rows of CUDA graphs write there).

Sizes: with full-layer bytes F and sliding-layer bytes S per token, a budget of B bytes holds T full tokens, with
T * (F + ratio * S) = B, and ratio * T SWA tokens (`hybrid_bytes_per_token`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from radixmesh.engine.cache.kv_pool import KVPool
from radixmesh.engine.cache.req_to_token import pinned_copy

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HybridLayout:
    """Which layers slide (their KV in the SWA pool), over how many tokens at most, and the pools' size ratio."""

    swa_layers: frozenset[int]
    num_layers: int
    window: int  # the largest sliding layer's window
    ratio: float  # SWA pool tokens per full pool token

    def bytes_per_token(self, all_layers: int) -> int:
        """Bytes the pools take per full-pool token (rounded up), given `all_layers`: one token's in every layer."""
        per_layer = all_layers / self.num_layers
        full = self.num_layers - len(self.swa_layers)
        return math.ceil(per_layer * (full + self.ratio * len(self.swa_layers)))

    def swa_pages(self, full_pages: int) -> int:
        return max(1, int(full_pages * self.ratio))


def hybrid_layout(windows: tuple[int | None, ...], ratio: float, why_not: str | None) -> HybridLayout | None:
    """The hybrid pool's layout for per-layer `windows` (engine.models.attention_spec.layer_windows), or None where
    every layer keeps its KV in one pool: no layer slides, every layer slides (engine.cache.swa frees those pages),
    or `why_not` names what keeps the hybrid pool off (logged)."""
    sliding = frozenset(i for i, w in enumerate(windows) if w is not None)
    if not sliding or len(sliding) == len(windows):
        return None
    if why_not is not None:
        log.info("sliding-window layers keep every token's KV (no hybrid SWA pool): %s", why_not)
        return None
    window = max(w for w in windows if w is not None)
    log.info("hybrid SWA memory: %d of %d layers slide over at most %d tokens, in a pool of %.2f x the full pool's "
             "tokens", len(sliding), len(windows), window, ratio)
    return HybridLayout(sliding, len(windows), window, ratio)


def why_no_hybrid(args, shares_table: bool) -> str | None:
    """What keeps an engine's sliding layers in the full pool (`args`: resolved EngineArgs), or None. Those paths copy
    or share whole pages of one layout, or mirror the page table on other ranks, which a second pool would break;
    they keep every token's KV in every layer instead (correct, without the memory saving)."""
    reasons = [(args.disable_hybrid_swa_memory, "--disable-hybrid-swa-memory"),
               (args.tp_size > 1, "tensor parallelism (the followers' page tables would need the SWA pairing)"),
               (args.enable_hierarchical_cache, "the hierarchical cache (its host pages hold every layer)"),
               (bool(args.speculative_algorithm) or shares_table, "speculative decoding (draft KV shares the table)")]
    # (On CUDA the hybrid pool matched transformers in float32 token for token, Gemma 2 and 3 through Triton with and
    # without graphs and torch_native, and in bfloat16 within noise through Triton (an H100, 2026-12-05) and through
    # FlashInfer's window page lists, prefill and decode, with and without graphs (an H100, 2026-12-06).)
    return next((why for on, why in reasons if on), None)


def make_kv_pool(layout: HybridLayout | None, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, scales=None, shared_kv: bool = False):
    """The engine's KV pool: a KVPool (`shared_kv`: KVPool's), or under `layout` a HybridKVPool."""
    if layout is None:
        return KVPool(num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype, device, scales=scales,
                      shared_kv=shared_kv)
    if shared_kv:
        raise ValueError("a latent KV cache has no sliding-window layers to keep apart")
    return HybridKVPool(layout, num_pages, page_size, num_kv_heads, head_dim, dtype, device, scales)


class HybridKVPool:
    """The KVPool interface over two pools: full layers in `full` (whose pages the cache manager allocates, through
    `allocator`), sliding layers in `swa` (pages handed out by `pair`). Layer indices are the model's."""

    def __init__(self, layout: HybridLayout, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device,
                 scales: tuple[tuple[float, ...], tuple[float, ...]] | None = None):
        self.layout = layout
        full_ids = [i for i in range(layout.num_layers) if i not in layout.swa_layers]
        swa_ids = sorted(layout.swa_layers)

        def part(ids: list[int], pages: int) -> KVPool:
            sub = None if scales is None else tuple(tuple(s[i] for i in ids) for s in scales)
            return KVPool(pages, page_size, len(ids), num_kv_heads, head_dim, dtype, device, scales=sub)

        self.full, self.swa = part(full_ids, num_pages), part(swa_ids, layout.swa_pages(num_pages))
        self._where = {i: (self.full, n) for n, i in enumerate(full_ids)}
        self._where.update({i: (self.swa, n) for n, i in enumerate(swa_ids)})
        self.k = [self._where[i][0].k[self._where[i][1]] for i in range(layout.num_layers)]
        self.v = [self._where[i][0].v[self._where[i][1]] for i in range(layout.num_layers)]
        self.k_scale = tuple(self._where[i][0].k_scale[self._where[i][1]] for i in range(layout.num_layers))
        self.v_scale = tuple(self._where[i][0].v_scale[self._where[i][1]] for i in range(layout.num_layers))
        self.page_size = page_size
        self.num_slots = self.full.num_slots
        self.allocator = self.full.allocator
        self.swa_allocator = self.swa.allocator
        pages = self.full.allocator.num_pages + 1
        self.swa_of = torch.zeros(pages, dtype=torch.int64)  # host: full page -> SWA page (0: none)
        self.slot_map_host = torch.arange(page_size, dtype=torch.int64).repeat(pages)  # every page -> the scratch
        self.slot_map = self.slot_map_host if device.type == "cpu" else self.slot_map_host.to(device)

    @property
    def capacity_tokens(self) -> int:
        return self.full.capacity_tokens

    @property
    def swa_capacity_tokens(self) -> int:
        return self.swa.capacity_tokens

    def is_swa(self, layer: int) -> bool:
        return layer in self.layout.swa_layers

    # ---- pairing (the cache manager's sliding-window policy calls these) -------------------------------------------
    def pair(self, full_pages: torch.Tensor, swa_pages: torch.Tensor) -> None:
        """Full pages `full_pages` (host int64, unpaired) take SWA partners `swa_pages`."""
        self.swa_of[full_pages] = swa_pages
        self._remap(full_pages, swa_pages)

    def unpair(self, full_pages: torch.Tensor) -> torch.Tensor:
        """Drop the partners of `full_pages` (host int64, paired); returns those SWA pages (the caller frees them)."""
        swa_pages = self.swa_of[full_pages].clone()
        self.swa_of[full_pages] = 0
        self._remap(full_pages, torch.zeros_like(full_pages))
        return swa_pages

    def move_partners(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Full pages `dst` (unpaired) take the partners of `src` (paired), which lose them."""
        self.pair(dst, self.unpair(src))

    def _remap(self, full_pages: torch.Tensor, swa_pages: torch.Tensor) -> None:
        if not len(full_pages):
            return
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        slots = (full_pages[:, None] * self.page_size + offsets).reshape(-1)
        values = (swa_pages[:, None] * self.page_size + offsets).reshape(-1)
        self.slot_map_host[slots] = values
        if self.slot_map is not self.slot_map_host:
            packed = pinned_copy(torch.cat([slots, values]))
            s, v = packed.to(self.slot_map.device, non_blocking=True).chunk(2)
            self.slot_map[s] = v

    def translate(self, slots: torch.Tensor) -> torch.Tensor:
        """Host full slots -> their SWA slots now (for the SWA page table)."""
        return self.slot_map_host[slots]

    # ---- the KVPool interface ---------------------------------------------------------------------------------------
    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        pool, i = self._where[layer]
        pool.write(i, self._slots(layer, loc), k, v)

    def read(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pool, i = self._where[layer]
        return pool.read(i, self._slots(layer, slots), dtype)

    def write_rotated(self, layer: int, loc: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      rope) -> torch.Tensor:
        pool, i = self._where[layer]  # (a sliding layer's slots looked up inside the fused kernel's launch)
        return pool.write_rotated(i, loc, q, k, v, rope, self.slot_map if layer in self.layout.swa_layers else None)

    def _slots(self, layer: int, full_slots: torch.Tensor) -> torch.Tensor:
        """A sliding layer's slots for full slots (a device gather: CUDA graphs capture it, reading the map live)."""
        return self.slot_map[full_slots] if layer in self.layout.swa_layers else full_slots

    def copy_page_prefix(self, src: int, dst: int, n: int) -> None:
        """Slots [0, n) of full page src into dst, and of src's SWA partner into dst's (both paired)."""
        a, b = int(self.swa_of[src]), int(self.swa_of[dst])
        assert a and b, "a page prefix copy between pages without SWA partners"
        self.full.copy_page_prefix(src, dst, n)
        self.swa.copy_page_prefix(a, b, n)

    def buffers(self) -> list[torch.Tensor]:
        return self.full.buffers() + self.swa.buffers()

    @property
    def page_bytes(self) -> int:
        raise NotImplementedError("a hybrid SWA pool has pages of two sizes: nothing that copies whole pages "
                                  "(host tier, PD transfers) runs with it")
