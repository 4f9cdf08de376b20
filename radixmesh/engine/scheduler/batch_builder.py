"""Turns scheduled requests into a ForwardBatch (one host-to-device copy for every field).

A request whose newest token is still in flight (overlap scheduling, `req.pending`) contributes it as a pending
input: a placeholder here, filled on the device from the previous step's next-token tensor.
"""

from __future__ import annotations

import torch

from radixmesh.engine.batch import ForwardBatch, ForwardMode
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.step import PromptLogprobPlan, StepResult
from radixmesh.engine.speculative.tree import as_signed, depths, seen_bits, tree_row_keys


class _Pending:
    """Flat positions of in-flight input tokens and their rows in the previous step's results."""

    def __init__(self, prev: StepResult | None):
        self.prev = prev
        self.positions: list[int] = []
        self.rows: list[int] = []

    def tokens(self, r: Req, flat_start: int) -> list[int]:
        """Tokens [kv_len, kv_len + extend_len) of r, a 0 placeholder for the one still in flight."""
        end = r.kv_len + r.extend_len
        known = r.fill_len
        if end <= known:
            return r.tokens(r.kv_len, end)
        if end != known + 1 or not r.pending or self.prev is None:
            raise RuntimeError(f"request {r.rid}: input token {known} is neither known nor in flight")
        ids = r.tokens(r.kv_len, known)
        self.positions.append(flat_start + len(ids))
        self.rows.append(self.prev.rows[id(r)])
        return ids + [0]

    def spec(self):
        return (self.positions, self.rows, self.prev.sampled.next_ids) if self.positions else None


def _lora_slots(reqs: list[Req], rows: int = 1) -> list[int] | None:
    """Each request's LoRA adapter slot (`rows` times: a verify's rows per request), or None when every request runs
    the base model."""
    slots = [r.lora_slot for r in reqs for _ in range(rows)]
    return slots if any(slots) else None


def build_extend(reqs: list[Req], locs: torch.Tensor, device: torch.device, prev: StepResult | None = None
                 ) -> tuple[ForwardBatch, PromptLogprobPlan | None]:
    """Each request contributes tokens fill_ids[kv_len : kv_len + extend_len] (a decoding request: its last
    output token, extend_len 1). `locs` are the KV slots the new tokens write, in the same order. Positions whose
    logits give wanted prompt logprobs are listed as extra logits. `prev` is the step still in flight."""
    ids, positions, extra, counts, targets, top_k, id_rows = [], [], [], [], [], 0, []
    pending = _Pending(prev)
    for r in reqs:
        start = len(ids)
        ids += pending.tokens(r, start)
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
    return _extend(reqs, ids, positions, locs, device, extra, pending.spec()), plan


def _extend(reqs: list[Req], ids: list[int], positions: list[int], locs: torch.Tensor, device: torch.device,
            extra: list[int], pending=None) -> ForwardBatch:
    """An EXTEND batch of each request's extend_len tokens from its kv_len on."""
    return ForwardBatch.build(
        ForwardMode.EXTEND, ids, positions, locs,
        req_pool_indices=[r.pool_idx for r in reqs],
        seq_lens=[r.kv_len + r.extend_len for r in reqs],
        extend_lens=[r.extend_len for r in reqs],
        device=device,
        extra_logit_indices=extra,
        pending=pending,
        lora_slots=_lora_slots(reqs),
    )


def build_decode(reqs: list[Req], locs: torch.Tensor, device: torch.device,
                 prev: StepResult | None = None) -> ForwardBatch:
    """One token per request: its newest token at position kv_len (in flight when kv_len == fill_len)."""
    ids, pend_pos, pend_rows = [], [], []
    for i, r in enumerate(reqs):
        if r.kv_len < r.fill_len:
            ids.append(r.output_ids[-1] if r.output_ids else r.input_ids[-1])
            continue
        if not r.pending or prev is None:
            raise RuntimeError(f"request {r.rid}: its newest token is neither known nor in flight")
        ids.append(0)
        pend_pos.append(i)
        pend_rows.append(prev.rows[id(r)])
    return ForwardBatch.build(
        ForwardMode.DECODE,
        ids,
        [r.kv_len for r in reqs],
        locs,
        req_pool_indices=[r.pool_idx for r in reqs],
        seq_lens=[r.kv_len + 1 for r in reqs],
        extend_lens=[1] * len(reqs),
        device=device,
        pending=(pend_pos, pend_rows, prev.sampled.next_ids) if pend_pos else None,
        lora_slots=_lora_slots(reqs),
    )


