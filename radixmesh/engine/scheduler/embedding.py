"""An embedding engine's step results: pooled hidden states instead of logits, and no token to sample.

The scheduler plans and launches an embedding request's prefill like any other (chunked, batched, its prefix
matched in the radix cache); the forward returns one pooled row per request (engine.pooling.pool) where a
generation engine returns logits. A chunk that does not end the prompt only adds to the request's running sum
(mean pooling); the chunk that ends it gives the request its normalised vector, and the request finishes (its
pages go back to the cache manager like a finished generation's)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from radixmesh.engine.pooling import Pooling
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.step import StepResult


class EmbeddingSteps:
    def __init__(self, pooling: Pooling):
        self.pooling = pooling

    def resolve(self, result: StepResult, finish: Callable[[Req], None]) -> None:
        """Fold the step's pooled rows ([batch, hidden] float32, in result.output) into its requests; set
        `req.embedding` and call `finish(req)` for each request whose prompt is now complete."""
        pooled, result.output = result.output, None
        reqs = result.batch.reqs
        done = []
        for i, (r, complete) in enumerate(zip(reqs, result.batch.samples)):
            if self.pooling is Pooling.MEAN:
                r.pooled = pooled[i] if r.pooled is None else r.pooled + pooled[i]
            if complete and not r.finished:
                done.append(i)
        if not done:
            return
        reqs = [reqs[i] for i in done]
        if self.pooling is Pooling.MEAN:
            counts = torch.tensor([len(r.input_ids) for r in reqs], dtype=torch.float32, device=pooled.device)
            rows = torch.stack([r.pooled for r in reqs]) / counts[:, None]
        else:
            rows = pooled[torch.tensor(done, device=pooled.device)]
        vectors = F.normalize(rows, dim=-1).cpu().tolist()  # [done, hidden]
        for r, vec in zip(reqs, vectors):
            r.embedding, r.pooled = vec, None
            finish(r)
