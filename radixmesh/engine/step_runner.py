"""The scheduler's Runner (engine.scheduler.step) over one ModelRunner.

`execute` turns a ScheduledBatch into device inputs (engine.scheduler.batch_builder) and queues the forward (or, for an
embedding engine, the pooled forward). `sample` builds the sampling inputs from the requests' state (temperatures,
filters, penalties, min_new_tokens, logit_bias, seeds, grammar masks), keeps the penalty counts, samples, and copies
the results to pinned host memory behind an event, so reading them (`StepResult.wait`) blocks only on that copy.
"""

from __future__ import annotations

from typing import Any

import torch

from radixmesh.engine.batch import ForwardMode
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.engine.pooling import Pooling
from radixmesh.engine.request import Req
from radixmesh.engine.sampling.sampler import SampleResult, SamplingBatch, verify_extras
from radixmesh.engine.scheduler.batch_builder import build_decode, build_extend, build_tree_verify, build_verify
from radixmesh.engine.scheduler.logprob_lists import to_host, token_logprob_rows
from radixmesh.engine.scheduler.step import Resolved, ScheduledBatch, StepResult
from radixmesh.engine.speculative.tree_verify import verify_tree_step
from radixmesh.engine.speculative.verify import VerifyLayout, VerifyResult


def _map_tensors(obj: Any, fn) -> Any:
    """Apply fn to every tensor inside nested tuples / NamedTuples (None stays None)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        values = [_map_tensors(x, fn) for x in obj]
        return type(obj)(*values) if hasattr(obj, "_fields") else tuple(values)
    return obj


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


class HostCopy:
    """A SampleResult on its way to pinned host memory; `wait` blocks until it is there and reads it as Resolved."""

    def __init__(self, result, device: torch.device):
        if device.type != "cuda":
            self.result, self.event = result, None
            return
        self.result = _map_tensors(result, _pinned_copy)
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self) -> Resolved:
        if self.event is not None:
            self.event.synchronize()
        return self.read(self.result)

    @staticmethod
    def read(r: SampleResult) -> Resolved:
        prompt = to_host(r.prompt.chosen, r.prompt.top, r.prompt.by_id) if r.prompt is not None else None
        return Resolved([[t] for t in r.next_ids.tolist()], token_logprob_rows(r), prompt)


class VerifyCopy(HostCopy):
    """A VerifyResult on its way to the host: each row's kept drafts and the token after them."""

    @staticmethod
    def read(r: VerifyResult) -> Resolved:
        accepted = r.accepted.tolist()
        tokens = [row[:a + 1] for row, a in zip(r.tokens.tolist(), accepted)]
        if r.logprobs is None:
            return Resolved(tokens, None, None)
        chosen = r.logprobs.tolist()
        top = [[list(zip(v, i)) for v, i in zip(vs, ids)] for vs, ids in zip(*(x.tolist() for x in r.top_logprobs))] \
            if r.top_logprobs is not None else None
        by_id = r.token_ids_logprobs.tolist() if r.token_ids_logprobs is not None else None
        rows = [[(chosen[i][j], top[i][j] if top else None, by_id[i][j] if by_id else None) for j in range(a + 1)]
                for i, a in enumerate(accepted)]
        return Resolved(tokens, rows, None)


class PooledResult:
    """An embedding step has nothing to sample: its pooled rows stay in StepResult.output."""

    def wait(self) -> Resolved:
        return Resolved([], None, None)


