"""Paged decode attention (one new query token per request) with grouped-query heads and split-KV.

The KV pool is token-addressed: `req_to_token[row, i]` is the slot of token i of the request in table row `row`, and
`k_buf[slot]` / `v_buf[slot]` hold its keys and values ([num_slots, num_kv_heads, head_dim] per layer). Page size is
therefore invisible here: any page size works.

Stage 1 runs one program per (request, KV head, split). The program loads the `group` query heads that share that
KV head as the rows of one tile, so every key and value is read from memory once per KV head, and walks its split of
the request's tokens with an online softmax. It writes a partial output and the log-sum-exp of its scores. Stage 2
merges the splits of each (request, head). With one split, stage 1 writes the final output and stage 2 is skipped.

(Stage 1's last split merging the splits itself, behind an atomic counter, was measured twice on Hopper and lost both
times: benchmarks/results/NOTES.md, 2026-11-25 and 2026-11-29. Under PDL the kernel boundary costs almost nothing,
and stage 2 merges the heads in parallel where the last split would merge them one after another.)

A sliding window of w tokens (a per-layer constant) shows the query at position seq_len - 1 the keys at positions
seq_len - w .. seq_len - 1 (transformers' rule: key > query - w); both stages walk only those, so a windowed layer
reads at most w keys per request. Scores may be soft-capped, and a head's attention sink (GPT-OSS) joins the softmax's
denominator where the splits are merged (kernels.online_softmax).

An fp8 cache (--kv-cache-dtype fp8_*) holds keys divided by a per-layer `k_scale` and values divided by `v_scale`:
the key scale multiplies the score scale (q . (k * ks) * scale = (q . k) * (scale * ks)) and the value scale the
output, once (every value of the sum carries it), so a cache read costs what an unscaled one does (V_SCALED: 1.0
skips even the multiply).

A draft tree's verify rows (engine.speculative.tree) see only some of their request's last keys: `tree` gives each row
the first table index of its masked span (`start`) and a 64-bit set of the keys there it sees (`bits`, bit i: key
start + i); keys before `start` are all seen. Each row's own key is its last (seq_len - 1) and is seen, so every
split a row fills holds a key it sees, except splits that lie wholly in the span: those keep a zero weight.

The split count depends only on the batch size (not on the lengths), so a CUDA graph captured for a batch size
stays valid for any lengths; each request's keys (its window's, when it has one) are cut into `num_splits` ranges
of whole `BLOCK_N` blocks on the device, so a short request simply leaves trailing splits empty. An empty split's
program returns at once (it neither waits for the kernel before nor writes), and the merge walks only the splits the
length fills, `MERGE_CHUNK` at a time: a wide split count chosen for long contexts costs a short one almost nothing.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from radixmesh.kernels.online_softmax import accumulate, sink_normalizer, softmax_step
from radixmesh.kernels.runtime import LINE_BYTES, dot_needs_upcast, pdl_enter, pdl_options, prefetch_l2

# Splits beyond this add merge work without exposing more parallelism worth having.
MAX_SPLITS = 64
# Programs per streaming multiprocessor to aim for when choosing splits (latency hiding for the gathers).
PROGRAMS_PER_SM = 4
# Under programmatic dependent launch, stage 1 pulls its first block of keys and values into L2 before it waits for
# the kernel before (benchmarks.prefetch_step turns it off to measure it).
PREFETCH_KV = True
# The merge reads this many splits at a time (a running maximum across chunks): a wide split count at a short
# context pays only for the splits its lengths fill.
MERGE_CHUNK = 16
_LOG2E = 1.4426950408889634


@triton.jit
def _window_start(seq_len, window):
    """First key position the query at seq_len - 1 sees: seq_len - window, or 0 (window 0: no window)."""
    return tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)


@triton.jit
def _tree_visible(n, tree_start, tree_bits):
    """Whether keys at table indices n (a block) are seen by a row with this tree span (keys before it: all)."""
    rel = n - tree_start
    return (rel < 0) | (((tree_bits >> tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)) & 1) != 0)


@triton.jit
def _decode_stage1(Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, Positions, TreeStart, TreeBits, Sinks, Out,
                   PartialO, PartialLse, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_rt,
                   stride_ot, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                   scale_log2, cap_log2, window, v_scale, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, CAPPED: tl.constexpr, PDL: tl.constexpr,
                   PREFETCH_LINES: tl.constexpr, LINE_ELEMS: tl.constexpr, TREE: tl.constexpr,
                   V_SCALED: tl.constexpr, SINK: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # The lengths and the slot table are written before the step starts (the batch's inputs), never by a kernel of
    # the step: read before the PDL wait, like the keys and values of the first block, pulled into L2 meanwhile
    # (the one new token's slot may still be being written; a prefetch binds no value, so it is harmless).
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    row = tl.load(ReqPoolIdx + b).to(tl.int64)
    if TREE:  # a tree row's window runs back from its position (its depth past the span's start), not its index
        first = _window_start(tl.load(Positions + b).to(tl.int32) + 1, window)
    else:
        first = _window_start(seq_len, window)
    split_len = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if start >= seq_len:
        # an empty split (a short request in a wide split count): the merge reads only the splits the length
        # fills, so this program neither waits, reads nor writes
        return
    if PDL:
        if PREFETCH_LINES > 0:
            n = start + tl.arange(0, BLOCK_N)
            first_block = n < end
            slots = tl.load(ReqToToken + row * stride_rt + n, mask=first_block, other=0).to(tl.int64)
            cols = tl.arange(0, PREFETCH_LINES) * LINE_ELEMS  # the first element of each 128-byte line of a row
            line = first_block[:, None] & (cols[None, :] < HEAD_DIM)
            prefetch_l2(tl.where(line, K + slots[:, None] * stride_kt + kv_head * stride_kh + cols[None, :], K))
            prefetch_l2(tl.where(line, V + slots[:, None] * stride_vt + kv_head * stride_vh + cols[None, :], V))
        tl.extra.cuda.gdc_wait()  # from here on the kernel before (rotary, the KV store) has finished

    h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + h
    h_mask = h < GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    if TREE:
        tree_start = tl.load(TreeStart + b).to(tl.int32)
        tree_bits = tl.load(TreeBits + b)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        if TREE:
            n_mask = n_mask & _tree_visible(n, tree_start, tree_bits)
        slots = tl.load(ReqToToken + row * stride_rt + n, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + slots[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        k = k.to(Q.dtype.element_ty)  # (an fp8 cache: its values in the model's dtype; else nothing)
        p, alpha, m_i, l_i = softmax_step(q, k, n_mask[None, :], m_i, l_i, scale_log2, cap_log2, PRECISION, UPCAST,
                                          CAPPED, TREE)
        v = tl.load(V + slots[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        v = v.to(Q.dtype.element_ty)
        acc = accumulate(acc, p, alpha, v, PRECISION, UPCAST)

    if V_SCALED:  # an fp8 cache's values are stored divided by v_scale (the partial sums merge linearly)
        acc = acc * v_scale
    out_mask = h_mask[:, None] & d_mask[None, :]
    if TREE:  # a split wholly inside a row's tree span may see no key: its weight is zero, not NaN
        l_i = tl.where(l_i > 0, l_i, 1.0)
    if NUM_SPLITS == 1:
        if SINK:
            factor, l_i = sink_normalizer(m_i, l_i, tl.load(Sinks + heads, mask=h_mask, other=0.0))
            acc = acc * factor[:, None]
        out = acc / l_i[:, None]
        tl.store(Out + b * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
                 mask=out_mask)
    else:
        tl.store(PartialLse + b * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i), mask=h_mask)
        tl.store(PartialO + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :],
                 acc / l_i[:, None], mask=out_mask)


@triton.jit
def _decode_stage2(PartialO, PartialLse, Out, SeqLens, Sinks, stride_pb, stride_ph, stride_ps, stride_lb,
                   stride_lh, stride_ot, stride_oh, window, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
                   SINK: tl.constexpr):
    b = tl.program_id(0)
    head = tl.program_id(1)
    # Which splits stage 1 filled follows from the length (and the window) alone (an input of the step, so read
    # before the PDL wait): after it, the scores and the partial outputs load side by side.
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    kv_len = seq_len - _window_start(seq_len, window)
    split_len = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    n_live = tl.cdiv(kv_len, split_len)  # at least split 0: every request has seq_len >= 1
    pdl_enter(PDL)
    # the live splits, BLOCK_S at a time with a running maximum: splits past n_live cost nothing, and a wide split
    # count keeps a small tile
    d = tl.arange(0, BLOCK_D)
    m = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, n_live, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        live = s < n_live
        lse_ptrs = PartialLse + b * stride_lb + head * stride_lh + s
        part_ptrs = PartialO + b * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :]
        part_mask = live[:, None] & (d[None, :] < HEAD_DIM)
        lse = tl.load(lse_ptrs, mask=live, other=float("-inf"))
        part = tl.load(part_ptrs, mask=part_mask, other=0.0)  # [BLOCK_S, BLOCK_D]
        m_new = tl.maximum(m, tl.max(lse, 0))  # finite once a split saw a key (split 0 sees the prefix or the row)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (a tree row's splits wholly in its span see none)
        alpha = tl.exp2(m - m_safe)
        w = tl.where(live, tl.exp2(lse - m_safe), 0.0)  # [BLOCK_S]
        acc = acc * alpha + tl.sum(part * w[:, None], 0)
        total = total * alpha + tl.sum(w, 0)
        m = m_new
    if SINK:
        factor, total = sink_normalizer(m, total, tl.load(Sinks + head))
        acc = acc * factor
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(Out + b * stride_ot + head * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < HEAD_DIM)


def num_kv_splits(batch_size: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per request for a batch of this size: enough (request, KV head, split) programs to fill the GPU."""
    if device.type != "cuda":
        return 2  # Triton's interpreter: still split, with few programs
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, math.ceil(PROGRAMS_PER_SM * sms / max(1, batch_size * num_kv_heads))))


