"""Turns scheduled requests into a ForwardBatch (one host-to-device copy per field)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.batch import ForwardBatch, ForwardMode
from engine.request import Req


class PromptLogprobPlan(NamedTuple):
    counts: list[int]  # per request of the batch: prompt logprobs this forward yields
    targets: list[int]  # the prompt tokens they are for, in batch order
    top_k: int  # the largest top_logprobs_num among those requests
    token_ids: list[list[int]] | None  # per extra position: its request's token_ids_logprob, zero-padded


def build_extend(reqs: list[Req], locs: torch.Tensor, device: torch.device
                 ) -> tuple[ForwardBatch, PromptLogprobPlan | None]:
    """Each request contributes tokens fill_ids[kv_len : kv_len + extend_len] (a decoding request: its last
    output token, extend_len 1). `locs` are the KV slots the new tokens write, in the same order. Positions whose
    logits give wanted prompt logprobs are listed as extra logits."""
    ids, positions, extra, counts, targets, top_k, id_rows = [], [], [], [], [], 0, []
    for r in reqs:
        start = len(ids)
        ids += r.tokens(r.kv_len, r.kv_len + r.extend_len)
        positions += range(r.kv_len, r.kv_len + r.extend_len)
        wanted = r.input_logit_positions(r.kv_len, r.kv_len + r.extend_len)
        extra += [start + p - r.kv_len for p in wanted]
        targets += r.input_ids[wanted.start + 1:wanted.stop + 1] if wanted else []
        counts.append(len(wanted))
        if wanted:
            top_k = max(top_k, r.logprob.top_logprobs_num)
            id_rows += [list(r.logprob.token_ids_logprob)] * len(wanted)
    width = max(map(len, id_rows), default=0)
    padded = [row + [0] * (width - len(row)) for row in id_rows] if width else None
    plan = PromptLogprobPlan(counts, targets, top_k, padded) if extra else None
    return ForwardBatch.build(
        ForwardMode.EXTEND, ids, positions, locs,
        req_pool_indices=[r.pool_idx for r in reqs],
        seq_lens=[r.kv_len + r.extend_len for r in reqs],
        extend_lens=[r.extend_len for r in reqs],
        device=device,
        extra_logit_indices=extra,
    ), plan


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
