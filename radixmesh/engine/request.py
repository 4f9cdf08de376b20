"""Request state as the scheduler sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable

from radixmesh.engine.sampling.params import SamplingParams


def cache_namespace(tenant: str, lora: str | None) -> str:
    """The prefix-cache namespace of a tenant's requests run with LoRA adapter `lora` (None or empty: the base
    model): an adapter's KV is never reused for the base model or another adapter."""
    return f"{tenant}\x00lora:{lora}" if lora else tenant


class ReqState(enum.Enum):
    """Where a request is in the scheduler (engine.scheduler.requests.Requests moves it; see there for the edges)."""

    WAITING = "waiting"  # queued for admission
    PREFILLING = "prefilling"  # admitted; its prompt is being computed
    RUNNING = "running"  # decoding
    PREALLOC = "prealloc"  # decode role (PD): waiting for destination pages
    RECEIVING = "receiving"  # decode role: pages allocated, waiting for its KV and first token
    HELD = "held"  # finished for its caller, its pages pinned until released (PD)
    FINISHED = "finished"  # done; holds nothing


class FinishKind(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class FinishReason:
    kind: FinishKind
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    stop_token: bool = False  # ended on one of its stop tokens (EOS, stop_token_ids), whose text is left out

    def to_dict(self) -> dict:
        out: dict = {"type": self.kind.value}
        if self.kind is FinishKind.STOP:
            out["matched"] = self.matched
        elif self.kind is FinishKind.LENGTH:
            out["length"] = self.length
        else:
            out["message"] = self.message
        return out


@dataclass(frozen=True, slots=True)
class LogprobSpec:
    """What a request with return_logprob wants per output token besides the chosen token's logprob."""

    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] = ()
    start: int = -1  # logprob_start_len: prompt tokens from this index get logprobs too (-1: output only)


# Per output token: (logprob, token id) pairs, best first (top logprobs) or in the requested order (token ids).
LogprobList = list[tuple[float, int]]


@dataclass(slots=True)
class StepOutput:
    """What the scheduler hands back for one request after a step: the tokens it produced since the last output."""

    rid: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None
    new_top_logprobs: list[LogprobList] | None
    new_token_ids_logprobs: list[LogprobList] | None
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Prompt logprobs (tokens from logprob_start_len on, with top lists), sent once with the first output.
    input_logprobs: tuple[list[float], list[LogprobList], list[LogprobList]] | None = None
    queue_time_s: float | None = None  # arrival to first admission by the prefill planner (None: not admitted so)
    embedding: list[float] | None = None  # an embedding engine's finished request: its normalised vector
    spec: SpecCounts | None = None  # speculative decoding's counts so far (None: speculation is off)


@dataclass(slots=True)
class SpecCounts:
    """One request's speculative decoding so far: verify forwards it took part in, tokens drafted for it, and of
    those the ones the target model kept."""

    verify_ct: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def meta_info(self) -> dict:
        """SGLang's meta_info keys, and the mean tokens a verify produced (kept drafts and the target's own)."""
        return {"spec_verify_ct": self.verify_ct, "spec_draft_token_num": self.draft_tokens,
                "spec_accept_token_num": self.accepted_tokens,
                "spec_accept_length": (self.accepted_tokens + self.verify_ct) / self.verify_ct if self.verify_ct
                else 0.0}


