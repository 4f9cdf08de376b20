"""The target's hidden states an EAGLE draft reads: kept per request, from the forward that computed them until the
draft's next catch-up (engine.speculative.draft_model) reads them.

A forward of the target keeps a row of hidden states per token (engine.hidden_capture); `observe` hands each
request the rows of its own positions: an extend's chunk, a decode's one token, a verify's newest token and drafts
(the rows past the ones the verify keeps are dropped once its outcome is known: `FeatureRows.trim`).
"""

from __future__ import annotations

import torch

from radixmesh.engine.request import Req


class FeatureRows:
    """Hidden states of consecutive positions [start, end) of one request."""

    def __init__(self, start: int, rows: torch.Tensor):
        self.start = start
        self.chunks = [rows]
        self.end = start + rows.shape[0]

    def extend(self, start: int, rows: torch.Tensor) -> "FeatureRows":
        """These rows added (at `start`); a gap or an overlap starts afresh from them."""
        if start != self.end:
            return FeatureRows(start, rows)
        self.chunks.append(rows)
        self.end += rows.shape[0]
        return self

    def trim(self, end: int) -> "FeatureRows | None":
        """Only positions before `end` kept."""
        if end <= self.start:
            return None
        if end < self.end:
            self.chunks = [self.rows()[:end - self.start]]
            self.end = end
        return self

    def keep_path(self, root: int, path: list[int]) -> "FeatureRows | None":
        """A tree verify's rows (node n at position root + n) reordered: node path[i]'s row to position root + 1 + i;
        the rows after the path's are dropped."""
        at = [root + n - self.start for n in path]
        if root < self.start or any(not 0 <= a < self.end - self.start for a in at):
            return self.trim(root + 1)  # (rows missing: the next catch-up reads zeros from the gap on)
        rows = self.rows()
        index = torch.tensor(at, dtype=torch.int64, device=rows.device)
        self.chunks = [torch.cat([rows[:root + 1 - self.start], rows[index]])]
        self.end = root + 1 + len(path)
        return self

    def rows(self) -> torch.Tensor:
        if len(self.chunks) > 1:
            self.chunks = [torch.cat(self.chunks)]
        return self.chunks[0]

    def read(self, start: int, end: int, width: int, like: torch.Tensor) -> torch.Tensor:
        """Rows of positions [start, end): zeros where none was kept (prefix-cache hits carry no hidden states;
        KV from a prefill worker neither)."""
        out = like.new_zeros((end - start, width))
        lo, hi = max(start, self.start), min(end, self.end)
        if lo < hi:
            out[lo - start:hi - start] = self.rows()[lo - self.start:hi - self.start]
        return out


def observe(reqs: list[Req], extend_lens: list[int], width: int | None, hidden: torch.Tensor) -> None:
    """Give each request its rows of a target forward's hidden states (before the scheduler advances kv_len).
    `extend_lens`: each request's new tokens; `width`: a verify's rows per request (its newest token and drafts
    first), None for an extend or a plain decode (rows back to back)."""
    at = 0
    for r, n in zip(reqs, extend_lens):
        rows = hidden[at:at + n]
        at += width if width is not None else n
        r.draft_features = FeatureRows(r.kv_len, rows) if r.draft_features is None else \
            r.draft_features.extend(r.kv_len, rows)
