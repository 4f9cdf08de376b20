"""Speculative decoding's part of the scheduler's steps: drafts for a decode step, and the verify's outcome applied.

A decode step under speculation gives each running request up to `max_draft` drafted tokens (engine.speculative.ngram,
or a draft model) after its newest one, with KV slots for all of them; the forward (a verify) computes them all at once,
in `width` rows per request whatever each drafted (padding fills the rest): every verify of a batch of this size has
one shape (one CUDA graph), so a position's numerics never depend on how many drafts its step had, and a greedy
request's output is the same whichever drafts were kept. The width is 1 + max_draft, less where the batch would
outgrow the largest CUDA graph (`max_rows`); at 1 the step is a plain decode. Once the step's tokens are read, a
request that kept `a` of its `k` drafts gets a + 1 tokens; its KV is valid for its newest token and the kept drafts,
so kv_len steps back by k - a, and the pages that held only rejected drafts go back to the pool once the step's
requests are processed (CacheManager.trim, free_trimmed), before anything allocates again. The prefix cache only
ever sees tokens the request produced: it keys pages by fill_ids, and caches at most kv_len of them.

An EAGLE head may draft a tree instead (--speculative-eagle-topk > 1; engine.speculative.tree): `width` is then the
tree's num_draft_tokens (its nodes are the step's drafts, in node order), and a request takes the tree's scratch
slots after its newest token (the nodes' and the draft steps' KV). The verify keeps a root-to-node path and moves
its KV to the consecutive positions after the newest token (engine.speculative.tree_verify), so the same trim frees
everything past the kept tokens. A request drafts a tree only when all of it fits (its length limit, the context,
the free pages); otherwise it verifies its newest token alone.

Every request may draft: grammars, penalties, min_new_tokens and seeds are applied per drafted position (the
step runner builds each position's sampling row as if the drafted tokens before it were output). Drafts are skipped
where the pool has no free page for them: a draft never evicts cached prefixes.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from radixmesh.engine.cache.manager import CacheManager
from radixmesh.engine.request import Req
from radixmesh.engine.speculative.tree import path_of


class Drafter(Protocol):
    """One request's source of drafts (engine.speculative.ngram.NgramIndex)."""

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens likely to follow `tokens`, the request's prompt and output so far."""
        ...