@dataclass(slots=True)
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stop_ids: frozenset[int]
    sink: Callable[[StepOutput], None]
    logprob: LogprobSpec | None = None  # None: no logprobs wanted
    matcher: object | None = None  # the structured-output grammar matcher (xgrammar), advanced per output token
    # Prefill/decode disaggregation role (engine.disaggregation.handoff.PrefillRole / DecodeRole); None: colocated
    handoff: object | None = None
    tenant: str = ""  # the prefix-cache namespace: cached pages are only shared between requests of one tenant
    lora: str | None = None  # the LoRA adapter's name (None: the base model); part of the prefix-cache namespace
    lora_slot: int = 0  # its slot in the engine's LoraManager, fixed at admission
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[LogprobList] = field(default_factory=list)
    output_token_ids_logprobs: list[LogprobList] = field(default_factory=list)
    input_logprobs: list[float] = field(default_factory=list)
    input_top_logprobs: list[LogprobList] = field(default_factory=list)
    input_token_ids_logprobs: list[LogprobList] = field(default_factory=list)
    state: ReqState = ReqState.WAITING
    finish_reason: FinishReason | None = None
    # KV state over row `pool_idx` of the req-to-token table.
    # See engine.cache.manager for the invariant tree_len <= kv_len <= alloc_len.
    pool_idx: int | None = None
    kv_len: int = 0
    alloc_len: int = 0
    tree_len: int = 0
    # Tokens whose KV came from the prefix cache (counted once per scheduling, as SGLang's cached_tokens).
    cached_tokens: int = 0
    # Of the prefix the last admission found, the tokens loaded back from the host tier (the rest were on device).
    host_loaded_tokens: int = 0
    # A host -> device load of a cached tail page into this request's first own page, until it is known done
    # (engine.cache.tails): (its Pending, the page). Releasing the request before then must not free the page.
    tail_load: tuple | None = None
    # The deepest radix node this request holds a lock on (None when it holds none).
    locked_node: object | None = None
    # Tokens of `fill_ids` in the current forward (the extend chunk, or 1 when decoding).
    extend_len: int = 0
    # Tokens sampled on the device whose values the host has not read yet (0 or 1; overlap scheduling). They
    # count towards the request's length: its KV may already be computed one position past fill_len.
    pending: int = 0
    sent_len: int = 0
    arrival: float = 0.0
    queue_time_s: float | None = None  # seconds from arrival to first admission (set by the scheduler)
    retractions: int = 0
    # The req-to-token row whose penalty counts (engine.sampling.penalties) are this request's; None: count afresh
    # before it next samples.
    penalty_row: int | None = None
    # Embedding engines: the running sum of pooled states over a chunked prompt (mean pooling; a device tensor),
    # then the finished request's normalised vector.
    pooled: object | None = None
    embedding: list[float] | None = None
    # Speculative decoding: where the request's drafts come from (engine.scheduler.spec_steps.Drafter) and its
    # counts; None when speculation is off.
    drafter: object | None = None
    spec: SpecCounts | None = None
    draft_len: int = 0  # a draft model's: positions [0, draft_len) hold its KV (engine.speculative.draft_model)
    draft_features: Any = None  # an EAGLE draft's: the target's hidden states it has yet to read (FeatureRows)

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV the request needs before it can sample its next token."""
        return self.input_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without building fill_ids (hot path: one token per decoding request per step)."""
        n_in = len(self.input_ids)
        if end <= n_in:
            return self.input_ids[start:end]
        if start >= n_in:
            return self.output_ids[start - n_in:end - n_in]
        return self.input_ids[start:] + self.output_ids[:end - n_in]

    @property
    def fill_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def return_logprob(self) -> bool:
        return self.logprob is not None

    def input_logit_positions(self, start: int, end: int) -> range:
        """Positions in [start, end) whose logits give prompt-token logprobs still to collect: position p yields
        the logprob of prompt token p + 1, for tokens from logprob_start_len on."""
        if self.logprob is None or self.logprob.start < 0:
            return range(0)
        first = max(self.logprob.start - 1, 0) + len(self.input_logprobs)
        return range(max(start, first), min(end, len(self.input_ids) - 1))

    @property
    def finished(self) -> bool:
        """Finished for its caller (its pages may still be held for a peer: HELD)."""
        return self.state is ReqState.FINISHED or self.state is ReqState.HELD

    def remaining_new_tokens(self) -> int:
        return max(self.sampling.max_new_tokens - len(self.output_ids), 0)
