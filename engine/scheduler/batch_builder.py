"""Turns scheduled requests into a ForwardBatch (one host-to-device copy per field)."""

from __future__ import annotations

import torch

from engine.batch import ForwardBatch, ForwardMode
from engine.request import Req


def build_extend(reqs: list[Req], locs: torch.Tensor, device: torch.device) -> ForwardBatch:
    """Each request contributes tokens fill_ids[kv_len : kv_len + extend_len] (a decoding request: its last
    output token, extend_len 1). `locs` are the KV slots the new tokens write, in the same order."""
    ids, positions = [], []
    for r in reqs:
        ids += r.tokens(r.kv_len, r.kv_len + r.extend_len)
        positions += range(r.kv_len, r.kv_len + r.extend_len)
    return ForwardBatch.build(
        ForwardMode.EXTEND, ids, positions, locs,
        req_pool_indices=[r.pool_idx for r in reqs],
        seq_lens=[r.kv_len + r.extend_len for r in reqs],
        extend_lens=[r.extend_len for r in reqs],
        device=device,
    )


def build_decode(reqs: list[Req], locs: torch.Tensor, device: torch.device) -> ForwardBatch:
    return ForwardBatch.build(
        ForwardMode.DECODE,
        [r.output_ids[-1] if r.output_ids else r.input_ids[-1] for r in reqs],
        [r.kv_len for r in reqs],
        locs,
        req_pool_indices=[r.pool_idx for r in reqs],
        seq_lens=[r.kv_len + 1 for r in reqs],
        extend_lens=[1] * len(reqs),
        device=device,
    )
