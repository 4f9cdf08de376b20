"""Verification of draft trees (engine.speculative.tree): the longest root-to-node path the target keeps.

A tree verify computes logits at every node (`width` rows per request: the root, i.e. the newest token, then the
drafted nodes, then padding), node j's row giving p_j, the target's distribution for the token after the path to j.
From the root down, at each node the children are tested in order (the draft's preference):

- greedy rows: a child is kept iff its token is the argmax of p at its parent (children are distinct tokens, so at
  most one is), which is what decoding one token at a time gives;
- sampled rows: the children are one-hot proposals, tested one after another against the residual r (at first p):
  child c is kept with probability r(c) / sum(r); a rejected child's token is taken out of r. After the first kept
  child the walk goes on from it (r = p there); when every child is rejected (or the node has none) the row's next
  token is drawn from r. Each token is then distributed exactly as p: P(c_1) = p(c_1); P(c_i) = prod_{l<i}(1 -
  r_l(c_l)) * r_i(c_i) = p(c_i); every other token x gets (1 - sum_i p(c_i)) * p(x) / (1 - sum_i p(c_i)) = p(x)
  (multi-draft speculative sampling with deterministic drafts, as SpecInfer's; the tree's choice depends only on
  the draft, never on the target's draws).

p_j is what plain sampling would use after the path to node j: its sampling row is built as if the path's tokens
were output (penalties, min_new_tokens, seeds, the grammar walked along it). Logprobs are the raw logits' at each
path node.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radixmesh.engine.cache.kv_pool import KVPool
from radixmesh.engine.request import Req
from radixmesh.engine.sampling.penalties import PenaltyState
from radixmesh.engine.sampling.sampler import SamplingBatch, adjust_logits, adjusts, draw, token_probs, uniforms
from radixmesh.engine.speculative.tree import depths
from radixmesh.engine.speculative.verify import RESAMPLE_SALT, VerifyResult, with_logprobs

# A seeded row's draw for its parent's s-th child test: (seed xor (TEST_SALT + s), step of the parent's depth).
TEST_SALT = 0x3C6EF372


class TreeLayout(NamedTuple):
    """Each request's tree as the verify reads it (rows: request i's node j at i * width + j)."""

    tokens: torch.Tensor  # [batch, width] int64 node tokens (the root's and padding: 0)
    children: torch.Tensor  # [batch, width, topk] int64 each node's children in the draft's order (-1: none)
    depth: int  # the deepest node of the batch
    width: int

    @classmethod
    def build(cls, trees: list[tuple[list[int], list[int]]], width: int, device: torch.device) -> "TreeLayout":
        """`trees`: per request, its node tokens and parents (engine.speculative.tree; both empty: no tree)."""
        batch = len(trees)
        topk = max((max(parents.count(p) for p in set(parents)) for _, parents in trees if parents), default=1)
        tokens = torch.zeros((batch, width), dtype=torch.int64)
        children = torch.full((batch, width, topk), -1, dtype=torch.int64)
        depth = 0
        for i, (toks, parents) in enumerate(trees):
            if not toks:
                continue
            tokens[i, 1:len(toks) + 1] = torch.tensor(toks)
            rank = [0] * width
            for node, p in enumerate(parents, start=1):
                children[i, p, rank[p]] = node
                rank[p] += 1
            depth = max(depth, max(depths(parents)))
        return cls(tokens.to(device, non_blocking=True), children.to(device, non_blocking=True), depth, width)


class TreeResult(NamedTuple):
    verified: VerifyResult  # tokens [batch, width]: the kept path's tokens, then the target's next one
    path: torch.Tensor  # [batch, depth + 1] int64 the kept path's nodes (path[:, 0] the root; past `accepted`: any)


def verify_tree(logits: torch.Tensor, layout: TreeLayout, sampling: SamplingBatch, generator: torch.Generator | None,
                penalties: PenaltyState | None = None) -> TreeResult:
    """`logits` [batch * width, vocab] float32 of a tree verify; `sampling` one row per node (tree_sampling)."""
    batch, width = layout.tokens.shape
    adjusted = adjust_logits(logits, sampling, penalties) if adjusts(sampling) else logits
    best = adjusted.argmax(dim=-1).view(batch, width)
    sampled = not sampling.all_greedy
    probs = token_probs(adjusted, sampling).view(batch, width, -1) if sampled else None
    greedy = sampling.greedy.view(batch, width)[:, 0]
    dev = best.device
    rows = torch.arange(batch, device=dev)
    cur = torch.zeros(batch, dtype=torch.int64, device=dev)
    alive = torch.ones(batch, dtype=torch.bool, device=dev)
    accepted = torch.zeros(batch, dtype=torch.int64, device=dev)
    path = torch.zeros((batch, layout.depth + 1), dtype=torch.int64, device=dev)
    tests = [uniforms(sampling, generator, dev, TEST_SALT + s).view(batch, width)
             for s in range(layout.children.shape[2])] if sampled else []
    residual = probs[:, 0] if sampled else None
    for d in range(1, layout.depth + 1):
        moved = torch.zeros_like(alive)
        for s in range(layout.children.shape[2]):
            child = layout.children[rows, cur, s]
            valid = alive & ~moved & (child >= 0)
            token = layout.tokens[rows, child.clamp(min=0)]
            ok = token == best[rows, cur]
            if sampled:
                p_token = residual.gather(1, token[:, None]).squeeze(1)
                kept = tests[s][rows, cur] * residual.sum(dim=-1) < p_token
                ok = torch.where(greedy, ok, kept)
                residual = residual.scatter(1, token[:, None], torch.where(valid & ~ok, 0.0, p_token)[:, None])
            taken = valid & ok
            cur = torch.where(taken, child, cur)
            moved |= taken
        alive = moved
        accepted += moved.long()
        path[:, d] = cur
        if sampled:
            residual = torch.where(moved[:, None], probs[rows, cur], residual)
    next_ids = best[rows, cur]
    if sampled:
        empty = residual.sum(dim=-1) <= 0  # (rounding only: a kept-with-certainty child is never rejected)
        residual = torch.where(empty[:, None], probs[rows, cur], residual)
        again = uniforms(sampling, generator, dev, RESAMPLE_SALT).view(batch, width)[rows, cur]
        next_ids = torch.where(greedy, next_ids, draw(residual, again))
    position = torch.arange(width, device=dev)[None, :]
    along = path[:, 1:].gather(1, position[:, :layout.depth].expand(batch, -1)) if layout.depth else path[:, :0]
    path_tokens = layout.tokens.gather(1, along)
    path_tokens = torch.nn.functional.pad(path_tokens, (0, width - path_tokens.shape[1]))
    tokens = torch.where(position < accepted[:, None], path_tokens, next_ids[:, None])
    return TreeResult(_with_logprobs(logits, sampling, path, tokens, accepted, next_ids), path)


def _with_logprobs(logits: torch.Tensor, sampling: SamplingBatch, path: torch.Tensor, tokens: torch.Tensor,
                   accepted: torch.Tensor, next_ids: torch.Tensor) -> VerifyResult:
    """The raw logprobs of each output token at the path node it follows (output j after path[:, j])."""
    if not sampling.want_logprobs:
        return VerifyResult(tokens, accepted, next_ids)
    batch, width = tokens.shape
    at = torch.nn.functional.pad(path, (0, width - path.shape[1]), value=0)[:, :width]
    rows = (torch.arange(batch, device=at.device)[:, None] * width + at).reshape(-1)
    ids = sampling.logprob_token_ids
    return with_logprobs(VerifyResult(tokens, accepted, next_ids), torch.log_softmax(logits[rows], dim=-1), sampling,
                         None if ids is None else ids[rows])


def move_path_kv(pool: KVPool, node_slots: torch.Tensor, path: torch.Tensor,
                 accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kept path's KV to the request's consecutive positions: node path[:, d]'s slot into node d's (node d sits
    at position newest + d in the request's table) for d <= accepted, in every layer. node_slots [batch, width]
    (device) int64. Nodes are numbered parents first, so path[:, d] >= d: every source is read before any write.
    Returns the copy (source slots, destination slots), for the other ranks of a tensor-parallel engine; None when
    the tree had no depth."""
    depth = path.shape[1] - 1
    if depth == 0:
        return None
    d = torch.arange(1, depth + 1, device=path.device)[None, :]
    dst = node_slots[:, 1:depth + 1]
    src = node_slots.gather(1, path[:, 1:])
    src = torch.where(d <= accepted[:, None], src, dst).reshape(-1)
    dst = dst.reshape(-1)
    copy_slots(pool, src, dst)
    return src, dst


