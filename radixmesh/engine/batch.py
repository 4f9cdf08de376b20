"""What one model forward computes: a flat token batch plus the per-request layout attention needs."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # any number of new tokens per request (prefill chunks, mixed with decodes)
    DECODE = "decode"  # exactly one new token per request


@dataclass(slots=True)
class PendingInputs:
    """Input tokens the host does not know yet: sampled by the previous step, still on the device (overlap
    scheduling). Before the forward, input_ids[positions[i]] = source[indices[i]]."""

    positions: torch.Tensor  # [p] int64 flat token indices in this batch
    indices: torch.Tensor  # [p] int64 rows of `source`
    source: torch.Tensor  # [prev_batch] int64 next-token ids of the previous step (device)


@dataclass(slots=True)
class ForwardBatch:
    """Device tensors, plus host copies of the small per-request lists the planner already had.

    Tokens of request b are contiguous in the flat token axis and in position order.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    out_cache_loc: torch.Tensor  # [num_tokens] int64 KV slots the new tokens write
    req_pool_indices: torch.Tensor  # [batch] int64 rows of the req-to-token table
    seq_lens: torch.Tensor  # [batch] int64 KV length of each request after this forward
    extend_lens: torch.Tensor  # [batch] int64 new tokens per request
    logits_indices: torch.Tensor  # [batch] int64 flat index of each request's last new token
    seq_lens_host: list[int]
    extend_lens_host: list[int]
    # [n] int64 flat indices of further tokens whose logits are wanted (prompt logprobs); None when there are none
    extra_logit_indices: torch.Tensor | None = None
    pending: PendingInputs | None = None
    # Decode batches: [5, batch] view over input_ids, positions, out_cache_loc, req_pool_indices, seq_lens.
    decode_block: torch.Tensor | None = None
    # Per request: its LoRA adapter's id (engine.lora.manager; 0: the base model); None: no adapters at all.
    lora_slots: list[int] | None = None
    # Decode rows of a draft tree (engine.speculative.tree): [2, batch] int64, each row's first masked table index
    # and the bits of the keys from there on it sees (keys before it: all); None: every key up to seq_len.
    tree_mask: torch.Tensor | None = None
    # With tree_mask: the keys each row sees (engine.speculative.tree.tree_row_keys), known on the host where the tree
    # was built, for backends that list each row's keys (FlashInfer's page lists)
    tree_keys_host: list[int] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def fill_pending(self) -> None:
        """Write the device-resident input tokens into input_ids (stream-ordered after the step that sampled them)."""
        p = self.pending
        if p is not None:
            self.input_ids[p.positions] = p.source[p.indices]
            self.pending = None

    def packed(self) -> tuple[tuple, torch.Tensor]:
        """(header, one int64 device tensor) from which `unpacked` rebuilds this batch on another tensor-parallel
        rank; the pending tokens must be filled in first."""
        assert self.pending is None, "fill_pending() before packing"
        extra, tree = self.extra_logit_indices, self.tree_mask
        parts = [self.input_ids, self.positions, self.out_cache_loc, self.req_pool_indices, self.seq_lens,
                 self.extend_lens, self.logits_indices] + ([extra] if extra is not None else []) + \
            ([tree.reshape(-1)] if tree is not None else [])
        header = (self.mode, self.seq_lens_host, self.extend_lens_host, self.num_tokens,
                  0 if extra is None else int(extra.shape[0]),
                  None if tree is None else self.tree_keys_host or [], self.lora_slots)
        return header, torch.cat(parts)

    @classmethod
    def unpacked(cls, header: tuple, packed: torch.Tensor) -> "ForwardBatch":
        mode, seq_lens, extend_lens, n, n_extra, tree_keys, lora_slots = header
        has_tree = tree_keys is not None
        b = len(seq_lens)
        ids, pos, loc, rows, lens, ext, logit_idx, extra, tree = packed.split(
            [n, n, n, b, b, b, b, n_extra, 2 * b if has_tree else 0])
        return cls(mode=mode, input_ids=ids, positions=pos, out_cache_loc=loc, req_pool_indices=rows, seq_lens=lens,
                   extend_lens=ext, logits_indices=logit_idx, seq_lens_host=list(seq_lens),
                   extend_lens_host=list(extend_lens), extra_logit_indices=extra if n_extra else None,
                   decode_block=packed[:5 * n].view(5, n) if mode is ForwardMode.DECODE else None,
                   tree_mask=tree.view(2, b) if has_tree else None,
                   tree_keys_host=list(tree_keys) if has_tree else None, lora_slots=lora_slots)

    @staticmethod
    def packed_size(header: tuple) -> int:
        _, seq_lens, _, n, n_extra, tree_keys, _ = header
        return 3 * n + (6 if tree_keys is not None else 4) * len(seq_lens) + n_extra

    @classmethod
    def build(cls, mode: ForwardMode, input_ids: list[int], positions: list[int], out_cache_loc: torch.Tensor,
              req_pool_indices: list[int], seq_lens: list[int], extend_lens: list[int],
              device: torch.device, extra_logit_indices: list[int] | None = None,
              pending: tuple[list[int], list[int], torch.Tensor] | None = None,
              lora_slots: list[int] | None = None) -> "ForwardBatch":
        """Every int64 field travels in one host-to-device copy (from pinned memory on CUDA), packed in the order
        input_ids, positions, out_cache_loc, req_pool_indices, seq_lens, ...: in a decode batch (one token per
        request) the first five form one [5, batch] block, which CUDA graphs copy into their static inputs at once.
        `pending` is (flat positions, rows of the source, source next-ids) for inputs still on the device.
        `lora_slots`: each request's LoRA adapter slot (None: no request has one)."""
        n, b = len(input_ids), len(seq_lens)
        extra = extra_logit_indices or []
        pend_pos, pend_idx = (pending[0], pending[1]) if pending else ([], [])
        sizes = [n, n, n, b, b, b, b, len(extra), len(pend_pos), len(pend_idx)]
        host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=device.type == "cuda")
        ends = torch.tensor(extend_lens, dtype=torch.int64).cumsum(0)
        parts = [torch.tensor(input_ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                 out_cache_loc.to(torch.int64), torch.tensor(req_pool_indices, dtype=torch.int64),
                 torch.tensor(seq_lens, dtype=torch.int64), torch.tensor(extend_lens, dtype=torch.int64), ends - 1,
                 torch.tensor(extra, dtype=torch.int64), torch.tensor(pend_pos, dtype=torch.int64),
                 torch.tensor(pend_idx, dtype=torch.int64)]
        torch.cat(parts, out=host)
        dev = host.to(device, non_blocking=True) if device.type != "cpu" else host
        fields = list(dev.split(sizes))
        ids, pos, loc, rows, lens, ext, logit_idx, extra_t, pend_pos_t, pend_idx_t = fields
        return cls(mode=mode, input_ids=ids, positions=pos, out_cache_loc=loc, req_pool_indices=rows, seq_lens=lens,
                   extend_lens=ext, logits_indices=logit_idx, seq_lens_host=list(seq_lens),
                   extend_lens_host=list(extend_lens), extra_logit_indices=extra_t if extra else None,
                   pending=PendingInputs(pend_pos_t, pend_idx_t, pending[2]) if pend_pos else None,
                   decode_block=dev[:5 * n].view(5, n) if mode is ForwardMode.DECODE else None, lora_slots=lora_slots)
