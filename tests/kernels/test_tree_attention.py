"""Decode attention under a draft tree's mask (batch.ForwardBatch.tree_mask): each row sees its request's keys before
its span and, in the span, the keys whose bits it holds. The Triton kernel (interpreter on CPU) and its plain-torch
twin against an independent computation over the listed keys, and the torch_native backend's mask; the page lists
FlashInfer's decode kernel reads instead of a mask (kernels.kv_indices.build_tree_kv_indices) hold those keys."""

from __future__ import annotations

import pytest
import torch

from radixmesh.kernels.decode_attention import decode_attention, decode_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # a compiled kernel on a GPU, Triton's interpreter on CPU


def _triton(q, k, v, table, rows, lens, scale, splits, tree=None) -> torch.Tensor:
    """kernels.decode_attention where it runs (a compiled kernel reads device memory only: on an H200 these cases
    failed on host tensors, 2026-12-05), its output back on the host."""
    on = [t.to(DEVICE) for t in (q, k, v, table, rows, lens)]
    return decode_attention(*on, scale, splits, tree=None if tree is None else tree.to(DEVICE)).cpu()


def _tree_case(seed: int, prefix: int, parents: list[int], heads=4, kv_heads=2, dim=32):
    """A pool holding one request: `prefix` keys, then a tree of len(parents) + 1 nodes (node 0 the root); one row
    per node, its span starting at the root."""
    gen = torch.Generator().manual_seed(seed)
    n = len(parents) + 1
    slots = 256
    k_buf = torch.randn(slots, kv_heads, dim, generator=gen)
    v_buf = torch.randn(slots, kv_heads, dim, generator=gen)
    table = torch.zeros((2, 128), dtype=torch.int64)
    table[0, :prefix + n] = torch.randperm(slots - 1, generator=gen)[:prefix + n] + 1  # shuffled slots
    seen = [1]
    for i, p in enumerate(parents, start=1):
        seen.append(seen[p] | (1 << i))
    q = torch.randn(n, heads, dim, generator=gen)
    rows = torch.zeros(n, dtype=torch.int64)
    lens = torch.tensor([prefix + j + 1 for j in range(n)])
    tree = torch.tensor([[prefix] * n, [b - (1 << 64) if b >= 1 << 63 else b for b in seen]], dtype=torch.int64)
    return q, k_buf, v_buf, table, rows, lens, tree, seen


def _direct(q, k_buf, v_buf, table, prefix, seen, scale):
    """Each row over its listed keys: the prefix, then the nodes whose bits it holds."""
    group = q.shape[1] // k_buf.shape[1]
    out = torch.empty_like(q)
    for j, bits in enumerate(seen):
        keys = list(range(prefix)) + [prefix + i for i in range(j + 1) if bits >> i & 1]
        s = table[0, keys]
        kk, vv = k_buf[s].repeat_interleave(group, 1), v_buf[s].repeat_interleave(group, 1)
        w = (torch.einsum("hd,shd->hs", q[j], kk) * scale).softmax(-1)
        out[j] = torch.einsum("hs,shd->hd", w, vv)
    return out


TREES = [[0, 0, 1, 1, 2, 3], [0, 1, 2, 3], [0, 0, 0, 0, 1, 1, 2, 5, 5, 7]]


@pytest.mark.parametrize("parents", TREES)
@pytest.mark.parametrize("prefix", [0, 5, 70])
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_tree_decode_matches_direct(parents, prefix, splits):
    # one KV head of two query heads (still a group of 2): the tree's mask is per row, the same for every KV head's
    # program, and each (row, KV head, split) is a program the interpreter runs in turn
    q, k, v, table, rows, lens, tree, seen = _tree_case(len(parents) + prefix, prefix, parents, heads=2, kv_heads=1)
    scale = 32 ** -0.5
    want = _direct(q, k, v, table, prefix, seen, scale)
    ref = decode_attention_reference(q, k, v, table, rows, lens, scale, tree=tree)
    got = _triton(q, k, v, table, rows, lens, scale, splits, tree=tree)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # causal over the table, what a tree is not: the twin's (the kernel's own causal decode equals it,
    # tests/kernels/test_attention.py), so a kernel that ignored the tree would fail the check above
    plain = decode_attention_reference(q, k, v, table, rows, lens, scale)
    if parents != sorted(range(len(parents))):  # (a chain's mask is causal)
        assert not torch.allclose(plain, want, atol=1e-3)


