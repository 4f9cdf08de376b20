"""The step contract between the scheduler and what runs its forwards (a `Runner`).

One step, in order:

    batch = scheduler.schedule()      which requests run, their new tokens and KV slots (host bookkeeping only)
    result = runner.execute(batch)    the forward queued on the device; nothing waits for it
    runner.sample(result)             the next tokens chosen on the device and copied towards the host
    scheduler.process(result)         the tokens read on the host and acted on (append, finish, emit, hand over)

`sample` reads the requests' host state (grammar matchers, penalty counts, token counts for min_new_tokens and seeded
draws), so it runs only once every earlier step is processed. With overlap scheduling the scheduler executes step
N+1 before it processes step N (the CPU's bookkeeping of N runs while the GPU computes N+1), then samples N+1: a
request whose newest token is still on the device takes it as its input from `batch.after`, the step in flight.
A speculative runner (draft and verify) keeps the same contract: `Resolved.tokens` holds every token a row accepted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from radixmesh.engine.batch import ForwardMode
from radixmesh.engine.request import Req
from radixmesh.engine.sampling.sampler import SampleResult


class PromptLogprobPlan(NamedTuple):
    """The prompt logprobs one forward computes (from its extra logit rows, after each request's last token)."""

    counts: list[int]  # per request of the batch: prompt logprobs this forward yields
    targets: list[int]  # the prompt tokens they are for, in batch order
    top_k: int  # the largest top_logprobs_num among those requests
    token_ids: list[list[int]] | None  # per extra position: its request's token_ids_logprob, zero-padded


@dataclass(slots=True)
class ScheduledBatch:
    """One forward the scheduler chose. The runner reads each request's `kv_len` and `extend_len` (tokens
    fill_ids[kv_len : kv_len + extend_len] are new); the scheduler advances them after `execute` returns."""

    reqs: list[Req]
    mode: ForwardMode  # EXTEND: prompt chunks (decodes may ride along); DECODE: one token per request
    locs: torch.Tensor  # [new tokens] int64 KV slots the new tokens write, in batch order
    samples: list[bool]  # per request: this forward completes its fill, so it samples a token
    prefilling: list[bool]  # per request: it was not decoding before this forward
    after: StepResult | None = None  # the step in flight whose tokens are inputs here; cleared once executed
    new_tokens: int = 0  # tokens an EXTEND forward computes (the prefill rate's numerator); 0 for DECODE
    # A speculative verify (running requests' newest tokens and drafts): per request, the drafted tokens after its
    # newest one, and the forward's rows per request (batch_builder.build_verify)
    drafts: list[list[int]] | None = None
    draft_probs: Any = None  # the distributions a draft model drew them from (device tensor; None: one-hot drafts)
    width: int = 0
    # A draft tree's verify: per request, its node tokens (= drafts) and node parents (engine.speculative.tree)
    trees: list[tuple[list[int], list[int]]] | None = None


class Resolved(NamedTuple):
    """A sampled step read on the host, row by row in batch order (rows that did not sample hold empty lists)."""

    tokens: list[list[int]]  # the tokens each row produced (one; several under speculative decoding)
    logprobs: list[list[tuple]] | None  # per row, per token: (chosen logprob, top [(logprob, id)], [by id])
    prompt: Any  # host copies of the prompt logprobs the batch asked for (TokenLogprobs), or None


@dataclass(slots=True)
class StepResult:
    """A ScheduledBatch's forward on the device; once sampled, its tokens on their way to the host."""

    batch: ScheduledBatch
    output: torch.Tensor | None  # float32 logits [batch + extra, vocab] (pooled [batch, hidden]) until sampled
    prompt_plan: PromptLogprobPlan | None = None  # the prompt logprobs the batch computes, if any
    launched: float = field(default_factory=time.perf_counter)
    sampled: SampleResult | None = None  # device tensors; the next step's pending inputs read `next_ids`
    rows: dict[int, int] = field(default_factory=dict)  # id(req) -> its row in sampled.next_ids
    host: Any = None  # the runner's handle on the host copy: `wait()` -> Resolved
    hidden: torch.Tensor | None = None  # the forward's kept hidden states, a row per token (an EAGLE draft's input)

    def wait(self) -> Resolved:
        """Block until the sampled tokens are on the host; returns them."""
        return self.host.wait()


class Runner(Protocol):
    """What the scheduler needs of a model: the three calls of a step, and a heartbeat between steps."""

    device: torch.device

    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Queue the batch's forward on the device and return at once. Raises on a failed launch."""
        ...

    def sample(self, result: StepResult) -> None:
        """Queue the choice of each sampling row's next token(s), from the requests' state now, and start copying
        them to the host (sets result.sampled, result.rows and result.host; drops result.output)."""
        ...

    def heartbeat(self) -> None:
        """Between steps: keep whatever waits on this runner (tensor-parallel followers) from timing out."""
        ...
