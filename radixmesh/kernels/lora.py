"""Multi-LoRA products over a batch whose rows use different adapters: Triton's segmented shrink and expand, and
their plain-torch twin.

A projection with adapters adds, to each row i of its output, (x_i A_s^T) B_s^T * scaling_s for the adapter slot
s = slots[i] of that row (slot -1: no adapter, the row is left alone). The weights of every slot are stacks of a
fixed size, so a CUDA graph captured once reads whichever adapters its slots name on each replay:

    a         [S, P * R, K]  per slot, the A of each of the P projections fused in the module (q, k, v; gate, up; or
                             one), R rows each (R: the largest rank; an adapter of a lower rank has zero rows past it)
    b         [S, N, R]      per slot, B of every output column (columns of projection p: its slice (start, width))
    scalings  [S]            float32, per slot

`lora_layout` groups the rows by slot without a host round trip and with shapes fixed by the row count: `order` lists
the rows slot by slot, and each slot's rows are cut into tiles of BLOCK_M; a program takes one tile and so one slot's
weights (the tile list's length is bounded by cdiv(rows, BLOCK_M) + S; programs past the tiles in use exit at once).
Each tile's slot and rows are written out as one row of a table, so that a program learns them in one round trip
to memory (a decode step's LoRA kernels are chains of dependent loads on the step's critical path: H100 profile,
benchmarks/results/NOTES.md, 2026-12-05).

`lora_shrink` computes x A^T for the tiles, split along K so that a decode batch of a few tiles still fills the GPU:
float32 partial sums [SPLIT, rows, P * R] (or, asked to, their sum [1, rows, P * R]: `lora_sum_partials`).
`lora_expand` sums the partials, rounds them to the activations' dtype (as the twin's product is rounded), multiplies
by B^T (rounded), scales (rounded) and adds into the output columns of each projection, in place: the twin's
roundings one for one, with sums in another order.

A decode batch's tiling is what measured fastest on an H100 (benchmarks.lora_kernels, 8B shape, 8 adapters of rank
16 at batch 64; benchmarks/results/NOTES.md, 2026-12-06): the shrink sums its K parts in a kernel of its own, and each
expand program takes one tile and one block of 128 columns (3.5 us a kernel, against 9.2 for the best tiling over
the K parts and 5.3 for an expand that ordered rows without tiles by slot, since dropped).

The twin (`lora_apply_reference`) computes the same per slot with torch's products; given each slot's rank it cuts A
and B to it, which is peft's arithmetic exactly (the CPU engine's parity with peft in float32 rests on it).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

try:  # the layout and the twin need torch only: the CPU images ship without Triton (docker/Dockerfile)
    import triton
    import triton.language as tl

    from radixmesh.kernels.runtime import dot_needs_upcast, pdl_enter, pdl_options

    jit = triton.jit
except ImportError:
    triton = tl = None

    def jit(fn=None, **_):
        return fn if fn is not None else (lambda f: f)

MAX_PARTS = 3  # projections fused in one module (q, k, v)
_TARGET_PROGRAMS = 264  # two per SM of a 132-SM GPU: a prefill's shrink splits K until its tiles reach this many
_MIN_SPLIT_K = 256  # columns of K per shrink program at the least
DECODE_SPLIT = 16  # a decode-sized batch's shrink splits K in this many parts (fewer where K is short; the expand
# sums them, unrolled)
EXPAND_BLOCK_N = 128  # output columns of one expand step
EXPAND_DECODE_BLOCKS = 1  # column blocks one expand program of a decode-sized batch runs
EXPAND_WARPS = 4
# A decode batch's shrink sums its DECODE_SPLIT partial sums itself, in a kernel of its own after the products (the
# expand's order, so the same bits): each expand program then reads one [BLOCK_M, PR] block instead of DECODE_SPLIT
# (benchmarks.lora --no-reduce-partials turns it off).
REDUCE_DECODE_PARTIALS = True


class LoraLayout(NamedTuple):
    """Rows grouped by adapter slot (device tensors; shapes fixed by the row count and the slot count). The kernels
    read `tiles` alone; the grouping it is made from is kept as computed (int64), with no conversion in the step."""

    order: torch.Tensor  # [rows] the rows, slot by slot (rows without an adapter last)
    seg_start: torch.Tensor  # [S] where slot s's rows begin in `order`
    seg_count: torch.Tensor  # [S] how many rows slot s has
    tile_end: torch.Tensor  # [S] tiles of slots 0..s, cumulative (slot s has cdiv(seg_count[s], block_m) tiles)
    max_tiles: int  # an upper bound of the tiles in use: the programs each launch starts along its first axis
    block_m: int
    # [max_tiles, 1 + block_m] what each program reads first, in one round trip: its tile's slot (S past the tiles in
    # use) and the tile's rows (-1 past its slot's rows); the tiled kernels read nothing else of the layout
    tiles: torch.Tensor


def block_m_for(rows: int) -> int:
    """Rows per tile: 16 (the least a tensor-core dot takes) for decode-sized batches, 64 for prefills."""
    return 16 if rows < 1024 else 64


def lora_layout(slots: torch.Tensor, num_slots: int, block_m: int | None = None) -> LoraLayout:
    """The layout of rows whose adapter slots are `slots` [rows] (int, -1: none), in torch operations of fixed shapes
    (a CUDA graph captures them; the slots may change between replays)."""
    rows = slots.shape[0]
    block_m = block_m or block_m_for(rows)
    dev = slots.device
    key = torch.where(slots < 0, num_slots, slots.to(torch.int64))  # [rows]; num_slots: no adapter
    member = key[None, :] == torch.arange(num_slots + 1, device=dev)[:, None]  # [S + 1, rows]
    counts = member.sum(1)  # [S + 1]
    before = member.cumsum(1).gather(0, key[None, :])[0] - 1  # [rows] earlier rows of the same slot
    pos = (counts.cumsum(0) - counts)[key] + before  # [rows] each row's place in `order`
    order = torch.empty(rows, dtype=torch.int64, device=dev).scatter_(0, pos, torch.arange(rows, device=dev))
    seg_count = counts[:num_slots]
    seg_start = (counts.cumsum(0) - counts)[:num_slots]
    tiles = (seg_count + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    max_tiles = -(-rows // block_m) + num_slots
    return LoraLayout(order, seg_start, seg_count, tile_end, max_tiles, block_m,
                      _tile_table(order, seg_start, seg_count, tile_end, tiles, max_tiles, block_m, num_slots))


def _tile_table(order, seg_start, seg_count, tile_end, tiles, max_tiles: int, block_m: int, num_slots: int
                ) -> torch.Tensor:
    """LoraLayout.tiles from the grouping (int64 device tensors), in torch operations of fixed shapes."""
    dev, rows = order.device, order.shape[0]
    t = torch.arange(max_tiles, device=dev)
    slot = torch.searchsorted(tile_end, t, right=True)  # [T] the slot whose tiles hold tile t; S: none
    used = slot < num_slots
    s = slot.clamp(max=num_slots - 1)
    first = seg_start[s] + (t - (tile_end - tiles)[s]) * block_m  # [T] the tile's first place in `order`
    pos = first[:, None] + torch.arange(block_m, device=dev)[None, :]  # [T, BM]
    valid = used[:, None] & (pos < (seg_start + seg_count)[s][:, None])
    if rows:
        members = torch.where(valid, order[pos.clamp(max=rows - 1)], -1)
    else:
        members = torch.full_like(pos, -1)
    return torch.cat([slot[:, None], members], dim=1).to(torch.int32).contiguous()


@jit
def _tile(tiles_ptr, BLOCK_M: tl.constexpr):
    """This program's tile from LoraLayout.tiles: (its slot, NUM_SLOTS for a tile past those in use; its rows as
    int64, 0 where masked; the mask of its rows), two loads of one row of the table, issued together."""
    base = tiles_ptr + tl.program_id(0).to(tl.int64) * (BLOCK_M + 1)
    s = tl.load(base)
    row = tl.load(base + 1 + tl.arange(0, BLOCK_M))
    m_mask = row >= 0
    return s, tl.where(m_mask, row, 0).to(tl.int64), m_mask


@jit(do_not_specialize=["rows"])  # one compiled kernel for every batch size (CUDA graphs capture many)
def _shrink_kernel(x_ptr, a_ptr, part_ptr, tiles_ptr, rows, K, PR, k_per_split, stride_xm, stride_as, stride_ar,
                   NUM_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    # grid (tiles, SPLIT): partial[split, row, :] = x[row, k range] @ a[slot, :, k range]^T for the tile's rows.
    pdl_enter(PDL)
    s, row, m_mask = _tile(tiles_ptr, BLOCK_M)  # [BLOCK_M] rows
    if s >= NUM_SLOTS:
        return
    r = tl.arange(0, BLOCK_R)
    r_mask = r < PR
    a_rows = a_ptr + s.to(tl.int64) * stride_as + r.to(tl.int64) * stride_ar  # [BLOCK_R]
    k_begin = tl.program_id(1) * k_per_split
    k_stop = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(k_begin, k_stop, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_stop
        x = tl.load(x_ptr + row[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        a = tl.load(a_rows[:, None] + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)  # [R, BLOCK_K]
        if UPCAST:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, tl.trans(a), input_precision=PRECISION)
    out = part_ptr + (tl.program_id(1).to(tl.int64) * rows + row[:, None]) * PR + r[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & r_mask[None, :])


def _split(layout: LoraLayout, k: int) -> int:
    """Programs along K per tile, each with at least _MIN_SPLIT_K columns. Decode-sized batches (tiles of 16 rows):
    DECODE_SPLIT whatever the rows, so that a row's sums are the same in a CUDA graph padded to more rows as in an
    eager forward; prefills: enough for _TARGET_PROGRAMS in all."""
    want = DECODE_SPLIT if layout.block_m == 16 else _TARGET_PROGRAMS // layout.max_tiles
    return max(1, min(want, k // _MIN_SPLIT_K))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, layout: LoraLayout, reduce: bool | None = None) -> torch.Tensor:
    """x [rows, K] (unit column stride), a [S, PR, K] (unit stride along K) -> float32 partial sums
    [SPLIT, rows, PR] of x A_slot^T over SPLIT ranges of K, written for rows with an adapter only; `reduce`
    (default: REDUCE_DECODE_PARTIALS for decode-sized batches) sums them into [1, rows, PR] (lora_sum_partials)."""
    rows, k = x.shape
    num_slots, pr = a.shape[0], a.shape[1]
    if a.shape[2] != k or a.stride(2) != 1 or a.dtype != x.dtype:
        raise ValueError(f"a must be [S, PR, {k}] of {x.dtype} with unit stride along K, got {tuple(a.shape)} "
                         f"{a.dtype} strides {a.stride()}")
    if x.stride(1) != 1:
        x = x.contiguous()
    block_k = 64
    split = _split(layout, k)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    partials = torch.empty((split, rows, pr), dtype=torch.float32, device=x.device)
    if rows == 0:
        return partials
    _shrink_kernel[(layout.max_tiles, split)](
        x, a, partials, layout.tiles, rows, k, pr, k_per_split, x.stride(0), a.stride(0), a.stride(1),
        NUM_SLOTS=num_slots, BLOCK_M=layout.block_m, BLOCK_R=max(16, triton.next_power_of_2(pr)), BLOCK_K=block_k,
        UPCAST=dot_needs_upcast(x.dtype), PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4,
        **pdl_options(x))
    if reduce is None:
        reduce = REDUCE_DECODE_PARTIALS and layout.block_m == 16
    return lora_sum_partials(partials) if reduce and split > 1 else partials


@jit
def _sum_partials_kernel(part_ptr, out_ptr, n, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # out[i] = ((0 + part[0, i]) + part[1, i]) + ... in split order: the expand's own order of the same sums
    pdl_enter(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    acc = tl.zeros([BLOCK], tl.float32)
    for sp in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + sp * n + i, mask=mask, other=0.0)
    tl.store(out_ptr + i, acc, mask=mask)


def lora_sum_partials(partials: torch.Tensor) -> torch.Tensor:
    """[SPLIT, rows, PR] float32 partial sums -> [1, rows, PR], each the sum in split order (so the expand's result is
    the same bit for bit from either)."""
    split, rows, pr = partials.shape
    out = torch.empty((1, rows, pr), dtype=torch.float32, device=partials.device)
    n = rows * pr
    if n:
        block = 1024
        _sum_partials_kernel[(triton.cdiv(n, block),)](partials, out, n, SPLIT=split, BLOCK=block, num_warps=4,
                                                        **pdl_options(partials))
    return out


@jit(do_not_specialize=["rows"])
def _expand_kernel(part_ptr, b_ptr, scale_ptr, out_ptr, tiles_ptr, rows, PR, R, split, num_blocks, stride_bs,
                   stride_bn, stride_om, start0, width0, start1, width1, start2, width2,
                   NUM_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_PR: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   PDL: tl.constexpr, SPLIT: tl.constexpr):
    # grid (tiles, cdiv(column blocks of every projection, BLOCKS)): the tile's partial sums are summed once, then
    # for each of BLOCKS column blocks out[row, cols] += round(round(inter @ B^T) * scaling), where B's tile holds
    # the block's projection's columns in that projection's rows of the partial sums (zero elsewhere).
    pdl_enter(PDL)
    s, row, m_mask = _tile(tiles_ptr, BLOCK_M)  # [BLOCK_M] rows
    if s >= NUM_SLOTS:
        return
    j = tl.arange(0, BLOCK_PR)  # partial-sum columns: projection j // R, rank j % R
    inter = tl.zeros([BLOCK_M, BLOCK_PR], tl.float32)
    inter_ptrs = part_ptr + row[:, None] * PR + j[None, :]
    part_mask = m_mask[:, None] & (j < PR)[None, :]
    if SPLIT > 0:  # a decode batch's split, fixed: unrolled, so that the loads are all in flight at once
        for sp in tl.static_range(SPLIT):
            inter += tl.load(inter_ptrs + sp * rows * PR, mask=part_mask, other=0.0)
    else:  # a prefill's, which varies with its tiles (one compiled kernel for all)
        for sp in range(0, split):
            inter += tl.load(inter_ptrs + sp * rows * PR, mask=part_mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    inter = inter.to(dtype)
    if UPCAST:
        inter = inter.to(tl.float32)
    scale = tl.load(scale_ptr + s)
    b_slot = b_ptr + s.to(tl.int64) * stride_bs
    blocks0 = tl.cdiv(width0, BLOCK_N)
    blocks1 = tl.cdiv(width1, BLOCK_N)
    for i in tl.static_range(BLOCKS):
        nb = tl.program_id(1) * BLOCKS + i
        part = (nb >= blocks0).to(tl.int32) + (nb >= blocks0 + blocks1).to(tl.int32)
        col0 = tl.where(part == 0, start0, tl.where(part == 1, start1, start2))
        width = tl.where(part == 0, width0, tl.where(part == 1, width1, width2))
        width = tl.where(nb < num_blocks, width, 0)  # a block past the last: nothing
        block = nb - tl.where(part == 0, 0, tl.where(part == 1, blocks0, blocks0 + blocks1))
        n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < width
        r = j - part * R  # [BLOCK_PR] rank index in this projection's B, valid in [0, R)
        b = tl.load(b_slot + (col0 + n).to(tl.int64)[:, None] * stride_bn + r[None, :],
                    mask=n_mask[:, None] & ((r >= 0) & (r < R))[None, :], other=0.0)  # [BLOCK_N, BLOCK_PR]
        if UPCAST:
            b = b.to(tl.float32)
        delta = tl.dot(inter, tl.trans(b), input_precision=PRECISION).to(dtype).to(tl.float32)  # [BLOCK_M, BLOCK_N]
        delta = (delta * scale).to(dtype).to(tl.float32)
        out_ptrs = out_ptr + row[:, None] * stride_om + (col0 + n)[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        out = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, (out + delta).to(dtype), mask=mask)


def _check_slices(slices: Sequence[tuple[int, int]], b: torch.Tensor, pr: int) -> None:
    if not 1 <= len(slices) <= MAX_PARTS or pr != len(slices) * b.shape[2]:
        raise ValueError(f"{len(slices)} projections ({MAX_PARTS} at most) of rank {b.shape[2]} do not fit "
                         f"partial sums of {pr} columns")
    if any(start < 0 or width < 1 or start + width > b.shape[1] for start, width in slices):
        raise ValueError(f"slices {list(slices)} fall outside the {b.shape[1]} columns of b")


def lora_expand(partials: torch.Tensor, b: torch.Tensor, scalings: torch.Tensor, layout: LoraLayout,
                slices: Sequence[tuple[int, int]], out: torch.Tensor, block_n: int | None = None,
                per_program: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Adds (sum of partials) B_slot^T * scaling_slot into `out` [rows, N] (unit column stride), in place, for the
    columns (start, width) of each projection; b [S, N, R] (unit stride along R), scalings [S] float32. `block_n`,
    `per_program` (column blocks one program runs; decode-sized batches only) and `num_warps` override the tiling
    (radixmesh.benchmarks.lora_kernels sweeps them)."""
    split, rows, pr = partials.shape
    if b.stride(2) != 1 or b.dtype != out.dtype or out.stride(1) != 1 or out.shape[0] != rows:
        raise ValueError(f"b [S, N, R] of out's dtype with unit stride along R and out [{rows}, N] with unit column "
                         f"stride expected; got b {tuple(b.shape)} {b.dtype} {b.stride()}, out {tuple(out.shape)} "
                         f"{out.dtype} {out.stride()}")
    _check_slices(slices, b, pr)
    if rows == 0:
        return out
    block_n, num_warps = block_n or EXPAND_BLOCK_N, num_warps or EXPAND_WARPS
    flat = [v for start_width in slices for v in start_width] + [0, 0] * (MAX_PARTS - len(slices))
    blocks = sum(triton.cdiv(width, block_n) for _, width in slices)
    per_program = (per_program or EXPAND_DECODE_BLOCKS) if layout.block_m == 16 else 1
    _expand_kernel[(layout.max_tiles, triton.cdiv(blocks, per_program))](
        partials, b, scalings, out, layout.tiles, rows, pr, b.shape[2], split, blocks, b.stride(0), b.stride(1),
        out.stride(0), *flat, NUM_SLOTS=b.shape[0], BLOCK_M=layout.block_m,
        BLOCK_PR=max(16, triton.next_power_of_2(pr)), BLOCK_N=block_n, BLOCKS=per_program,
        UPCAST=dot_needs_upcast(out.dtype), PRECISION="ieee" if out.dtype == torch.float32 else "tf32",
        num_warps=num_warps, SPLIT=split if layout.block_m == 16 else 0, **pdl_options(out))
    return out