class StepRunner:
    """Runs ScheduledBatches on `model`. `pooling`: an embedding engine's (its forwards pool instead of sampling)."""

    def __init__(self, model: ModelRunner, pooling: Pooling | None = None):
        self.model = model
        self.pooling = pooling
        self.device = model.device
        self.vocab_size = model.model_config.vocab_size

    def execute(self, batch: ScheduledBatch) -> StepResult:
        result = self._execute(batch)
        if getattr(self.model, "capture", None) is not None:  # (an EAGLE target's; a stand-in model has none)
            result.hidden = self.model.captured
        return result

    def _execute(self, batch: ScheduledBatch) -> StepResult:
        if batch.trees is not None:
            return StepResult(batch, self.model.forward(build_tree_verify(batch.reqs, batch.trees, batch.locs,
                                                                          self.device, batch.width)))
        if batch.drafts is not None:
            return StepResult(batch, self.model.forward(build_verify(batch.reqs, batch.drafts, batch.locs,
                                                                     self.device, batch.width)))
        if batch.mode is ForwardMode.EXTEND:
            forward, plan = build_extend(batch.reqs, batch.locs, self.device, batch.after)
        else:
            forward, plan = build_decode(batch.reqs, batch.locs, self.device, batch.after), None
        if self.pooling is not None:
            return StepResult(batch, self.model.forward_pooled(forward, self.pooling))
        return StepResult(batch, self.model.forward(forward), plan)

    def sample(self, result: StepResult) -> None:
        if self.pooling is not None:
            result.host = PooledResult()
            return
        batch = result.batch
        reqs = batch.reqs
        self._reset_penalties(batch)
        if batch.drafts is not None:
            sampled, host = self._verify(result)
        else:
            sampling = SamplingBatch.build(reqs, any(r.return_logprob for r in reqs), self.vocab_size, self.device)
            sampled = self.model.sample(result.output, len(reqs), sampling, result.prompt_plan)
            host = HostCopy(sampled, self.device)
            self._record_penalties(batch, sampled.next_ids[:, None])
        result.host = host
        result.output, result.sampled = None, sampled
        result.rows = {id(r): i for i, (r, s) in enumerate(zip(reqs, batch.samples)) if s}

    def _verify(self, result: StepResult) -> tuple[SampleResult, VerifyCopy]:
        """A verify step's tokens: sampling rows for every position of every request (position j as if the j
        drafted tokens before it were output: min_new_tokens, seeds, penalty counts, grammar state), checked against
        the drafts (engine.speculative.verify); the penalty counts take every token a row produced."""
        batch = result.batch
        reqs = batch.reqs
        width = batch.width
        if batch.trees is not None:
            verified = verify_tree_step(self.model, batch, result.output)
        else:
            layout = VerifyLayout.build(batch.drafts, self.device, batch.width)
            width = layout.width
            sampling = SamplingBatch.build([r for r in reqs for _ in range(width)],
                                           any(r.return_logprob for r in reqs), self.vocab_size, self.device,
                                           offsets=list(range(width)) * len(reqs))
            sampling = verify_extras(sampling, reqs, batch.drafts, width, self.vocab_size, self.device)
            verified = self.model.verify(result.output, layout, sampling, batch.draft_probs)
        produced = torch.arange(width, device=verified.tokens.device)[None, :] <= verified.accepted[:, None]
        self._record_penalties(batch, verified.tokens, produced)
        return SampleResult(verified.next_ids, None), VerifyCopy(verified, self.device)

    def heartbeat(self) -> None:
        self.model.heartbeat()

    def _reset_penalties(self, batch: ScheduledBatch) -> None:
        """A penalized request sampling for the first time on its table row counts its prompt and output so far
        there (a new request, a retracted one back, a decode-role one whose first token came from its peer)."""
        for r, samples in zip(batch.reqs, batch.samples):
            if samples and r.sampling.penalized and not r.finished and r.penalty_row != r.pool_idx:
                self.model.penalties.reset_row(r.pool_idx, r.input_ids, r.output_ids)
                r.penalty_row = r.pool_idx

    def _record_penalties(self, batch: ScheduledBatch, tokens: torch.Tensor, produced: torch.Tensor | None = None
                          ) -> None:
        """Count this step's tokens for every penalized request that samples now: tokens [batch, width], of which
        `produced` [batch, width] (None: all) are the row's."""
        reqs: list[Req] = batch.reqs
        idx = [i for i, r in enumerate(reqs) if batch.samples[i] and r.sampling.penalized and not r.finished
               and r.sampling.max_new_tokens > 0]
        if idx:
            dev = tokens.device
            pick = torch.tensor(idx).to(dev, non_blocking=True)
            rows = torch.tensor([reqs[i].pool_idx for i in idx], dtype=torch.int64).to(dev, non_blocking=True)
            rows, toks = rows[:, None].expand(-1, tokens.shape[1]), tokens[pick]
            if produced is not None:
                keep = produced[pick]
                rows, toks = rows[keep], toks[keep]
            self.model.penalties.record(rows.reshape(-1), toks.reshape(-1))
