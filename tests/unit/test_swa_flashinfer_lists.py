"""FlashInfer's sliding wrappers get only the keys their window can show (engine.attention.flashinfer_backend): the
lists are the right slices of the request-to-token table, and attention over them with FlashInfer's rule (the query
block aligned to the end of the list, window_left = window - 1 relative to it) equals attention over every key with
transformers' window (key > query - window). FlashInfer itself needs a GPU: tests/gpu/test_sliding_window_cuda.py
runs it; this checks the index arithmetic on CPU."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.attention.flashinfer_backend import _window_indices, window_starts


def _lists(table, rows, seq_lens, extend_lens, window):
    starts = window_starts(seq_lens, extend_lens, window)
    lens = torch.tensor(seq_lens) - starts
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    indptr[1:] = lens.cumsum(0)
    total = int(indptr[-1])
    out = torch.full((total + 5,), -1, dtype=torch.int32)
    _window_indices(table, rows, starts, indptr, out, total)
    assert (out[total:] == -1).all(), "written past the list"
    return starts, indptr, out[:total]


def test_lists_are_the_window_slices_of_each_row():
    table = torch.arange(6 * 50, dtype=torch.int64).reshape(6, 50) + 1000
    rows = torch.tensor([4, 0, 2, 5])
    seq_lens, extend_lens, window = [40, 7, 30, 1], [1, 7, 10, 1], 12
    starts, indptr, got = _lists(table, rows, seq_lens, extend_lens, window)
    assert starts.tolist() == [28, 0, 9, 0]  # decode: the last 12 keys; a prefill from 0; a chunk after 20 cached
    for b, (row, seq) in enumerate(zip(rows.tolist(), seq_lens)):
        want = table[row, starts[b]:seq].to(torch.int32)
        assert torch.equal(got[indptr[b]:indptr[b + 1]], want)


def _attend(q, k, v, visible):
    scores = (q @ k.T).masked_fill(~visible, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("window", [1, 3, 12, 64])
@pytest.mark.parametrize("seq,new", [(40, 1), (40, 10), (9, 9), (5, 1), (30, 25)])
def test_flashinfer_rule_over_the_list_equals_the_window_over_every_key(window, seq, new):
    gen = torch.Generator().manual_seed(seq * 100 + new + window)
    k, v = torch.randn(seq, 8, generator=gen), torch.randn(seq, 8, generator=gen)
    q = torch.randn(new, 8, generator=gen)
    pos = torch.arange(seq - new, seq)[:, None]  # the queries' positions
    keys = torch.arange(seq)[None, :]
    want = _attend(q, k, v, (keys <= pos) & (keys > pos - window))
    start = int(window_starts([seq], [new], window)[0])
    n = seq - start
    local_q = torch.arange(n - new, n)[:, None]  # FlashInfer: query i of `new` sits at n - new + i in the list
    local_k = torch.arange(n)[None, :]
    seen = (local_k <= local_q) & (local_k >= local_q - (window - 1))
    got = _attend(q, k[start:], v[start:], seen)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert seen[0, 0], "the list starts at a key the first query sees: no key is listed for nothing"