class SpecSteps:
    """`new_drafter`: makes a request's Drafter, on its first decode step under speculation. `model`: a draft
    model that drafts for the whole batch at once (engine.speculative.draft_model.DraftModel); when given, it drafts
    instead of the per-request drafters. `corpus`: where finished requests' sequences go for later requests' drafts
    (engine.speculative.ngram.NgramCorpus). `max_rows`: the largest decode batch a CUDA graph runs (None: any).
    `tree`: an EAGLE head drafting trees (engine.speculative.tree_draft.TreeDrafter), instead of `model`'s chains."""

    def __init__(self, cache: CacheManager, max_draft: int, new_drafter: Callable[[Req], Drafter] | None,
                 context_len: int, model=None, corpus=None, max_rows: int | None = None, tree=None):
        self.cache = cache
        self.tree = tree
        # the last draft's trees, per request (node tokens, node parents; both empty: none), None for chains
        self.trees: list[tuple[list[int], list[int]]] | None = None
        self._tree_of: dict[int, tuple[list[int], list[int], int]] = {}  # id(req) -> tokens, parents, slots
        self.corpus = corpus
        self.max_rows = max_rows
        self._freed: list[torch.Tensor] = []  # a verify's rejected drafts' slots, until `flush`
        self.max_draft = max_draft
        self.new_drafter = new_drafter
        self.context_len = context_len
        self.model = model
        # since start: verify (or plain decode) rows, tokens drafted, drafts kept
        self.stats = {"spec_verify_rows": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}

    def budget(self, req: Req, width: int) -> int:
        """Drafted tokens `req` may verify in a decode step of `width` rows per request."""
        # the step yields up to k + 1 tokens: within max_new_tokens and the context
        room = min(req.remaining_new_tokens(), self.context_len - req.fill_len) - 1
        return max(0, min(width - 1, room))

    def width(self, batch_size: int) -> int:
        """Rows per request of a verify of this many requests."""
        if self.tree is not None:  # (a tree is verified whole: more rows than the largest graph run eagerly)
            return self.tree.shape.num_draft_tokens
        width = 1 + self.max_draft
        if self.max_rows is not None:
            width = min(width, max(1, self.max_rows // batch_size))
        return width

    def draft(self, reqs: list[Req]) -> tuple[list[list[int]], object, int]:
        """Drafts for a decode step's requests (each holding the slot of its newest token already); allocates
        their slots and sets each request's extend_len to 1 + its draft's length. Also returns the distributions
        the drafts were drawn from (a draft model's device tensor [batch, width, vocab], engine.speculative.verify's
        draft_probs; None: one-hot drafts), and the verify's rows per request (1: a plain decode, nothing drafted)."""
        width = self.width(len(reqs))
        self.trees = None
        self._tree_of = {}  # (a request that left before its verify was processed leaves nothing behind)
        if width == 1:
            return [[] for _ in reqs], None, 1
        if self.tree is not None:
            return self._tree_drafts(reqs), None, width
        if self.model is not None:
            return *self._model_drafts(reqs, width), width
        drafts = []
        for r in reqs:
            k = self.budget(r, width)
            draft: list[int] = []
            if k:
                if r.drafter is None:
                    r.drafter = self.new_drafter(r)
                draft = r.drafter.propose(r.fill_ids, k)[:k]
                draft = draft[:self._room(r, len(draft))]
            drafts.append(draft)
        ks = self._alloc(reqs, [len(d) for d in drafts])
        return [d[:k] for d, k in zip(drafts, ks)], None, width

    def _alloc(self, reqs: list[Req], ks: list[int]) -> list[int]:
        """Slots for ks[i] drafted tokens of each request, at once where the free pages hold them all (else request
        by request, each draft cut to what is still free: drafts never evict the prefix cache); sets extend_len.
        Returns the drafts' lengths."""
        cache = self.cache
        need = sum(cache.pages_for(r.alloc_len, k) for r, k in zip(reqs, ks))
        if need > cache.pages.num_free or cache.alloc_spans(reqs, ks) is None:
            ks = [self._alloc_one(r, k) for r, k in zip(reqs, ks)]
        for r, k in zip(reqs, ks):
            r.extend_len = 1 + k
        return ks

    def _model_drafts(self, reqs: list[Req], width: int) -> tuple[list[list[int]], object]:
        """The draft model's: slots first (its forwards write their KV there), then up to width - 1 tokens each."""
        ks = self._alloc(reqs, [self._room(r, self.budget(r, width)) for r in reqs])
        drafts, probs = self.model.propose(reqs, ks)
        if probs is not None and probs.shape[1] < width:  # [batch, 1 + longest draft, vocab] -> [batch, width, vocab]
            probs = torch.nn.functional.pad(probs, (0, 0, 0, width - probs.shape[1]))
        return drafts, probs

    def _tree_drafts(self, reqs: list[Req]) -> list[list[int]]:
        """Each request's tree (where all of it fits; its node tokens are its drafts), its scratch slots allocated."""
        shape = self.tree.shape
        room = shape.scratch
        ks = [room if self._tree_fits(r, room) else 0 for r in reqs]
        ks = self._alloc(reqs, ks)
        for r, k in zip(reqs, ks):
            if 0 < k < room:  # cut short by the pages left: no tree, its slots back
                self.cache.trim(r, r.alloc_len - k)
                r.extend_len = 1
        on = [r for r, k in zip(reqs, ks) if k == room]
        tokens, parents = self.tree.propose(on)
        made = iter(zip(tokens, parents))
        self.trees = [next(made) if k == room else ([], []) for k in ks]
        for r, (toks, pars) in zip(reqs, self.trees):
            if toks:
                self._tree_of[id(r)] = (toks, pars, room)
        return [toks for toks, _ in self.trees]

    def _tree_fits(self, req: Req, slots: int) -> bool:
        """A tree's tokens within the request's length limit and its slots within the context and the free pages."""
        shape = self.tree.shape
        longest = min(shape.steps, shape.nodes)  # drafted tokens a tree can keep
        room = min(req.remaining_new_tokens(), self.context_len - req.fill_len) - 1
        return room >= longest and req.fill_len + slots <= self.context_len and self._room(req, slots) == slots

    def _alloc_one(self, req: Req, k: int) -> int:
        k = self._room(req, k)
        return k if k and self.cache.alloc_tokens(req, k) is not None else 0

    def _room(self, req: Req, k: int) -> int:
        """Of k drafted tokens, those whose slots fit in the request's last page and the free pages."""
        cache = self.cache
        return min(k, -req.alloc_len % cache.page + cache.pages.num_free * cache.page)

    def verified(self, req: Req, drafted: int, tokens: list[int]) -> None:
        """A verify's outcome for `req` (which drafted `drafted` tokens and got `tokens`, the kept drafts and the
        target's next token): the rejected drafts' KV slots are dropped (a tree's kept path's KV was moved to the
        consecutive positions by the verify)."""
        kept = len(tokens) - 1
        self.count(req, drafted, kept)
        tree = self._tree_of.pop(id(req), None)
        slots = tree[2] if tree is not None else drafted  # a tree's scratch slots past its nodes are dropped too
        newest = req.kv_len - 1 - slots
        rejected = slots - kept
        if tree is not None and self.model is not None:  # its kept nodes' hidden states, in path order
            self.model.kept_path(req, newest, path_of(tree[0], tree[1], tokens[:kept]))
        if rejected and req.pool_idx is not None:
            req.kv_len -= rejected
            self.cache.trim(req, req.kv_len, self._freed)
        if self.model is not None:
            self.model.verified(req, newest, drafted, kept)

    def forwarded(self, batch, hidden: torch.Tensor) -> None:
        """A target forward's kept hidden states (an EAGLE draft reads them), before its requests advance."""
        if self.model is not None:
            self.model.observe(batch, hidden)

    def flush(self) -> None:
        """After a verify's requests are processed: the pages of their rejected drafts go back to the pool."""
        self.cache.free_trimmed(self._freed)

    def finished(self, req: Req) -> None:
        """`req` is done: its prompt and output join the corpus."""
        if self.corpus is not None and req.output_ids:
            self.corpus.add(req.fill_ids)

    def count(self, req: Req, drafted: int = 0, kept: int = 0) -> None:
        """One decode forward of `req` under speculation (a plain decode: nothing drafted)."""
        stats = self.stats
        stats["spec_verify_rows"] += 1
        stats["spec_draft_tokens"] += drafted
        stats["spec_accepted_tokens"] += kept
        if req.spec is not None:
            req.spec.verify_ct += 1
            req.spec.draft_tokens += drafted
            req.spec.accepted_tokens += kept
