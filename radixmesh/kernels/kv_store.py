"""Scatter of one layer's new K and V into the paged KV pool in one Triton launch, and its plain-torch twin."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels.runtime import pdl_enter, pdl_options

_MIN_PROGRAMS = 528  # 4 programs per SM of a 132-SM H100: few tokens get fewer heads per program, down to 1
_MAX_TILE = 2048  # elements of K (and as many of V) per program with many tokens


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, num_kv_heads,
                     k_stride_tok, k_stride_head, v_stride_tok, v_stride_head,
                     kc_stride_slot, kc_stride_head, vc_stride_slot, vc_stride_head,
                     HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, STORE_V: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_enter(PDL)
    # Grid (tokens, cdiv(num_kv_heads, BLOCK_H)): token t's heads [b * BLOCK_H, ...) go to slot loc[t] of both caches.
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (heads < num_kv_heads)[:, None] & (d < HEAD_DIM)[None, :]
    slot = tl.load(loc_ptr + tok).to(tl.int64)
    k = tl.load(k_ptr + tok * k_stride_tok + heads[:, None] * k_stride_head + d[None, :], mask=mask)
    tl.store(k_cache_ptr + slot * kc_stride_slot + heads[:, None] * kc_stride_head + d[None, :], k, mask=mask)
    if STORE_V:
        v = tl.load(v_ptr + tok * v_stride_tok + heads[:, None] * v_stride_head + d[None, :], mask=mask)
        tl.store(v_cache_ptr + slot * vc_stride_slot + heads[:, None] * vc_stride_head + d[None, :], v, mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor | None, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor | None) -> None:
    """Writes k, v [n, num_kv_heads, head_dim] into rows `loc` [n] (int) of k_cache, v_cache
    [num_slots, num_kv_heads, head_dim], in place; v_cache and v None: k alone (a latent cache, whose value is its
    key). Where a slot repeats in `loc` (padding tokens share scratch slot 0), one unspecified token's K and V win, as
    with index assignment."""
    store_v = v_cache is not None
    if not store_v:
        v_cache, v = k_cache, k  # (checked as a pair, never stored)
    check_store(k_cache, v_cache, loc, k, v)
    n, num_kv_heads, head_dim = k.shape
    if n == 0:
        return
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    block_d = triton.next_power_of_2(head_dim)
    block_h = _heads_per_program(n, num_kv_heads, block_d)
    _store_kv_kernel[(n, triton.cdiv(num_kv_heads, block_h))](
        k, v, k_cache, v_cache, loc, num_kv_heads, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, STORE_V=store_v,
        num_warps=max(1, min(8, block_h * block_d * k.element_size() // (16 * 32))), **pdl_options(k))


def check_store(k_cache, v_cache, loc, k, v) -> None:
    """ValueError unless k, v [n, kv_heads, head_dim] and loc [n] fit the pools k_cache, v_cache."""
    if k_cache.dim() != 3 or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be equal 3-d pools")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV caches need a unit stride in head_dim (KVPool allocates them contiguous)")
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[1:] or k.dtype != k_cache.dtype or v.dtype != k.dtype:
        raise ValueError(f"k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} {v.dtype} do not fit the pool "
                         f"{tuple(k_cache.shape)} {k_cache.dtype}")
    if loc.shape != k.shape[:1] or loc.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"loc must be int [{k.shape[0]}], got {tuple(loc.shape)} {loc.dtype}")
    if len({t.device for t in (k_cache, v_cache, loc, k, v)}) != 1:
        raise ValueError("k_cache, v_cache, loc, k and v must be on one device")


def _heads_per_program(n_tokens: int, num_kv_heads: int, block_d: int) -> int:
    """All heads of a token per program (up to _MAX_TILE elements), halved while the grid is too small."""
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_TILE // block_d))
    while block_h > 1 and n_tokens * triton.cdiv(num_kv_heads, block_h) < _MIN_PROGRAMS:
        block_h //= 2
    return block_h


def store_kv_reference(k_cache: torch.Tensor, v_cache: torch.Tensor | None, loc: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor | None) -> None:
    """The twin of `store_kv`: engine.cache.kv_pool.KVPool.write, op for op."""
    k_cache[loc] = k
    if v_cache is not None:
        v_cache[loc] = v
