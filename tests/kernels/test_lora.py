"""The multi-LoRA kernels (kernels.lora) against their plain-torch twin: rows of several adapters, rows without one
(slot -1), slots no row uses, fused modules of one to three projections whose widths are not multiples of a column
block, ranks below the stacks' (zero-padded) rank, K split over several programs, float32 and bfloat16. In Triton's
interpreter without CUDA (small shapes), on the GPU with it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from radixmesh.kernels.lora import (lora_apply, lora_apply_reference, lora_layout, lora_shrink,
                                    lora_shrink_reference)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bfloat16: the kernel rounds where the twin does, but sums in another order, so a rounded intermediate may sit one
# ulp away (times the next product); float32: the order of the sums only
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def make_case(rows: int, k: int, widths: list[int], slots: int, rank: int, dtype: torch.dtype, seed: int,
              used: list[int] | None = None):
    """Random x, stacks a [S, P * R, K] and b [S, N, R], scalings, each row's slot (from `used`, with -1 rows), the
    output before the adapters, and the projections' (start, width)."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(widths)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    a = (torch.randn(slots, len(widths) * rank, k, generator=gen) * k ** -0.5).to(dtype)
    b = (torch.randn(slots, n, rank, generator=gen) * rank ** -0.5).to(dtype)
    scalings = torch.rand(slots, generator=gen) * 2
    choices = torch.tensor((used if used is not None else list(range(slots))) + [-1])
    row_slots = choices[torch.randint(0, len(choices), (rows,), generator=gen)].to(torch.int32)
    out = torch.randn(rows, n, generator=gen).to(dtype)
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return x, a, b, scalings, row_slots, out, list(zip(starts, widths))


def on(device, *tensors):
    return [t.to(device) for t in tensors]


def test_the_layout_groups_rows_by_slot_in_whole_tiles():
    slots = torch.tensor([2, -1, 0, 2, 2, -1, 0, 3, 2], dtype=torch.int32)
    layout = lora_layout(slots.to(DEVICE), num_slots=5, block_m=2)
    order, start, count, tile_end = (t.cpu().tolist() for t in layout[:4])
    assert sorted(order) == list(range(9))
    assert count == [2, 0, 4, 1, 0] and start == [0, 2, 2, 6, 7]
    for s in range(5):  # each slot's rows together, in row order; rows without an adapter last
        assert order[start[s]:start[s] + count[s]] == [i for i, x in enumerate(slots.tolist()) if x == s]
    assert order[7:] == [1, 5]
    assert tile_end == [1, 1, 3, 4, 4]  # cdiv(count, 2) tiles per slot, cumulative
    assert layout.max_tiles >= tile_end[-1]
    # what the kernels read: per tile, its slot and its rows (-1 past them); tiles past those in use: slot 5
    table = layout.tiles.cpu().tolist()
    assert layout.tiles.dtype == torch.int32 and len(table) == layout.max_tiles
    assert table[:4] == [[0, 2, 6], [2, 0, 3], [2, 4, 8], [3, 7, -1]]
    assert all(t == [5, -1, -1] for t in table[4:])


def test_the_tile_table_of_no_rows_and_of_rows_without_adapters():
    none = lora_layout(torch.empty(0, dtype=torch.int32, device=DEVICE), 3)
    assert none.tiles.cpu().tolist() == [[3] + [-1] * 16] * 3
    layout = lora_layout(torch.full((5,), -1, dtype=torch.int32, device=DEVICE), 2)
    assert layout.tiles.cpu().tolist() == [[2] + [-1] * 16] * 3  # cdiv(5, 16) + 2 tiles, none in use