def partial_buffers(batch_size: int, num_heads: int, num_splits: int, head_dim: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for stage 1: partial outputs [batch, heads, splits, head_dim] and log2-sum-exp [batch, heads, splits]
    in float32."""
    return (torch.empty((batch_size, num_heads, num_splits, head_dim), dtype=torch.float32, device=device),
            torch.empty((batch_size, num_heads, num_splits), dtype=torch.float32, device=device))


def split_scratch(out: torch.Tensor, num_splits: int, width: int,
                  partials: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1's partial outputs and log-sum-exp for `out` [batch, heads, width]: `partials` (or new ones) with
    several splits; with one, stage 1 writes `out` itself and gets placeholders."""
    if num_splits == 1:
        return (out.new_empty((1, 1, 1, 1), dtype=torch.float32), out.new_empty((1, 1, 1), dtype=torch.float32))
    return partials or partial_buffers(out.shape[0], out.shape[1], num_splits, width, out.device)


def merge_splits(po: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, seq_lens: torch.Tensor, window: int | None,
                 num_splits: int, block_n: int, block_d: int, sinks: torch.Tensor | None = None) -> None:
    """Stage 2 into `out` [batch, heads, width]: each (request, head)'s live splits merged (nothing with one split),
    with the head's attention sink in the denominator where `sinks` [heads] is given. `block_n` must be stage 1's:
    both cut the keys into splits of whole blocks alike."""
    if num_splits == 1:
        return
    bsz, num_heads, width = out.shape
    _decode_stage2[(bsz, num_heads)](
        po, lse, out, seq_lens, sinks if sinks is not None else seq_lens, po.stride(0), po.stride(1), po.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), _window_arg(window), HEAD_DIM=width, NUM_SPLITS=num_splits,
        BLOCK_N=block_n, BLOCK_S=max(2, min(MERGE_CHUNK, triton.next_power_of_2(num_splits))), BLOCK_D=block_d,
        SINK=sinks is not None, num_warps=4 if block_d > 64 else 2, **pdl_options(out))


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float, num_splits: int,
                     out: torch.Tensor | None = None,
                     partials: tuple[torch.Tensor, torch.Tensor] | None = None, window: int | None = None,
                     softcap: float | None = None, tree: torch.Tensor | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0, positions: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [batch, num_heads, head_dim]; k_buf, v_buf [num_slots, num_kv_heads, head_dim]; req_to_token [rows, row_len];
    req_pool_indices, seq_lens [batch] (every seq_len >= 1). Returns [batch, num_heads, head_dim] in q's dtype.
    `partials` (from `partial_buffers`, at least [batch, heads, num_splits]) lets CUDA graphs keep fixed scratch.
    `window`: the query sees only the last `window` keys; `softcap`: scores become softcap * tanh(scores / softcap).
    `tree` [2, batch] int64: each row's masked span (first table index, bits of the keys it sees there); under a
    window a tree row sees the keys after `positions` [batch] - window (its position: the span's start plus its
    depth; a table index past the start is not a position), and its ancestors, which a window longer than the tree
    is deep always shows. `k_scale`, `v_scale`: the cache holds keys and values divided by them (an fp8 cache's
    per-layer scales). `sinks` [num_heads]: each head's attention sink (a logit in the softmax's denominator)."""
    bsz, num_heads, head_dim = q.shape
    if tree is not None and window is not None and positions is None:
        raise ValueError("a draft tree under a sliding window needs its rows' positions")
    num_kv_heads = k_buf.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    if bsz == 0:
        return out
    po, lse = split_scratch(out, num_splits, head_dim, partials)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if block_d <= 128 else 32
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    pdl = pdl_options(q)
    line = LINE_BYTES // k_buf.element_size()
    prefetch = triton.cdiv(head_dim, line) if pdl["PDL"] and PREFETCH_KV else 0
    _decode_stage1[(bsz, num_kv_heads, num_splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens,
        positions if positions is not None and tree is not None else seq_lens,
        tree[0] if tree is not None else seq_lens,
        tree[1] if tree is not None else seq_lens, sinks if sinks is not None else seq_lens, out, po, lse,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0), out.stride(0), out.stride(1), po.stride(0), po.stride(1), po.stride(2),
        lse.stride(0), lse.stride(1), scale * k_scale * _LOG2E, (softcap or 0.0) * _LOG2E, _window_arg(window),
        float(v_scale), GROUP=group, HEAD_DIM=head_dim, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n, BLOCK_D=block_d, NUM_SPLITS=num_splits, PRECISION=precision,
        UPCAST=dot_needs_upcast(q.dtype), CAPPED=bool(softcap),
        PREFETCH_LINES=triton.next_power_of_2(prefetch) if prefetch else 0, LINE_ELEMS=line, TREE=tree is not None,
        V_SCALED=v_scale != 1.0, SINK=sinks is not None, num_warps=4,
        num_stages=2, **pdl)
    merge_splits(po, lse, out, seq_lens, window, num_splits, block_n, block_d, sinks)
    return out


def _window_arg(window: int | None) -> int:
    """The kernels' encoding of a window: its size, or 0 for none."""
    if window is not None and window < 1:
        raise ValueError(f"a sliding window holds at least one token, not {window}")
    return window or 0


