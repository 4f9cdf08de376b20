"""An EAGLE head drafting trees (--speculative-eagle-topk K > 1; the tree's shape: engine.speculative.tree).

The catch-up is the chain's (engine.speculative.draft_model): one EXTEND over the positions whose head KV is missing,
whose last row gives the root's distribution. Each later step forwards the K frontier nodes of every request as decode
rows: a node at depth j reads its token and its parent's head output (the root's: the catch-up's last row), at head
position fill_len - 2 + j (an EAGLE head's position t holds token t + 1). Its head KV goes to a scratch slot of the
request, the slot at table index fill_len - 1 + (j - 1) * K + f for frontier node f (the request's slots after its
newest token, allocated for the verify: the draft's pool mirrors the target's slot for slot, and the verify later
writes only the target's pool there). A row attends to the request's head KV before fill_len - 1 and, of the scratch
span from there, to its ancestors' and its own (a tree mask: batch.ForwardBatch.tree_mask). The head's KV of these
steps comes from its own outputs: the next catch-up recomputes those positions, as after a chain.

Frontier choices stay on the device; the host reads the chosen tree once, after the last step. The steps replay the
head's CUDA graphs (captured with the tree mask as a static input, for K rows per request): the parents' outputs go
in through the head's static feature rows and come back from its static output rows.
"""

from __future__ import annotations

import torch

from radixmesh.engine.batch import ForwardBatch, ForwardMode
from radixmesh.engine.request import Req
from radixmesh.engine.speculative.tree import TreeShape, frontier_bits, select_tree


class TreeDrafter:
    """`draft`: the EAGLE head's engine.speculative.draft_model.DraftModel (its catch-up and runner are used)."""

    def __init__(self, draft, shape: TreeShape):
        if draft.head is None:
            raise ValueError("draft trees (speculative_eagle_topk > 1) are drafted by an EAGLE head")
        self.draft = draft
        self.shape = shape
        # step j's frontier's own scratch bits, made once
        self.own = [torch.tensor(bits, dtype=torch.int64).to(draft.device) for bits in frontier_bits(shape)]

    def propose(self, reqs: list[Req]) -> tuple[list[list[int]], list[list[int]]]:
        """A tree for each of `reqs` (each holding shape.scratch slots after its newest token): its node tokens and
        node parents (0: the root), nodes in candidate order. Runs on the scheduler thread, between target
        forwards."""
        if not reqs:
            return [], []
        with torch.inference_mode():
            tokens, parents = self._propose(reqs)
        both = torch.stack([tokens, parents]).tolist()  # the one read
        return both[0], both[1]

    def _propose(self, reqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor]:
        draft, k, bsz = self.draft, self.shape.topk, len(reqs)
        logits = draft._forward(draft._catch_up(reqs), draft._catch_up_features(reqs))
        features = draft.head.step_out[:bsz].repeat_interleave(k, dim=0)  # [B * K, h] the root's output
        scores, tokens = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)  # [B, K] depth 1
        dev = scores.device
        cands = [(scores, tokens, torch.full_like(tokens, -1))]
        frontier = torch.arange(k, device=dev).expand(bsz, k)  # candidate numbers of the frontier
        seen = torch.zeros((bsz, k), dtype=torch.int64, device=dev)  # frontier's ancestors' scratch bits
        for j in range(1, self.shape.steps):
            seen = seen | self.own[j - 1]
            out, step_logits = self._step(reqs, j, tokens, seen, features)
            child_lp, child_tok = torch.log_softmax(step_logits.float(), dim=-1).topk(k, dim=-1)  # [B * K, K]
            child_scores = (scores.reshape(-1, 1) + child_lp).view(bsz, k * k)
            child_tok = child_tok.view(bsz, k * k)
            base = self.shape.topk + (j - 1) * k * k
            cands.append((child_scores, child_tok, frontier.repeat_interleave(k, dim=1)))
            if j + 1 == self.shape.steps:
                break
            scores, pick = child_scores.topk(k, dim=-1)  # the next frontier: [B, K] of the K * K children
            tokens = child_tok.gather(1, pick)
            parent = pick // k
            frontier = base + pick
            seen = seen.gather(1, parent)
            rows = (torch.arange(bsz, device=dev)[:, None] * k + parent).reshape(-1)
            features = out[rows]
        all_scores, all_tokens, all_parents = (torch.cat(parts, dim=1) for parts in zip(*cands))
        return select_tree(all_scores, all_tokens, all_parents, self.shape.nodes)

    def _step(self, reqs: list[Req], j: int, tokens: torch.Tensor, seen: torch.Tensor, features: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Depth j's frontier forwarded: tokens, seen [B, K] (device); features [B * K, h] its parents' outputs.
        Returns the head's outputs [B * K, h] and logits [B * K, vocab]."""
        draft, k = self.draft, self.shape.topk
        table = draft.runner.req_to_token
        positions, index, starts, rows = [], [], [], []
        for r in reqs:
            first = r.fill_len - 1  # the request's first scratch slot
            positions += [r.fill_len - 2 + j] * k
            index += [first + (j - 1) * k + f for f in range(k)]
            starts += [first] * k
            rows += [r.pool_idx] * k
        locs = table.host[torch.tensor(rows), torch.tensor(index)]
        draft.pairs[locs] = -1  # KV from the head's own outputs, not the target's hidden states
        n = len(rows)
        batch = ForwardBatch.build(ForwardMode.DECODE, [0] * n, positions, locs, req_pool_indices=rows,
                                   seq_lens=[i + 1 for i in index], extend_lens=[1] * n, device=draft.device,
                                   pending=(list(range(n)), list(range(n)), tokens.reshape(-1)))
        start = torch.tensor(starts, dtype=torch.int64).to(draft.device, non_blocking=True)
        batch.tree_mask = torch.stack([start, seen.reshape(-1)])
        batch.tree_keys_host = [s + j for s in starts]  # (a depth-j node sees its j - 1 ancestors and itself)
        head = draft.head
        staged = n <= head.step_features.shape[0]  # the static rows a CUDA graph reads (more rows: eager)
        if staged:
            head.step_features[:n].copy_(features)
        else:
            head.features_in = features
        try:
            logits = draft.runner.forward(batch)
        finally:
            head.features_in = None
        return head.step_out[:n] if staged else head.last_out, logits
