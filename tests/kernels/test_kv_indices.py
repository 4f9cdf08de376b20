"""The KV index builder against its plain-torch twin: ragged lengths (one token, a whole table row, lengths across
several copy blocks), table rows out of order, and nothing written past each request's range. On CPU it runs in
Triton's interpreter (tests/kernels/conftest.py sets TRITON_INTERPRET before kernels are imported)."""

from __future__ import annotations

import pytest
import torch

from radixmesh.kernels.kv_indices import build_kv_indices, build_kv_indices_reference

# Compiled on a GPU, in Triton's interpreter on CPU.
DEVICES = [pytest.param("cuda" if torch.cuda.is_available() else "cpu", id="here")]


def _case(lens: list[int], row_len: int, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows = len(lens) + 3
    table = torch.randint(0, 1 << 30, (rows, row_len), generator=gen, dtype=torch.int64)
    req_pool_indices = torch.randperm(rows, generator=gen)[:len(lens)]
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = seq_lens.cumsum(0)
    return [t.to(device) for t in (table, req_pool_indices, seq_lens, indptr)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lens", [[1], [5, 1, 2048, 1023, 1025], [3000, 7, 1]], ids=["one", "ragged", "long"])
def test_matches_reference(device, lens):
    table, rows, seq_lens, indptr = _case(lens, row_len=3072, device=device, seed=len(lens))
    total = sum(lens)
    sentinel = -7
    got = torch.full((total + 64,), sentinel, dtype=torch.int32, device=device)
    want = torch.full((total + 64,), sentinel, dtype=torch.int32, device=device)
    build_kv_indices(table, rows, seq_lens, indptr, got)
    build_kv_indices_reference(table, rows, seq_lens, indptr, want)
    assert torch.equal(got.cpu(), want.cpu())
    assert (got[total:] == sentinel).all(), "wrote past the last request's range"
    first = table[rows[0], :lens[0]].to(torch.int32)
    assert torch.equal(got[:lens[0]].cpu(), first.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch_writes_nothing(device):
    table = torch.zeros((2, 8), dtype=torch.int64, device=device)
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    out = torch.full((4,), 3, dtype=torch.int32, device=device)
    build_kv_indices(table, empty, empty, torch.zeros(1, dtype=torch.int32, device=device), out)
    assert (out == 3).all()
