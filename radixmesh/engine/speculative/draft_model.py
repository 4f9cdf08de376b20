"""STANDALONE speculative decoding's drafter: a smaller model with the target's tokenizer.

Its KV pool mirrors the target's slot for slot: the draft runner shares the target's request-to-token table, so a
position's draft KV lives in the draft pool at the slot the target's KV has in its own. The draft's KV is computed
lazily: each request remembers how many of its positions hold valid draft KV (`Req.draft_len`); a decode step first
feeds the draft every token from there to the newest (the whole prompt the first time: prefix-cache hits, host-tier
loads and KV from a prefill worker carry only the target's KV), then k - 1 more steps of one token each, each on the
token the draft chose before. The tokens are chosen on the device (the next step's input is filled there, as overlap
scheduling does), and the host reads the drafts once, after the last step.

Greedy requests draft the argmax; sampled ones draw from the draft's distribution with the request's temperature
and filters (q), which the verify needs for its acceptance test (engine.speculative.verify). After the verify keeps
`a` of k drafts, the draft's KV is valid up to the newest position whose input the target kept (SpecSteps.verified).
"""

from __future__ import annotations

import torch

from radixmesh.engine.batch import ForwardBatch, ForwardMode
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.engine.request import Req
from radixmesh.engine.sampling.sampler import SamplingBatch, draw, token_probs, uniforms

DRAFT_SALT = 0x27D4EB2F  # a seeded request's draft draws: apart from the verify's two (engine.speculative.verify)


class DraftModel:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.device = runner.device
        self.vocab = runner.model_config.vocab_size

    def propose(self, reqs: list[Req], ks: list[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        """ks[i] drafted tokens for reqs[i] (its KV slots up to position fill_len - 1 + ks[i] allocated), and the
        distributions they were drawn from, [batch, 1 + max k, vocab] (None when every drafting request is greedy).
        Runs on the scheduler thread, between target forwards."""
        with torch.inference_mode():
            return self._propose(reqs, ks)

    def _propose(self, reqs: list[Req], ks: list[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        active = [i for i, k in enumerate(ks) if k]
        drafts: list[list[int]] = [[] for _ in reqs]
        if not active:
            return drafts, None
        sub = [reqs[i] for i in active]
        sampling = self._sampling(sub)
        kmax = max(ks[i] for i in active)
        keep_q = not sampling.all_greedy
        chosen, dists = [], []
        logits = self.runner.forward(self._catch_up(sub))
        tokens, q = self._choose(logits, sampling, 0)
        chosen.append(tokens)
        dists.append(q)
        rows = list(range(len(sub)))  # of `sub`, the requests still drafting
        for j in range(1, kmax):
            prev_rows = rows
            rows = [n for n in rows if ks[active[n]] > j]
            at = {n: m for m, n in enumerate(prev_rows)}
            batch = self._step(sub, rows, j, [at[n] for n in rows], tokens)
            logits = self.runner.forward(batch)
            step_sampling = sampling if len(rows) == len(sub) else _rows(sampling, rows, [sub[n] for n in rows],
                                                                          self.device)
            step_tokens, step_q = self._choose(logits, step_sampling, j)
            tokens = step_tokens
            full = torch.zeros(len(sub), dtype=torch.int64, device=self.device)
            full[torch.tensor(rows, device=self.device)] = step_tokens
            chosen.append(full)
            if keep_q:  # (rows still drafting may all be greedy: no q, and none needed for them)
                q_full = torch.zeros((len(sub), self.vocab), dtype=torch.float32, device=self.device)
                if step_q is not None:
                    q_full[torch.tensor(rows, device=self.device)] = step_q
                dists.append(q_full)
        host = torch.stack(chosen, dim=1).tolist()  # the one read: [active, kmax]
        for n, i in enumerate(active):
            drafts[i] = host[n][:ks[i]]
        if not keep_q:
            return drafts, None
        probs = torch.zeros((len(reqs), 1 + kmax, self.vocab), dtype=torch.float32, device=self.device)
        probs[torch.tensor(active, device=self.device), :kmax] = torch.stack(dists, dim=1)
        return drafts, probs

    def _sampling(self, reqs: list[Req]) -> SamplingBatch:
        """Temperature and filters of each request: the draft's q may be any distribution, so penalties, biases,
        masks and grammars are left to the target. Seeded requests draw from (seed, step), so their outputs stay
        what they are in any batch."""
        batch = SamplingBatch.build(reqs, False, self.vocab, self.device, offsets=[0] * len(reqs))
        return batch._replace(penalty_rows=None, penalties=None, masked=None, bias=None)

    def _choose(self, logits: torch.Tensor, sampling: SamplingBatch, j: int
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's drafted token j (and q_j, unless every row is greedy)."""
        best = logits.argmax(dim=-1)
        if sampling.all_greedy:
            return best, None
        q = token_probs(logits, sampling)
        if sampling.seeds is not None:
            sampling = sampling._replace(steps=sampling.steps + j)
        drawn = draw(q, uniforms(sampling, self.runner.generator, self.device, DRAFT_SALT))
        return torch.where(sampling.greedy, best, drawn), q

    def _catch_up(self, reqs: list[Req]) -> ForwardBatch:
        """Each request's tokens from its first position without draft KV to its newest, in one EXTEND."""
        table = self.runner.req_to_token
        ids, positions, locs = [], [], []
        for r in reqs:
            start, end = r.draft_len, r.fill_len
            ids += r.tokens(start, end)
            positions += range(start, end)
            locs.append(table.read(r.pool_idx, start, end))
        return ForwardBatch.build(ForwardMode.EXTEND, ids, positions, torch.cat(locs),
                                  req_pool_indices=[r.pool_idx for r in reqs], seq_lens=[r.fill_len for r in reqs],
                                  extend_lens=[r.fill_len - r.draft_len for r in reqs], device=self.device)

    def _step(self, reqs: list[Req], rows: list[int], j: int, sources: list[int],
              prev: torch.Tensor) -> ForwardBatch:
        """One token for each of reqs[rows]: the one it drafted last (prev[sources], still on the device) at
        position fill_len - 1 + j."""
        table = self.runner.req_to_token
        chosen = [reqs[n] for n in rows]
        positions = [r.fill_len - 1 + j for r in chosen]
        locs = table.host[torch.tensor([r.pool_idx for r in chosen]), torch.tensor(positions)]
        return ForwardBatch.build(ForwardMode.DECODE, [0] * len(chosen), positions, locs,
                                  req_pool_indices=[r.pool_idx for r in chosen], seq_lens=[p + 1 for p in positions],
                                  extend_lens=[1] * len(chosen), device=self.device,
                                  pending=(list(range(len(chosen))), sources, prev))


def _rows(batch: SamplingBatch, rows: list[int], reqs: list[Req], device: torch.device) -> SamplingBatch:
    """The sampling rows `rows` of `batch` (of requests `reqs`): its per-row tensors indexed (what _sampling cleared
    stays None)."""
    idx = torch.tensor(rows, device=device)

    def pick(t):
        return t[idx] if isinstance(t, torch.Tensor) else t

    return batch._replace(temperatures=pick(batch.temperatures), greedy=pick(batch.greedy), top_k=pick(batch.top_k),
                          top_p=pick(batch.top_p), min_p=pick(batch.min_p), seeds=pick(batch.seeds),
                          steps=pick(batch.steps), all_greedy=all(r.sampling.greedy for r in reqs))