def test_a_span_of_64_keys_uses_the_sign_bit():
    parents = list(range(63))  # a chain of 64 nodes: the last row holds bit 63
    q, k, v, table, rows, lens, tree, seen = _tree_case(7, 3, parents)
    assert int(tree[1, -1]) < 0
    want = _direct(q, k, v, table, 3, seen, 0.2)
    # the chain's last two rows (bits 0..62 and 0..63): only the last holds bit 63, the one before shows a span that
    # stops short of it; the chain's other rows are spans of under 63 keys, as in the test above (the interpreter
    # runs a program per row, KV head and split)
    last = slice(-2, None)
    got = _triton(q[last], k, v, table, rows[last], lens[last], 0.2, 2, tree=tree[:, last])
    torch.testing.assert_close(got, want[last], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("parents", TREES)
def test_torch_native_tree_mask(parents):
    from radixmesh.engine.attention.base import AttentionShape
    from radixmesh.engine.attention.torch_native import TorchNativeBackend
    from radixmesh.engine.batch import ForwardBatch, ForwardMode
    from radixmesh.engine.cache.kv_pool import KVPool
    from radixmesh.engine.cache.req_to_token import ReqToTokenPool

    prefix = 9
    q, k, v, table, rows, lens, tree, seen = _tree_case(3, prefix, parents)
    pool = KVPool(255, 1, 1, 2, 32, torch.float32, torch.device("cpu"))
    pool.k[0].copy_(k)
    pool.v[0].copy_(v)
    r2t = ReqToTokenPool(2, 128, torch.device("cpu"))
    r2t.device[:2] = table
    backend = TorchNativeBackend(AttentionShape(4, 2, 32, 0.2), pool, r2t)
    n = len(seen)
    locs = table[0, prefix:prefix + n]
    batch = ForwardBatch.build(ForwardMode.DECODE, [0] * n, [prefix] * n, locs, req_pool_indices=[0] * n,
                               seq_lens=lens.tolist(), extend_lens=[1] * n, device=torch.device("cpu"))
    batch.tree_mask = tree
    meta = backend.plan(batch)
    got = backend.forward(0, q, k[locs], v[locs], batch, meta)
    torch.testing.assert_close(got, _direct(q, k, v, table, prefix, seen, 0.2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("parents", [*TREES, list(range(63))])
@pytest.mark.parametrize("prefix", [0, 5, 60])
def test_tree_page_lists_hold_the_keys_each_row_sees(parents, prefix):
    """The lists (and their host-side counts) are _direct's keys row by row, after a padding row (span start 1, bit
    0, seq_len 1: its one key) and before a row whose span runs past its seq_len (bits past it are not keys)."""
    from radixmesh.engine.speculative.tree import tree_row_keys
    from radixmesh.kernels.kv_indices import build_tree_kv_indices

    _, _, _, table, rows, lens, tree, seen = _tree_case(11, prefix, parents)
    table[1, :4] = torch.tensor([40, 41, 42, 43])
    rows = torch.cat([torch.tensor([1]), rows, torch.tensor([1])])
    lens = torch.cat([torch.tensor([1]), lens, torch.tensor([2])])
    tree = torch.cat([torch.tensor([[1], [1]]), tree, torch.tensor([[1], [0b111]])], dim=1)  # last: sees keys 0, 1
    want = [[40]] + [table[0, list(range(prefix)) + [prefix + i for i in range(j + 1) if bits >> i & 1]].tolist()
                     for j, bits in enumerate(seen)] + [[40, 41]]
    counts = [tree_row_keys(int(s), int(b), int(n)) for s, b, n in zip(tree[0], tree[1], lens)]
    assert counts == [len(w) for w in want]
    indptr = torch.tensor([0, *counts]).cumsum(0)
    out = torch.full((int(indptr[-1]) + 1,), -7, dtype=torch.int32)
    build_tree_kv_indices(table, rows, lens, tree, indptr, out)
    assert [out[a:b].tolist() for a, b in zip(indptr[:-1], indptr[1:])] == want


@pytest.mark.parametrize("window", [4, 9, 40])
def test_a_tree_row_s_window_counts_back_from_its_position(window):
    """Under a sliding window a tree row at depth d (position prefix + d, table index prefix + its node number) sees
    the prefix keys after its position - window and its ancestors: the Triton kernel and its twin against _direct's
    lists cut by position. (A window counted from the table index would drop prefix keys the row's position shows.)"""
    parents = [0, 0, 1, 1, 2, 3]
    prefix = 30
    q, k, v, table, rows, lens, tree, seen = _tree_case(5, prefix, parents, heads=2, kv_heads=1)
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    positions = torch.tensor([prefix + d for d in depth])
    group, scale = 2, 32 ** -0.5
    want = torch.empty_like(q)
    for j, bits in enumerate(seen):
        keys = [i for i in range(prefix) if i > prefix + depth[j] - window]
        keys += [prefix + i for i in range(j + 1) if bits >> i & 1]
        s = table[0, keys]
        kk, vv = k[s].repeat_interleave(group, 1), v[s].repeat_interleave(group, 1)
        w = (torch.einsum("hd,shd->hs", q[j], kk) * scale).softmax(-1)
        want[j] = torch.einsum("hs,shd->hd", w, vv)
    ref = decode_attention_reference(q, k, v, table, rows, lens, scale, window=window, tree=tree, positions=positions)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)
    on = [t.to(DEVICE) for t in (q, k, v, table, rows, lens)]
    got = decode_attention(*on, scale, 2, window=window, tree=tree.to(DEVICE), positions=positions.to(DEVICE)).cpu()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="needs its rows' positions"):
        decode_attention(*on, scale, 2, window=window, tree=tree.to(DEVICE))
