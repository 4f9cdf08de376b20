"""What one model forward computes: a flat token batch plus the per-request layout attention needs."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # any number of new tokens per request (prefill chunks, mixed with decodes)
    DECODE = "decode"  # exactly one new token per request


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

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(cls, mode: ForwardMode, input_ids: list[int], positions: list[int], out_cache_loc: torch.Tensor,
              req_pool_indices: list[int], seq_lens: list[int], extend_lens: list[int],
              device: torch.device, extra_logit_indices: list[int] | None = None) -> "ForwardBatch":
        ends = torch.tensor(extend_lens, dtype=torch.int64).cumsum(0)

        def dev(x) -> torch.Tensor:
            t = x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.int64)
            return t.to(device, non_blocking=True)

        return cls(mode=mode, input_ids=dev(input_ids), positions=dev(positions), out_cache_loc=dev(out_cache_loc),
                   req_pool_indices=dev(req_pool_indices), seq_lens=dev(seq_lens), extend_lens=dev(extend_lens),
                   logits_indices=dev(ends - 1), seq_lens_host=list(seq_lens), extend_lens_host=list(extend_lens),
                   extra_logit_indices=dev(extra_logit_indices) if extra_logit_indices else None)
