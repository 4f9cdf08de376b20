"""What a CUDA graph replay copies into its static inputs (engine.cuda_graph_runner.CudaGraphRunner.load), checked on
CPU tensors: a decode batch's five rows, a draft tree's mask where the graphs read one (an engine drafting trees), a
span from seq_len on for rows without a tree (every key seen), and padding rows that see only their one key. The
graphs themselves run on GPUs (tests/gpu/test_speculative_cuda.py)."""

from __future__ import annotations

import torch

from radixmesh.engine.batch import ForwardBatch, ForwardMode
from radixmesh.engine.cuda_graph_runner import CudaGraphRunner

PAD_ROW = 9


def _runner(tree: bool) -> CudaGraphRunner:
    return CudaGraphRunner(model=None, backend=None, device=torch.device("cpu"), vocab_size=8, pad_row=PAD_ROW,
                           sizes=[1, 2, 4, 8], tree=tree)


def _decode(n: int, tree: list[list[int]] | None = None) -> ForwardBatch:
    batch = ForwardBatch.build(ForwardMode.DECODE, [11 + i for i in range(n)], [20 + i for i in range(n)],
                               torch.arange(30, 30 + n), req_pool_indices=[i % 2 for i in range(n)],
                               seq_lens=[21 + i for i in range(n)], extend_lens=[1] * n, device=torch.device("cpu"))
    if tree is not None:
        batch.tree_mask = torch.tensor(tree, dtype=torch.int64)
    return batch


def test_a_tree_batch_fills_the_mask_rows_and_pads_to_one_key():
    runner = _runner(tree=True)
    tree = [[20, 20, 20], [1, 3, -(1 << 63) | 5]]  # (the sign bit: the 64th key of a span)
    padded = runner.load(_decode(3, tree))
    assert padded == 4
    s = runner.static[:, :padded].tolist()
    assert s[0] == [11, 12, 13, 0] and s[1] == [20, 21, 22, 0] and s[2] == [30, 31, 32, 0]
    assert s[3] == [0, 1, 0, PAD_ROW] and s[4] == [21, 22, 23, 1]
    assert s[5] == [20, 20, 20, 1] and s[6] == [*tree[1], 1]  # padding: its span starts at its one key, seen


def test_rows_without_a_tree_see_every_key_in_a_tree_engine():
    runner = _runner(tree=True)
    runner.load(_decode(3, [[5, 5, 5], [1, 1, 1]]))  # a tree's mask left in the static rows
    padded = runner.load(_decode(2))
    s = runner.static[:, :padded].tolist()
    assert s[5] == s[4] == [21, 22]  # the span starts at seq_len: every key before it is seen


def test_the_static_batch_carries_the_mask_rows_only_in_a_tree_engine():
    tree, chain = _runner(tree=True), _runner(tree=False)
    assert tree._static_batch(4).tree_mask.data_ptr() == tree.static[5].data_ptr()
    assert tree._static_batch(4).decode_block.shape == (5, 4)
    assert chain._static_batch(4).tree_mask is None and chain.static.shape == (5, 8)


def test_a_tree_batch_never_replays_a_graph_without_the_mask():
    """(A tensor-parallel follower rebuilds its batches with their decode block: the mask must keep it eager.)"""
    masked = _decode(2, [[20, 20], [1, 1]])
    assert not _runner(tree=False).can_run(masked)
    assert _runner(tree=True).can_run(masked)
    assert _runner(tree=False).can_run(_decode(2)) and not _runner(tree=True).can_run(_decode(9))


def test_a_tree_verify_counts_each_rows_keys_and_ships_them_to_followers():
    """build_tree_verify's host-side key counts (what FlashInfer's page lists hold) are tree_row_keys of its mask,
    and a tensor-parallel follower's copy of the batch (packed, unpacked) keeps mask and counts."""
    from radixmesh.engine.request import Req
    from radixmesh.engine.sampling.params import SamplingParams
    from radixmesh.engine.scheduler.batch_builder import build_tree_verify
    from radixmesh.engine.speculative.tree import tree_row_keys

    reqs = []
    for i, n in enumerate((7, 30)):
        r = Req(rid=str(i), input_ids=list(range(1, n + 1)), sampling=SamplingParams(), stop_ids=frozenset(),
                sink=lambda out: None)
        r.pool_idx, r.kv_len, r.extend_len = i, n - 1, 5
        reqs.append(r)
    trees = [([5, 6, 7, 8], [0, 0, 1, 3]), ([9, 10], [0, 1])]  # (a request's tree may be smaller than its slots)
    batch = build_tree_verify(reqs, trees, torch.arange(100, 110), torch.device("cpu"), width=6)
    mask = batch.tree_mask.tolist()
    assert batch.tree_keys_host == [tree_row_keys(s, b, n) for s, b, n in zip(*mask, batch.seq_lens_host)]
    assert batch.tree_keys_host[:6] == [7, 8, 8, 9, 10, 1] and batch.tree_keys_host[6:] == [30, 31, 32, 1, 1, 1]
    header, packed = batch.packed()
    copy = ForwardBatch.unpacked(header, packed)
    assert copy.tree_keys_host == batch.tree_keys_host and torch.equal(copy.tree_mask, batch.tree_mask)