def decode_attention_reference(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, window: int | None = None, softcap: float | None = None,
                               tree: torch.Tensor | None = None, k_scale: float = 1.0,
                               v_scale: float = 1.0, positions: torch.Tensor | None = None,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch twin of `decode_attention`: per request, gather its keys and values (the last `window` of them,
    given one, counted back from its position where it is a tree row; those its tree span lets it see, given
    `tree`), times `k_scale` and `v_scale`, and attend in float32, scores soft-capped when `softcap` is given, each
    head's sink a score without a value (given `sinks`)."""
    bsz, num_heads, head_dim = q.shape
    group = num_heads // k_buf.shape[1]
    out = torch.empty_like(q)
    for b in range(bsz):
        seq = int(seq_lens[b])
        last = int(positions[b]) + 1 if tree is not None and positions is not None else seq
        first = max(0, last - window) if window else 0
        index = torch.arange(first, seq)
        if tree is not None:
            start, bits = int(tree[0, b]), int(tree[1, b])
            index = index[[i < start or bool((bits >> (i - start)) & 1) for i in index.tolist()]]
        slots = req_to_token[int(req_pool_indices[b]), index].long()
        keys = (k_buf[slots].float() * k_scale).repeat_interleave(group, dim=1)  # [seq, heads, head_dim]
        values = (v_buf[slots].float() * v_scale).repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,shd->hs", q[b].float(), keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        out[b] = torch.einsum("hs,shd->hd", with_sinks_softmax(scores, sinks), values).to(q.dtype)
    return out


def with_sinks_softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last axis of float32 `scores` [heads, ..., keys], each head's sink (`sinks` [heads], or
    None: none) one more logit of its row that weighs no value (dropped after the softmax)."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.float().view(-1, *(1,) * (scores.dim() - 1)).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
