"""Draft trees (EAGLE's --speculative-eagle-topk K > 1): their shape, the choice of their nodes and host-side views.

A draft of `steps` steps grows a tree from the request's newest token (the root, node 0): step 1 takes the K most
likely tokens after the root (depth 1), and each later step expands each of the K nodes of the frontier (the depth
before) by its K most likely children and keeps, as the next frontier, the K children of highest cumulative
log-probability. Every node so proposed is a candidate, scored by its cumulative log-probability; the tree verified
is the root and the num_draft_tokens - 1 best candidates. A child scores no higher than its parent (log-probabilities
are <= 0) and comes later in candidate order, so a stable sort by score keeps every chosen node's parent: the choice
is a tree. Nodes are numbered in candidate order, so a parent always has a smaller number than its children, and the
children of one node are distinct tokens (the top-K of one distribution).

Tensors [batch, ...] are per drafting request; node lists on the host leave the root out (node i + 1 at index i).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TREE_KEYS = 64  # a row's masked span is a 64-bit set (kernels.decode_attention)


@dataclass(frozen=True, slots=True)
class TreeShape:
    topk: int
    steps: int
    num_draft_tokens: int  # the root and the drafted nodes a verify checks

    @property
    def nodes(self) -> int:
        """Drafted nodes (the root left out)."""
        return self.num_draft_tokens - 1

    @property
    def candidates(self) -> int:
        """Candidates the steps propose: K at depth 1, K * K at each later depth."""
        return self.topk + (self.steps - 1) * self.topk * self.topk

    @property
    def scratch(self) -> int:
        """KV slots a request takes after its newest token: the verified nodes', and the draft steps' (each of the
        steps after the first writes the head's KV of its K frontier nodes, which deeper nodes attend to)."""
        return max(self.nodes, (self.steps - 1) * self.topk)


def frontier_bits(shape: TreeShape) -> list[list[int]]:
    """For each drafting step j = 1 .. steps - 1, the scratch bit of each of its K frontier nodes, 1 << ((j - 1) * K
    + f), as the int64 a tensor holds (bit 63 is the sign bit: a span of 64 scratch slots is allowed)."""
    k = shape.topk
    return [[as_signed(1 << ((j - 1) * k + f)) for f in range(k)] for j in range(1, shape.steps)]


def select_tree(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, nodes: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The `nodes` best candidates of each request as a tree. scores, tokens [batch, C]; parents [batch, C]: each
    candidate's parent candidate (-1: the root). Returns node tokens and node parents [batch, nodes] int64, nodes in
    candidate order, parents as node numbers (0: the root)."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :nodes]
    chosen = order.sort(dim=1).values  # candidate order: parents before children
    node_of = torch.zeros_like(scores, dtype=torch.int64)  # candidate -> its node number (unchosen: unused)
    node_of.scatter_(1, chosen, torch.arange(1, nodes + 1, device=scores.device).expand_as(chosen))
    parent_cand = parents.gather(1, chosen)
    parent_node = torch.where(parent_cand < 0, 0, node_of.gather(1, parent_cand.clamp(min=0)))
    return tokens.gather(1, chosen), parent_node


def depths(parents: list[int]) -> list[int]:
    """Depth of node 0 (the root) .. node len(parents); parents[i] is node i + 1's."""
    out = [0]
    for p in parents:
        out.append(out[p] + 1)
    return out


def seen_bits(parents: list[int]) -> list[int]:
    """For node 0 .. len(parents): the set (bit i: node i) of nodes it attends to, its ancestors and itself."""
    out = [1]
    for i, p in enumerate(parents, start=1):
        out.append(out[p] | (1 << i))
    return out


def path_of(tokens: list[int], parents: list[int], kept: list[int]) -> list[int]:
    """The nodes of the accepted path: the root's descendants whose tokens are `kept`, in order (children of a node
    are distinct tokens, so the path is unique). Returns node numbers, the root left out."""
    path, node = [], 0
    for token in kept:
        node = next(i + 1 for i, (p, t) in enumerate(zip(parents, tokens)) if p == node and t == token)
        path.append(node)
    return path


def tree_row_keys(start: int, bits: int, seq_len: int) -> int:
    """Keys a draft tree's decode row sees: those before its span `start`, and the span's keys whose bits it holds
    that lie before `seq_len` (the length of its kernels.kv_indices.build_tree_kv_indices list). `bits` as the int64
    the mask holds (its sign bit is key 63)."""
    span = max(0, min(seq_len - start, MAX_TREE_KEYS))
    return start + bin(bits & ((1 << span) - 1)).count("1")


def as_signed(bits: int) -> int:
    """A 64-bit set as the int64 a tensor holds."""
    return bits - (1 << 64) if bits >= 1 << 63 else bits