def build_verify(reqs: list[Req], drafts: list[list[int]], locs: torch.Tensor, device: torch.device,
                 width: int) -> ForwardBatch:
    """A speculative verify: each request's newest token (at kv_len) and its drafted tokens after it, as a DECODE
    batch of `width` rows per request. Row j of a request is position kv_len + j over the request's table row with
    seq_len kv_len + j + 1: every layer stores the whole batch's K and V before it attends, so row j sees the
    request's KV and the drafts before it, which is the causal mask a verify needs. Rows past a short draft are
    padding (token 0 over the request's first KV token, writing the scratch slot 0), so every verify of a batch of
    this size has the same shape: one CUDA graph, and each position computed alike however many drafts the step
    had. Decode rows reuse the decode step's kernels; the cost is each request's KV read once per row (through L2
    at these widths). Logits come back one per row, in row order (engine.speculative.verify.VerifyLayout)."""
    ids, positions, rows, lens, slots = [], [], [], [], []
    new = locs.split([r.extend_len for r in reqs])
    for r, draft, loc in zip(reqs, drafts, new):
        if r.kv_len != r.fill_len - 1 or r.extend_len != 1 + len(draft) or r.extend_len > width:
            raise RuntimeError(f"request {r.rid}: a verify needs its newest token known and not yet in the KV")
        pad = width - r.extend_len
        ids += [r.output_ids[-1] if r.output_ids else r.input_ids[-1], *draft] + [0] * pad
        positions += [*range(r.kv_len, r.kv_len + r.extend_len)] + [r.kv_len] * pad
        rows += [r.pool_idx] * width
        lens += [*range(r.kv_len + 1, r.kv_len + r.extend_len + 1)] + [1] * pad
        slots += [loc, torch.zeros(pad, dtype=torch.int64)]
    return ForwardBatch.build(ForwardMode.DECODE, ids, positions, torch.cat(slots), req_pool_indices=rows,
                              seq_lens=lens, extend_lens=[1] * len(ids), device=device,
                              lora_slots=_lora_slots(reqs, width))


def build_tree_verify(reqs: list[Req], trees: list[tuple[list[int], list[int]]], locs: torch.Tensor,
                      device: torch.device, width: int) -> ForwardBatch:
    """A draft tree's verify (engine.speculative.tree): `width` decode rows per request, node j (0: the newest token,
    at kv_len; then the tree's nodes, their tokens and parents in `trees`) at table index kv_len + j, position
    kv_len + its depth, with seq_len kv_len + j + 1 and a tree mask over the keys from kv_len on: the row sees the
    request's KV, its ancestors and itself. Rows past a request's tree are padding (token 0 over its first KV token,
    writing the scratch slot 0). A tree engine's CUDA graphs read the mask as a static input (cuda_graph_runner).
    Logits come back one per row."""
    ids, positions, rows, lens, slots, starts, seen = [], [], [], [], [], [], []
    new = locs.split([r.extend_len for r in reqs])
    for r, (tokens, parents), loc in zip(reqs, trees, new):
        n = 1 + len(tokens)
        if r.kv_len != r.fill_len - 1 or r.extend_len < n or n > width:
            raise RuntimeError(f"request {r.rid}: a tree verify needs its newest token known and not yet in the KV")
        pad = width - n
        ids += [r.output_ids[-1] if r.output_ids else r.input_ids[-1], *tokens] + [0] * pad
        positions += [r.kv_len + d for d in depths(parents)] + [0] * pad  # (padding at 0: a window shows key 0)
        rows += [r.pool_idx] * width
        lens += [*range(r.kv_len + 1, r.kv_len + n + 1)] + [1] * pad
        slots += [loc[:n], torch.zeros(pad, dtype=torch.int64)]
        starts += [r.kv_len] * n + [1] * pad
        seen += [as_signed(b) for b in seen_bits(parents)] + [1] * pad
    batch = ForwardBatch.build(ForwardMode.DECODE, ids, positions, torch.cat(slots), req_pool_indices=rows,
                               seq_lens=lens, extend_lens=[1] * len(ids), device=device,
                               lora_slots=_lora_slots(reqs, width))
    batch.tree_mask = torch.tensor([starts, seen], dtype=torch.int64).to(device, non_blocking=True)
    batch.tree_keys_host = [tree_row_keys(*row) for row in zip(starts, seen, lens)]
    return batch


def tree_node_slots(reqs: list[Req], trees: list[tuple[list[int], list[int]]], locs: torch.Tensor,
                    width: int) -> torch.Tensor:
    """[batch, width] int64 (host) the KV slot of each request's node j (past its tree: 0)."""
    out = torch.zeros((len(reqs), width), dtype=torch.int64)
    for i, (loc, (tokens, _)) in enumerate(zip(locs.split([r.extend_len for r in reqs]), trees)):
        out[i, :1 + len(tokens)] = loc[:1 + len(tokens)]
    return out