def lora_apply(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scalings: torch.Tensor, layout: LoraLayout,
               slices: Sequence[tuple[int, int]], out: torch.Tensor) -> torch.Tensor:
    """`out` [rows, N] plus each row's adapter (x A^T) B^T * scaling, in place (see the module's docstring)."""
    return lora_expand(lora_shrink(x, a, layout), b, scalings, layout, slices, out)


# ---- the twin -------------------------------------------------------------------------------------------------------
def lora_shrink_reference(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, rank_stride: int,
                          ranks: Sequence[int] | None = None) -> torch.Tensor:
    """x A_slot^T [rows, PR] in x's dtype (zero for rows without an adapter): projection p's columns are
    p * rank_stride .. + rank_stride (`ranks` given: only the slot's rank of them are computed, the rest stay zero),
    each the product lora_apply_reference makes."""
    _check_rows(slots, x)
    inter = x.new_zeros((x.shape[0], a.shape[1]))
    for s, rows in _rows_by_slot(slots, x.device):
        r = ranks[s] if ranks is not None else rank_stride
        xs = x[rows]
        for p0 in range(0, a.shape[1], rank_stride):
            inter[rows, p0:p0 + r] = xs @ a[s, p0:p0 + r].T
    return inter


def lora_apply_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scalings: torch.Tensor,
                         slots: torch.Tensor, slices: Sequence[tuple[int, int]], out: torch.Tensor,
                         ranks: Sequence[int] | None = None) -> torch.Tensor:
    """The twin of lora_apply, from each row's slot `slots` [rows] (-1: none): per slot present and projection,
    out[rows, cols] += (x[rows] A^T) B^T * scaling in torch's products (each rounded to the dtype); `ranks` (per
    slot) cuts A and B to the slot's rank, peft's arithmetic exactly."""
    _check_rows(slots, x)
    _check_slices(slices, b, a.shape[1])
    rank_stride = b.shape[2]
    scales = scalings.tolist()
    for s, rows in _rows_by_slot(slots, x.device):
        r = ranks[s] if ranks is not None else rank_stride
        xs = x[rows]
        for p, (start, width) in enumerate(slices):
            inter = xs @ a[s, p * rank_stride:p * rank_stride + r].T
            out[rows, start:start + width] += inter @ b[s, start:start + width, :r].T * scales[s]
    return out


def _check_rows(slots: torch.Tensor, x: torch.Tensor) -> None:
    if slots.dim() != 1 or slots.shape[0] != x.shape[0]:
        raise ValueError(f"slots must be one per row of x ({x.shape[0]}), got {tuple(slots.shape)}")


def _rows_by_slot(slots: torch.Tensor, device: torch.device):
    """(slot, its rows as an index tensor on `device`) for each slot present (not -1), in slot order."""
    slots = slots.cpu()
    for s in sorted(set(slots.tolist()) - {-1}):
        yield s, (slots == s).nonzero().squeeze(1).to(device)
