"""The paged token-to-KV pool and its page allocator.

Slot s holds one token's K and V for every layer; page p owns slots [p * page_size, (p + 1) * page_size).
Page 0 is reserved as a scratch page: padded tokens of a fixed-size batch write their KV there, so it is never handed
out and never counted as capacity.
"""

from __future__ import annotations

import torch

from radixmesh.engine.layers.triton_ops import use_kernels


class PageAllocator:
    """Free list of page ids. Only the cache manager calls `free`."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages  # usable pages, page 0 excluded
        self._free = torch.arange(1, num_pages + 1, dtype=torch.int64)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take n pages, or None (and take nothing) when fewer are free."""
        if n > len(self._free):
            return None
        pages, self._free = self._free[:n], self._free[n:]
        return pages

    def free(self, pages: torch.Tensor) -> None:
        if len(pages):
            self._free = torch.cat([self._free, pages.to(torch.int64)])

    def free_pages(self) -> torch.Tensor:
        return self._free


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class KVPool:
    """Per-layer K and V buffers: [num_slots, num_kv_heads, head_dim] each, on the model's device. An fp8 pool
    (--kv-cache-dtype fp8_*) stores clamp(x / scale) in fp8 and means stored * scale, with one K and one V scale per
    layer (`scales`: engine.quantization.kv_scales.KvScales; default 1.0); a pool of another dtype has no scales.

    `shared_kv` (multi-head latent attention, engine.models.deepseek): a layer's V buffer is its K buffer, one
    tensor: the model writes the same latent as its key and value and reads the value's leading part of the output.
    `buffers()` lists that buffer once a layer, so host copies, the host tier's pages, L3 pages and PD transfers hold
    and move the latent once (`parts` buffers a layer: 2, or 1 for a latent cache)."""

    def __init__(self, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device,
                 scales: tuple[tuple[float, ...], tuple[float, ...]] | None = None, shared_kv: bool = False):
        self.k_scale, self.v_scale = _layer_scales(scales, num_layers, dtype)  # per layer, host floats
        if shared_kv and self.k_scale != self.v_scale:
            raise ValueError("a latent KV cache (K and V one buffer) needs the same K and V scale in every layer")
        self.page_size = page_size
        self.num_slots = (num_pages + 1) * page_size
        shape = (self.num_slots, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = self.k if shared_kv else [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.parts = 1 if shared_kv else 2
        self.allocator = PageAllocator(num_pages)

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_pages * self.page_size

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([num_tokens, num_kv_heads, head_dim]) at slots `loc` ([num_tokens]) of `layer`. An fp8 pool
        (--kv-cache-dtype fp8_*) is written by torch's cast (round to nearest even) of clamp(x / scale), here and on
        the GPU alike: the kernels' own fp8 conversion was not checked to match it (Triton's interpreter does not: it
        rounds ties away and misplaces values near a power of two)."""
        if use_kernels(k) and k.dtype == self.k[layer].dtype:
            from radixmesh.kernels.kv_store import store_kv

            if self.parts == 1:
                store_kv(self.k[layer], None, loc, k, None)  # (the latent once: its value is its key)
            else:
                store_kv(self.k[layer], self.v[layer], loc, k, v)
            return
        self.k[layer][loc] = _stored(k, self.k[layer].dtype, self.k_scale[layer])  # (an fp8 cache rounds here)
        if self.parts == 2:  # (a latent cache's value is its key, one buffer: written once)
            self.v[layer][loc] = _stored(v, self.v[layer].dtype, self.v_scale[layer])

    def latent_rows(self, layer: int, dtype: torch.dtype) -> torch.Tensor | None:
        """`layer`'s buffer ([slots, 1, width]) where a model's kernel may store a step's latent rows itself, as
        `write` would (kernels.mla_absorb): a latent pool of `dtype` (its rows hold what they mean) on the kernels'
        device; None otherwise."""
        buf = self.k[layer]
        return buf if self.parts == 1 and buf.dtype == dtype and use_kernels(buf) else None

    def read(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` at `slots` (any shape S) as [*S, num_kv_heads, head_dim] in `dtype`: what the cache
        means (an fp8 cache's values times its scales; a latent cache's one tensor, read once, as both)."""
        k = _meant(self.k[layer][slots], dtype, self.k_scale[layer])
        return (k, k) if self.parts == 1 else (k, _meant(self.v[layer][slots], dtype, self.v_scale[layer]))

    def write_rotated(self, layer: int, loc: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      rope, slot_map: torch.Tensor | None = None) -> torch.Tensor:
        """Rotary (`rope`: engine.layers.rotary.RopeInputs, with its q/k norm first if it carries one) on q and k,
        then `write` of the rotated k and v at `loc` (at slot_map[loc] with a map); returns the rotated q. Where the
        kernels run, one launch does it all, the map's lookup included (kernels.rotary.rotary_store_kv)."""
        if rope.cos is None and use_kernels(k) and k.dtype == self.k[layer].dtype:  # the kernel rotary path
            from radixmesh.kernels.rotary import rotary_store_kv

            return rotary_store_kv(q, k, v, rope.table.cos, rope.table.sin, rope.positions, self.k[layer],
                                   self.v[layer], loc, qk_norm=rope.qk_norm, slot_map=slot_map, pairs=rope.pairs())
        q, k = rope.apply(q, k)
        self.write(layer, loc if slot_map is None else slot_map[loc], k, v)
        return q

    def copy_page_prefix(self, src: int, dst: int, n: int) -> None:
        """Slots [0, n) of page src into page dst, in every buffer (one launch on CUDA)."""
        a, b = src * self.page_size, dst * self.page_size
        bufs = self.buffers()
        torch._foreach_copy_([t[b:b + n] for t in bufs], [t[a:a + n] for t in bufs])

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The `parts` buffers of `layer`: its K and V, or its one latent buffer."""
        return (self.k[layer], self.v[layer]) if self.parts == 2 else (self.k[layer],)

    def buffers(self) -> list[torch.Tensor]:
        """Every KV buffer, layer by layer (layer 0 K, layer 0 V, layer 1 K, ...; a latent cache's one buffer a
        layer); page p of each is one contiguous byte range."""
        return [t for layer in range(len(self.k)) for t in self.layer_buffers(layer)]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in one buffer: page_size slots of [num_kv_heads, head_dim]."""
        t = self.k[0]
        return self.page_size * t.shape[1] * t.shape[2] * t.element_size()


def _layer_scales(scales, num_layers: int, dtype: torch.dtype) -> tuple[tuple[float, ...], tuple[float, ...]]:
    if scales is None:
        return (1.0,) * num_layers, (1.0,) * num_layers
    k, v = (tuple(float(x) for x in s) for s in scales)
    if len(k) != num_layers or len(v) != num_layers:
        raise ValueError(f"KV cache scales for {len(k)} / {len(v)} layers, but the pool has {num_layers}")
    if dtype not in _FP8 and any(x != 1.0 for x in k + v):
        raise ValueError(f"KV cache scales other than 1.0 apply to an fp8 KV cache only, not to {dtype}")
    return k, v


def _stored(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x [num_tokens, num_kv_heads, head_dim] as the cache stores it: cast; for fp8, clamp(x / scale) to fp8's
    finite range first (beyond it e5m2 would round to inf), divided in float32 so x is rounded once."""
    if dtype not in _FP8:
        return x.to(dtype)
    if scale != 1.0:
        x = x.float() / scale
    bound = torch.finfo(dtype).max
    return x.clamp(-bound, bound).to(dtype)


def _meant(stored: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Stored values in `dtype`, times the scale (fp8 values are exact in every model dtype; the product is rounded
    once)."""
    out = stored.to(dtype)
    return out if scale == 1.0 else out.mul_(scale)
