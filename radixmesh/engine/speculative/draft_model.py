"""The drafter of STANDALONE (a smaller model with the target's tokenizer) and EAGLE/EAGLE3 (a head reading the
target's hidden states, engine.speculative.eagle_head) speculative decoding.

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

An EAGLE head at position t reads token t + 1 and the target's hidden state at t (engine.speculative.features): its
catch-up covers the positions from draft_len to the one before the newest token (whose successor is known), and
its steps read, instead of the target's hidden state, the head's own output of the step before. Those steps' KV is
not the target-fed one: after a verify, the head's KV counts as valid only up to the position before the newest token
of that step, and the next catch-up recomputes from there with the target's hidden states of the kept tokens.

Prefill/decode disaggregation (engine.disaggregation.draft_state): a prefill worker's head catches up over the prompt
when its first token is sampled and hands its KV over (`handed_over`); a decode worker asks for the head KV its own
prefix cache lacks (`wanted`), writes what comes into its pool and recomputes only the last prompt position from the
target's hidden state sent with it (`received`).
"""

from __future__ import annotations

import torch

from radixmesh.engine.batch import ForwardBatch, ForwardMode
from radixmesh.engine.disaggregation.draft_state import DraftState, DraftWanted, kv_rows_of, row_bytes, write_kv_rows
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.engine.request import Req
from radixmesh.engine.sampling.sampler import SamplingBatch, draw, token_probs, uniforms
from radixmesh.engine.speculative.features import FeatureRows, observe

DRAFT_SALT = 0x27D4EB2F  # a seeded request's draft draws: apart from the verify's two (engine.speculative.verify)