@pytest.mark.parametrize("rows,k,widths,slots,rank,used", [
    (1, 64, [48], 2, 16, [1]),  # one row (batch-1 decode), one projection
    (37, 96, [40, 24, 24], 4, 8, None),  # q/k/v of uneven widths, rank 8 in tiles of 16
    (50, 512, [72, 72], 3, 16, [0, 2]),  # gate/up, a slot no row uses, K split over programs, a slot past a tile
    (20, 80, [33], 1, 4, [0]),  # one slot (max_loras_per_batch 1), width not a multiple of the column block
    (9, 64, [200, 72, 72], 3, 16, None),  # a projection over several column blocks, the next ones after it
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_lora_apply_matches_the_twin(rows, k, widths, slots, rank, used, dtype):
    x, a, b, scalings, row_slots, out, slices = make_case(rows, k, widths, slots, rank, dtype, seed=rows + k,
                                                          used=used)
    want = lora_apply_reference(x, a, b, scalings, row_slots, slices, out.clone())
    dx, da, db, dsc, dslots, dout = on(DEVICE, x, a, b, scalings, row_slots, out)
    got = lora_apply(dx, da, db, dsc, lora_layout(dslots, slots), slices, dout)
    assert got.data_ptr() == dout.data_ptr()  # in place
    torch.testing.assert_close(got.cpu(), want, **TOLERANCE[dtype])
    base = row_slots < 0
    assert torch.equal(got.cpu()[base], out[base])  # rows without an adapter untouched


def test_prefill_tiles_of_64_rows_match_the_twin():
    """Prefills (1024 rows and more) run tiles of 64 rows, K split only to fill the GPU, a column block a program."""
    x, a, b, scalings, row_slots, out, slices = make_case(150, 320, [160, 40, 40], 3, 8, torch.bfloat16, seed=4)
    want = lora_apply_reference(x, a, b, scalings, row_slots, slices, out.clone())
    dx, da, db, dsc, dslots, dout = on(DEVICE, x, a, b, scalings, row_slots, out)
    layout = lora_layout(dslots, 3, block_m=64)
    torch.testing.assert_close(lora_apply(dx, da, db, dsc, layout, slices, dout).cpu(), want,
                               **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("block_n,per_program,warps", [(64, 1, 4), (32, 2, 2), (256, 1, 8)])
def test_the_expand_tilings_add_the_same_sums(block_n, per_program, warps):
    """The expand's tiling (columns a step, column blocks a program, warps; benchmarks.lora_kernels sweeps them)
    changes which program adds what, not the sums: each equals the default tiling's bit for bit (bfloat16, q/k/v of
    uneven widths over several column blocks, rows without an adapter)."""
    from radixmesh.kernels.lora import lora_expand

    x, a, b, scalings, row_slots, out, slices = make_case(37, 96, [300, 24, 72], 4, 8, torch.bfloat16, seed=5)
    dx, da, db, dsc, dslots, dout = on(DEVICE, x, a, b, scalings, row_slots, out)
    layout = lora_layout(dslots, 4)
    partials = lora_shrink(dx, da, layout)
    want = lora_expand(partials, db, dsc, layout, slices, dout.clone())
    got = lora_expand(partials, db, dsc, layout, slices, dout.clone(), block_n=block_n, per_program=per_program,
                      num_warps=warps)
    assert torch.equal(got, want)
    torch.testing.assert_close(want.cpu(), lora_apply_reference(x, a, b, scalings, row_slots, slices, out.clone()),
                               **TOLERANCE[torch.bfloat16])


def test_partial_sums_summed_by_the_shrink_expand_to_the_same_bits():
    """kernels.lora.REDUCE_DECODE_PARTIALS: the shrink sums its K parts itself in the expand's order, so the expand over
    [1, rows, PR] writes what it writes over the parts (bfloat16, K split in 4)."""
    from radixmesh.kernels.lora import lora_expand, lora_sum_partials

    x, a, b, scalings, row_slots, out, slices = make_case(40, 1024, [96, 64], 3, 16, torch.bfloat16, seed=6)
    dx, da, db, dsc, dslots, dout = on(DEVICE, x, a, b, scalings, row_slots, out)
    layout = lora_layout(dslots, 3)
    parts = lora_shrink(dx, da, layout, reduce=False)
    summed = lora_shrink(dx, da, layout, reduce=True)
    assert parts.shape[0] == 4 and summed.shape == (1, *parts.shape[1:])
    rows = (row_slots >= 0).nonzero().squeeze(1).to(DEVICE)  # (the parts of rows without an adapter are not written)
    assert torch.equal(summed[0, rows], lora_sum_partials(parts)[0, rows])
    want = torch.zeros_like(parts[0, rows])
    for part in parts[:, rows]:
        want += part
    assert torch.equal(summed[0, rows], want)
    assert torch.equal(lora_expand(summed, db, dsc, layout, slices, dout.clone()),
                       lora_expand(parts, db, dsc, layout, slices, dout.clone()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_shrinks_partial_sums_add_up_to_the_twins_product(dtype):
    x, a, _, _, row_slots, _, _ = make_case(30, 640, [16, 16], 3, 8, dtype, seed=3)
    dx, da, dslots = on(DEVICE, x, a, row_slots)
    partials = lora_shrink(dx, da, lora_layout(dslots, 3), reduce=False)
    assert partials.shape[0] > 1 and partials.dtype == torch.float32  # split along K
    got = partials.sum(0).to(dtype).cpu()
    want = lora_shrink_reference(x, a, row_slots, rank_stride=8)
    has = row_slots >= 0
    torch.testing.assert_close(got[has], want[has], **TOLERANCE[dtype])


def test_no_adapter_rows_leave_the_output_bit_for_bit():
    x, a, b, scalings, _, out, slices = make_case(24, 64, [32, 16], 2, 16, torch.bfloat16, seed=5)
    none = torch.full((24,), -1, dtype=torch.int32)
    dx, da, db, dsc, dslots, dout = on(DEVICE, x, a, b, scalings, none, out)
    assert torch.equal(lora_apply(dx, da, db, dsc, lora_layout(dslots, 2), slices, dout).cpu(), out)


def test_the_twin_cut_to_each_rank_equals_the_zero_padded_stacks():
    """Ranks below the stacks' are zero-padded: cut or not, the products agree (float32, up to the sums' order)."""
    x, a, b, scalings, row_slots, out, slices = make_case(16, 64, [24, 8], 3, 8, torch.float32, seed=9)
    ranks = [2, 8, 5]
    for s, r in enumerate(ranks):  # slot s has rank r: A's rows and B's columns past it are zero
        for p in range(len(slices)):
            a[s, p * 8 + r:(p + 1) * 8] = 0
        b[s, :, r:] = 0
    cut = lora_apply_reference(x, a, b, scalings, row_slots, slices, out.clone(), ranks)
    padded = lora_apply_reference(x, a, b, scalings, row_slots, slices, out.clone())
    torch.testing.assert_close(cut, padded, rtol=1e-6, atol=1e-6)
    assert not torch.equal(cut, out)


def test_the_layout_and_the_twin_import_without_triton():
    """The CPU images ship without Triton (docker/Dockerfile): the engine's CPU path must not need it."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from radixmesh.kernels.lora import lora_apply_reference, lora_layout\n"
            "assert lora_layout(torch.tensor([1, -1, 0]), 2).order.tolist() == [2, 0, 1]\n")
    subprocess.run([sys.executable, "-c", code], check=True)
