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
        # A hybrid SWA pool's page table for its sliding layers (engine.cache.swa_pool): every entry written here is
        # also written there, translated by `_to_swa` (full slots -> SWA slots); None: one pool, one table.
        self.swa_device: torch.Tensor | None = None
        self._to_swa = None
        self._swa_layers: frozenset[int] = frozenset()

    def add_swa_table(self, translate, swa_layers: frozenset[int]) -> None:
        """Keep a second table for `swa_layers`: `translate` of every entry written from now on (host int64 slots ->
        host int64 slots). Call before any row is written."""
        self.swa_device = torch.zeros_like(self.device)
        self._to_swa, self._swa_layers = translate, swa_layers

    def table(self, layer: int) -> torch.Tensor:
        """The device table `layer`'s attention reads (a sliding layer of a hybrid pool: the SWA page table)."""
        return self.swa_device if layer in self._swa_layers else self.device

    def window_table(self, window: int | None) -> torch.Tensor:
        """The device table of the layers with `window` (None: full attention)."""
        return self.swa_device if window is not None and self.swa_device is not None else self.device

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
            self.device[row, start:end].copy_(pinned_copy(slots), non_blocking=True)
        if self.swa_device is not None:
            swa = self._to_swa(slots)
            if self.swa_device.is_cuda:
                self.swa_device[row, start:end].copy_(pinned_copy(swa), non_blocking=True)
            else:
                self.swa_device[row, start:end] = swa

    def scatter(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """table[rows[i], cols[i]] = slots[i] for every i (host tensors)."""
        self.host[rows, cols] = slots
        if self.journal is not None:
            self.journal.append(("scatter", rows.clone(), cols.clone(), slots.clone()))
        if self.device is not self.host:
            packed = pinned_copy(torch.cat([rows, cols, slots.to(torch.int64)]))
            r, c, s = packed.to(self.device.device, non_blocking=True).chunk(3)
            self.device[r, c] = s
        if self.swa_device is not None:
            swa = self._to_swa(slots.to(torch.int64))
            if self.swa_device.is_cuda:
                r, c, swa = pinned_copy(torch.cat([rows, cols, swa])).to(self.swa_device.device,
                                                                          non_blocking=True).chunk(3)
                self.swa_device[r, c] = swa
            else:
                self.swa_device[rows, cols] = swa

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        return self.host[row, start:end]


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A pinned copy of host tensor `t` (PyTorch's host allocator keeps it alive until the copy from it is done)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)
    return out