class DraftModel:
    def __init__(self, runner: ModelRunner, eagle: bool = False, layers: tuple[int, ...] = ()):
        """`layers`: the target's hidden states an EAGLE head reads (engine.hidden_capture; empty: the final ones)."""
        self.runner = runner
        self.layers = tuple(layers)
        self.device = runner.device
        self.vocab = runner.model_config.vocab_size
        self.head = runner.model if eagle else None  # an EAGLE head (reads features)
        self.shift = 1 if eagle else 0  # an EAGLE head's position t holds token t + 1
        # an EAGLE head's KV slot -> the token it read there from the target's features (-1: none, or the head's
        # own output): the prefix-cache hits whose draft KV can be kept are those whose slots read their tokens
        self.pairs = torch.full((runner.kv_pool.num_slots,), -1, dtype=torch.int64) if eagle else None
        self._previous_rows = 0  # rows of the head's last forward (its outputs in step_out)

    def observe(self, batch, hidden: torch.Tensor) -> None:
        """A target forward's hidden states, for an EAGLE head's next catch-up (engine.speculative.features). A
        request's first forward starts its draft KV after the prefix-cache hit's part that holds the head's KV of
        these very tokens."""
        if self.head is None:
            return
        for r, first in zip(batch.reqs, batch.prefilling):
            if first and r.draft_len == 0 and r.draft_features is None and r.kv_len:
                r.draft_len = self._kept_prefix(r, r.kv_len)
        width = batch.width if batch.drafts is not None else None
        # (a tree's request holds scratch slots past its nodes: only its `width` rows were computed)
        observe(batch.reqs, [r.extend_len if width is None else min(r.extend_len, width) for r in batch.reqs],
                width, hidden)

    def handed_over(self, req: Req) -> DraftState | None:
        """A prefill-role request whose first token was just sampled: its head catches up over the prompt (P
        positions: the prompt and any resumed tokens), as a colocated engine's first draft step would, and this
        returns the head's KV rows of positions [0, P - 1) (device copies), whether each read the target's hidden
        state, and the target's hidden state at P - 1. None without an EAGLE head."""
        if self.head is None:
            return None
        last = req.fill_len - 2  # (the first token is appended: fill_len is P + 1)
        kept, width = req.draft_features, self.head.feature_width
        like = self.head.input_weight()
        hidden = (kept.read(last, last + 1, width, like) if kept is not None else like.new_zeros((1, width)))[0]
        with torch.inference_mode():
            self._forward(self._catch_up([req]), self._catch_up_features([req]))
        slots = self.runner.req_to_token.read(req.pool_idx, 0, last)
        read = self.pairs[slots] == torch.tensor(req.tokens(1, last + 1), dtype=torch.int64)
        return DraftState(self.layers, 0, kv_rows_of(self.runner.kv_pool, slots), read, last, hidden)

    def wanted(self, req: Req) -> DraftWanted | None:
        """A decode-role request just allocated (its cached prefix `tree_len` long, its prompt P = fill_len): what
        its head lacks, from the first position whose head KV the prefix does not hold. None without an EAGLE head."""
        if self.head is None:
            return None
        return DraftWanted(self._held(req), self.layers, self.head.feature_width, row_bytes(self.runner.kv_pool))

    def _held(self, req: Req) -> int:
        """Leading positions of a decode-role request's cached prefix whose head KV is this request's (never position
        P - 1, whose head KV reads the first token: the decode side computes it)."""
        return self._kept_prefix(req, min(req.tree_len, req.fill_len - 1))

    def received(self, req: Req, state: DraftState | None) -> None:
        """A decode-role request's KV landed (before its first token is appended) with `state` (None: the prefill
        side sent none; the head then catches up over what it lacks reading zeros): the head KV rows go to the
        request's slots from the first position the head lacks, and its first catch-up reads the hidden state of
        the last prompt position. ValueError, before anything changed, for a state another head wrote."""
        if self.head is None:
            return
        pool, last = self.runner.kv_pool, req.fill_len - 1
        if state is not None:
            problem = state.problem(DraftWanted(0, self.layers, self.head.feature_width, row_bytes(pool)))
            if problem is None and state.hidden_position != last:
                problem = f"it ends at position {state.hidden_position}, the prompt at {last}"
            if problem is not None:
                raise ValueError(f"request {req.rid}: the prefill side's draft state does not fit: {problem}")
        held = self._held(req)
        req.draft_len, req.draft_features = held, None
        if state is None:
            return
        end = state.kv_start + state.kv_rows
        if state.kv_start <= held < end:  # (rows starting after `held` would leave a gap: the catch-up redoes all)
            skip = held - state.kv_start
            slots = self.runner.req_to_token.read(req.pool_idx, held, end)
            write_kv_rows(pool, slots, [t[skip:] for t in state.kv])
            tokens = torch.tensor(req.tokens(held + 1, end + 1), dtype=torch.int64)
            self.pairs[slots] = torch.where(state.read_features[skip:], tokens, -1)
            req.draft_len = end
        req.draft_features = FeatureRows(last, state.hidden.to(self.device, self.head.input_weight().dtype)[None])

    def copy_page_prefix(self, src: int, dst: int, n: int) -> None:
        """The target's pool copied the first n slots of page src into page dst (a cached page's tail: engine.cache
        .tails): the head's pool, a slot-for-slot mirror, copies its own, with the tokens they read."""
        self.runner.kv_pool.copy_page_prefix(src, dst, n)
        if self.pairs is not None:
            page = self.runner.kv_pool.page_size
            self.pairs[dst * page:dst * page + n] = self.pairs[src * page:src * page + n]

    def pages_freed(self, pages: torch.Tensor) -> None:
        """The target freed device `pages` (host int64): their slots read no token any more."""
        if self.pairs is not None:
            self.pairs.view(-1, self.runner.kv_pool.page_size)[pages] = -1

    def kept_path(self, req: Req, newest: int, path: list[int]) -> None:
        """After a tree verify: the hidden states of the kept path's nodes (node numbers; the root at `newest`)
        become those of positions newest + 1, newest + 2, ..."""
        if self.head is not None and req.draft_features is not None:
            req.draft_features = req.draft_features.keep_path(newest, path)

    def _kept_prefix(self, req: Req, hit: int) -> int:
        """How many of the first `hit` positions' slots hold the head's KV of this request's tokens."""
        slots = self.runner.req_to_token.read(req.pool_idx, 0, hit)
        same = self.pairs[slots] == torch.tensor(req.tokens(1, hit + 1), dtype=torch.int64)
        return hit if bool(same.all()) else int(same.to(torch.int8).argmin())

    def verified(self, req: Req, newest: int, drafted: int, kept: int) -> None:
        """After a verify: how far the draft's KV stays valid (`newest`: the position of the step's input token)."""
        if self.head is not None:
            if drafted:  # its catch-up reached the position before `newest`; the steps' KV (from the head's own
                req.draft_len = newest  # outputs) is recomputed by the next catch-up
            if req.draft_features is not None:
                req.draft_features = req.draft_features.trim(req.kv_len)
        elif drafted:
            # the draft ran on the newest token and drafts 1 .. k-1: its KV holds where the target kept the input
            req.draft_len = newest + 1 + min(kept, drafted - 1)

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
        logits = self._forward(self._catch_up(sub), self._catch_up_features(sub))
        tokens, q = self._choose(logits, sampling, 0)
        chosen.append(tokens)
        dists.append(q)
        rows = list(range(len(sub)))  # of `sub`, the requests still drafting
        for j in range(1, kmax):
            prev_rows = rows
            rows = [n for n in rows if ks[active[n]] > j]
            at = {n: m for m, n in enumerate(prev_rows)}
            sources = [at[n] for n in rows]
            batch = self._step(sub, rows, j, sources, tokens)
            logits = self._forward(batch, None, sources)
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

    def _forward(self, batch: ForwardBatch, features: torch.Tensor | None, sources: list[int] | None = None
                 ) -> torch.Tensor:
        """The draft's logits for `batch`. An EAGLE head reads `features` (a catch-up's), else its outputs of the
        step before, rows `sources` (copied to the static rows a CUDA graph reads)."""
        head = self.head
        if head is None:
            return self.runner.forward(batch)
        if features is None:
            previous = head.step_out[:self._previous_rows][torch.tensor(sources, device=self.device)]
            head.step_features[:len(sources)].copy_(previous)
        head.features_in = features
        try:
            logits = self.runner.forward(batch)
        finally:
            head.features_in = None
        if features is not None:  # the output rows the first step reads: each request's last
            last = torch.tensor(batch.extend_lens_host, device=self.device).cumsum(0) - 1
            head.step_out[:len(last)].copy_(head.last_out[last])
        self._previous_rows = batch.batch_size
        return logits

    def _catch_up(self, reqs: list[Req]) -> ForwardBatch:
        """Each request's tokens from its first position without draft KV to its newest (to the one before it for an
        EAGLE head, whose positions hold the token after), in one EXTEND."""
        table = self.runner.req_to_token
        ids, positions, locs = [], [], []
        shift = self.shift
        for r in reqs:
            start, end = min(r.draft_len, r.fill_len - 1 - shift), r.fill_len - shift
            r.draft_len = start
            ids += r.tokens(start + shift, end + shift)
            positions += range(start, end)
            locs.append(table.read(r.pool_idx, start, end))
        if self.pairs is not None:
            self.pairs[torch.cat(locs)] = torch.tensor(ids, dtype=torch.int64)  # (_catch_up_features unmarks
            # the rows that had no feature)
        ends = [r.fill_len - shift for r in reqs]
        return ForwardBatch.build(ForwardMode.EXTEND, ids, positions, torch.cat(locs),
                                  req_pool_indices=[r.pool_idx for r in reqs], seq_lens=ends,
                                  extend_lens=[e - r.draft_len for r, e in zip(reqs, ends)], device=self.device)

    def _catch_up_features(self, reqs: list[Req]) -> torch.Tensor | None:
        """The target's hidden states for an EAGLE head's catch-up rows (zeros where none was kept); they are read."""
        if self.head is None:
            return None
        param, width = self.head.input_weight(), self.head.feature_width
        parts = []
        table = self.runner.req_to_token
        for r in reqs:
            start, end = r.draft_len, r.fill_len - 1
            kept = r.draft_features
            lo, hi = (max(start, kept.start), min(end, kept.end)) if kept is not None else (end, end)
            for a, b in ((start, min(lo, end)), (max(hi, start), end)):  # rows without the target's hidden state
                if a < b:
                    self.pairs[table.read(r.pool_idx, a, b)] = -1
            parts.append(kept.read(start, end, width, param) if kept is not None
                         else param.new_zeros((end - start, width)))
            r.draft_features = None
        return torch.cat(parts)

    def _step(self, reqs: list[Req], rows: list[int], j: int, sources: list[int],
              prev: torch.Tensor) -> ForwardBatch:
        """One token for each of reqs[rows]: the one it drafted last (prev[sources], still on the device) at
        position fill_len - 1 + j (for an EAGLE head, whose positions hold the token after, fill_len - 2 + j)."""
        table = self.runner.req_to_token
        chosen = [reqs[n] for n in rows]
        positions = [r.fill_len - 1 - self.shift + j for r in chosen]
        locs = table.host[torch.tensor([r.pool_idx for r in chosen]), torch.tensor(positions)]
        if self.pairs is not None:
            self.pairs[locs] = -1  # KV from the head's own output, not the target's hidden state
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