def copy_slots(pool: KVPool, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Every layer's KV at slots `src` into slots `dst` (all sources read before any write)."""
    for buf in pool.buffers():
        buf.index_copy_(0, dst, buf.index_select(0, src))


def tree_sampling(reqs: list[Req], trees: list[tuple[list[int], list[int]]], width: int, vocab: int,
                  device: torch.device) -> SamplingBatch:
    """Sampling rows of a tree verify, node j of request i at row i * width + j, each as if the path to its node
    were output: min_new_tokens and seeded draws count the node's depth, penalties the path's tokens, the grammar's
    mask is the matcher's after the path."""
    offsets, ahead_rows, ahead_tokens = [], [], []
    for i, (r, (toks, parents)) in enumerate(zip(reqs, trees)):
        depth = depths(parents) if toks else [0]
        offsets += depth + [0] * (width - len(depth))
        if r.sampling.penalized:
            for node in range(1, len(toks) + 1):
                along = _path_to(node, toks, parents)
                ahead_rows += [i * width + node] * len(along)
                ahead_tokens += along
    batch = SamplingBatch.build([r for r in reqs for _ in range(width)], any(r.return_logprob for r in reqs),
                                vocab, device, offsets=offsets)
    ahead = (torch.tensor(ahead_rows, dtype=torch.int64).to(device, non_blocking=True),
             torch.tensor(ahead_tokens, dtype=torch.int64).to(device, non_blocking=True)) if ahead_rows else None
    return batch._replace(penalized_ahead=ahead, grammar=_grammar(reqs, trees, width, vocab))


def _path_to(node: int, toks: list[int], parents: list[int]) -> list[int]:
    """Tokens of the nodes from the root's child down to `node` (node >= 1)."""
    out = []
    while node:
        out.append(toks[node - 1])
        node = parents[node - 1]
    return out[::-1]


def _grammar(reqs: list[Req], trees: list[tuple[list[int], list[int]]], width: int, vocab: int):
    """Each constrained request's masks along every root-to-leaf path (a node on several paths gets the same mask)."""
    constrained = [i for i, r in enumerate(reqs) if r.matcher is not None and not r.finished]
    if not constrained:
        return None
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(reqs) * width, vocab)
    masked: set[int] = set()
    for i in constrained:
        toks, parents = trees[i]
        leaves = [n for n in range(len(toks) + 1) if n not in parents] if toks else [0]
        for leaf in leaves:
            nodes, node = [], leaf
            while node:
                nodes.append(node)
                node = parents[node - 1]
            nodes = [0] + nodes[::-1]
            masked.update(reqs[i].matcher.fill_masks_along([toks[n - 1] for n in nodes[1:]], bitmask,
                                                           [i * width + n for n in nodes]))
    return (bitmask, sorted(masked)) if masked else None


def verify_tree_step(runner, batch, logits: torch.Tensor) -> VerifyResult:
    """A scheduled tree verify's outcome (engine.scheduler.step.ScheduledBatch with `trees`), its kept path's KV
    moved into place in `runner`'s (engine.model_runner.ModelRunner) pool before anything reads it."""
    from radixmesh.engine.scheduler.batch_builder import tree_node_slots

    reqs, trees, width = batch.reqs, batch.trees, batch.width
    layout = TreeLayout.build(trees, width, runner.device)
    sampling = tree_sampling(reqs, trees, width, runner.model_config.vocab_size, runner.device)
    out = verify_tree(logits, layout, sampling, runner.generator, runner.penalties)
    slots = tree_node_slots(reqs, trees, batch.locs, width).to(runner.device, non_blocking=True)
    moved = move_path_kv(runner.kv_pool, slots, out.path, out.verified.accepted)
    if moved is not None:
        runner.mirror_kv_copy(*moved)
    return out.verified
