"""Flatten the request-to-token table into the ragged KV index list paged attention kernels take.

Request b's KV slots are row `req_pool_indices[b]` of the table, columns [0, seq_lens[b]); they go to
kv_indices[kv_indptr[b] : kv_indptr[b] + seq_lens[b]]. With pages of one token (how the FlashInfer backend views the
pool) these slots are the page indices. Everything stays on the device: the lengths are read by the kernel, so
building the list never waits for the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # slots one program copies per loop step


@triton.jit
def _kv_indices_kernel(table_ptr, rows_ptr, lens_ptr, indptr_ptr, out_ptr, table_stride, BLOCK: tl.constexpr):
    # One program per request: copies table[row, :seq_len] to out[indptr[b]:], narrowing int64 slots to int32.
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b).to(tl.int64)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    start = tl.load(indptr_ptr + b).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    for off in range(0, seq_len, BLOCK):
        mask = off + cols < seq_len
        slots = tl.load(table_ptr + row * table_stride + off + cols, mask=mask)
        tl.store(out_ptr + start + off + cols, slots.to(tl.int32), mask=mask)


def build_kv_indices(table: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                     kv_indptr: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """table [rows, row_len] int64; req_pool_indices, seq_lens [batch]; kv_indptr [batch + 1] (exclusive prefix sums
    of seq_lens); out int32 with at least kv_indptr[-1] elements. Writes each request's slots into `out` (nothing
    else) and returns it. All tensors on one device."""
    if table.stride(1) != 1:
        raise ValueError("the request-to-token table must be contiguous along its rows")
    batch = req_pool_indices.shape[0]
    if batch:
        _kv_indices_kernel[(batch,)](table, req_pool_indices, seq_lens, kv_indptr, out, table.stride(0),
                                     BLOCK=_BLOCK)
    return out


def build_kv_indices_reference(table: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                               kv_indptr: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Plain-torch twin of build_kv_indices (reads the lengths on the host)."""
    for row, n, start in zip(req_pool_indices.tolist(), seq_lens.tolist(), kv_indptr.tolist()):
        out[start:start + n] = table[row, :n].to(torch.int32)
    return out


TREE_SPAN = 64  # keys of a draft tree's span a row's bits cover (engine.speculative.tree.MAX_TREE_KEYS)


def build_tree_kv_indices(table: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                          tree: torch.Tensor, kv_indptr: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The page lists of a draft tree's decode rows (engine.batch.ForwardBatch.tree_mask): row b lists the slots it
    sees, table[row, :start_b], then table[row, start_b + i] for each bit i of bits_b with start_b + i < seq_lens[b]
    (its ancestors and itself), in that order; a decode kernel over these lists computes the tree mask's attention
    (keys are stored rotated: their order in a list changes no score). tree [2, batch] int64 (start, bits);
    kv_indptr [batch + 1] the exclusive prefix sums of the rows' counts; out int32 with at least kv_indptr[-1] + 1
    elements (the last one is scratch for the bits not taken; engine.speculative.tree.tree_row_keys counts a row's
    keys on the host). Device ops of fixed shapes: the host never waits."""
    start, bits = tree[0], tree[1]
    if table.is_cuda:
        build_kv_indices(table, req_pool_indices, start, kv_indptr, out)
    else:
        build_kv_indices_reference(table, req_pool_indices, start, kv_indptr, out)
    cols = torch.arange(TREE_SPAN, device=table.device)
    index = start[:, None] + cols  # [batch, 64] table columns of the span
    seen = (((bits[:, None] >> cols) & 1) != 0) & (index < seq_lens[:, None])
    dest = kv_indptr[:-1, None].to(torch.int64) + start[:, None] + seen.cumsum(1) - 1
    dest = torch.where(seen, dest, out.numel() - 1)
    src = table[req_pool_indices[:, None], index.clamp(max=table.shape[1] - 1)]
    out[dest.reshape(-1)] = src.reshape(-1).to(torch.int32)
    return out

