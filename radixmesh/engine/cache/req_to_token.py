"""Request-to-token table: row r, column i holds the KV slot of token i of the request that owns row r."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """A host copy (for the scheduler and the radix tree) and a device copy (for attention kernels) kept equal.

    On a GPU the device copy has one more row, `pad_row`, never handed out and all zeros (slot 0 of the scratch
    page): padding rows of CUDA-graph batches point at it. Host-to-device updates are non-blocking copies from
    pinned memory, so they never wait for the GPU (overlap scheduling depends on that).
    """

    def __init__(self, rows: int, row_len: int, device: torch.device):
        self.row_len = row_len
        self.host = torch.zeros((rows, row_len), dtype=torch.int64)
        self.device = self.host if device.type == "cpu" else torch.zeros((rows + 1, row_len), dtype=torch.int64,
                                                                          device=device)
        self.pad_row = rows
        self._free_rows = list(range(rows - 1, -1, -1))
        # Under tensor parallelism the leader records every write since its last forward, for the followers to
        # replay on their own tables (ModelRunner's step journal); None: not recorded.
        self.journal: list[tuple] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        end = start + len(slots)
        self.host[row, start:end] = slots
        if self.journal is not None:
            self.journal.append(("write", row, start, slots.clone()))
        if self.device is not self.host:
            self.device[row, start:end].copy_(_pinned(slots), non_blocking=True)

    def scatter(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """table[rows[i], cols[i]] = slots[i] for every i (host tensors)."""
        self.host[rows, cols] = slots
        if self.journal is not None:
            self.journal.append(("scatter", rows.clone(), cols.clone(), slots.clone()))
        if self.device is not self.host:
            packed = _pinned(torch.cat([rows, cols, slots.to(torch.int64)]))
            r, c, s = packed.to(self.device.device, non_blocking=True).chunk(3)
            self.device[r, c] = s

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        return self.host[row, start:end]


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """A pinned copy of host tensor `t` (PyTorch's host allocator keeps it alive until the copy from it is done)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)
    return out
