"""The KV memory a sliding window lets a request give back, for models whose layers ALL slide (Mistral v0.1's
sliding_window, Qwen2 with use_sliding_window over every layer, ...).

The query at position p of a layer with window w sees keys p - w < j <= p (engine.models.attention_spec). A request's
next query is at position kv_len (a decode token or the first token of its next prefill chunk) and every later one
is further on, so with `window` the largest window of the layers, keys at positions <= kv_len - window are never read
again: pages wholly before kv_len - window + 1 can go back to the pool while the request runs.

What is freed, and what the radix cache may keep (the invariant):
- Only pages the request owns (table positions [tree_len, alloc_len), manager.py's layout) are freed: its generated
  tokens, and with --disable-radix-cache its prompt too. The tree's pages stay, shared and complete: the prompt
  prefix a request inserts while it runs (cache_unfinished, as without a window, so other requests hit it at once)
  is locked by that request until it ends, then evictable as any cached prefix. `freed_to[row]` (page-aligned):
  positions [tree_len, freed_to) of that row point at pages already freed. Nothing reads them: every backend reads
  only inside each layer's window (Triton, FlashInfer's window page lists) or masks what lies outside it
  (torch_native: weight 0 on finite values).
- The radix tree holds complete prefixes only: every page of a node's path is live on the device. A request that
  freed pages of its own (freed_to > tree_len) inserts nothing more, at release or later; what it inserted before
  stays. SGLang's SWA radix cache goes further (tombstoned nodes whose early pages are gone stay matchable when the
  last `window` tokens of a match are live, so a long conversation's answer is cached too): not built here.
- Requests handed between prefill and decode workers keep every page (their pages travel whole).
Pages slid behind the window while a step is scheduled go back to the pool when the step after it is scheduled
(`settle`): the step in flight when they slid may still read them, and a page handed to another request can be
written by more than the compute stream (a prefill/decode transfer into a decode-role request's pages), so ordering
on one stream is not enough. By the next schedule that step has been processed (engine.scheduler: schedule N+1,
execute N+1, process N).
"""

from __future__ import annotations

from typing import Callable

import torch

from radixmesh.engine.cache.req_to_token import ReqToTokenPool
from radixmesh.engine.request import Req


class SlidingWindowPages:
    """Frees the pages every layer's window has left behind, for the cache manager (the only caller). `free`: the
    manager's, given the slots of whole pages (runs that start and end on page boundaries)."""

    def __init__(self, req_to_token: ReqToTokenPool, page: int, free: Callable[[torch.Tensor], None], window: int):
        if window < 1:
            raise ValueError(f"a sliding window holds at least one token, not {window}")
        self.req_to_token, self.page, self.free = req_to_token, page, free
        self.window = window
        rows = req_to_token.host.shape[0]
        self.freed_to = torch.zeros(rows, dtype=torch.int64)  # per table row, page-aligned (module docstring)
        self.freed_tokens = 0  # monotonic, for tests and metrics
        self._slid: list[torch.Tensor] = []  # slots no request holds, for the pool at the next settle()

    def admitted(self, req: Req) -> None:
        """A request took table row `req.pool_idx`: nothing of it is freed yet."""
        self.freed_to[req.pool_idx] = 0

    def slid(self, req: Req) -> bool:
        """Whether `req` gave back pages of its own (then its prefix is incomplete: not for the radix tree)."""
        return int(self.freed_to[req.pool_idx]) > req.tree_len

    def live_from(self, req: Req, owned_from: int) -> int:
        """The first position of the request's own slots still held, given that it owns [owned_from, alloc_len)."""
        return max(owned_from, int(self.freed_to[req.pool_idx]))

    def slide(self, reqs: list[Req]) -> None:
        """Free the pages of `reqs` that lie wholly before their next query's window, in one vectorized pass."""
        reqs = [r for r in reqs if r.handoff is None and r.pool_idx is not None]
        if not reqs:
            return
        page = self.page
        rows = torch.tensor([r.pool_idx for r in reqs], dtype=torch.int64)
        kv = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
        tree = torch.tensor([r.tree_len for r in reqs], dtype=torch.int64)
        start = torch.maximum(self.freed_to[rows], tree)
        end = (kv - self.window + 1).clamp(min=0) // page * page  # page-aligned: the pages before it are unread
        n = (end - start).clamp(min=0)
        total = int(n.sum())
        if total == 0:
            return
        ends = n.cumsum(0)
        pos = torch.arange(total) - (ends - n).repeat_interleave(n) + start.repeat_interleave(n)
        self._slid.append(self.req_to_token.host[rows.repeat_interleave(n), pos])
        moved = n > 0
        self.freed_to[rows[moved]] = end[moved]
        self.freed_tokens += total


    def settle(self) -> None:
        """Give the pool the pages slid before the previous schedule (module docstring). Call once per schedule."""
        if self._slid:
            slots, self._slid = torch.cat(self._slid), []
            self.free(slots)


def all_layers_window(windows: tuple[int | None, ...]) -> int | None:
    """The window pages can be freed by: the largest layer window when every layer slides; None when any layer
    attends to every earlier token (hybrid models such as Gemma 2/3 keep every page) or none slides."""
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)
