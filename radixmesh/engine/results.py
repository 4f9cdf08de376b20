"""The Engine API's edges: turning user arguments into validated request specs, and scheduler outputs into typed
RequestOutputs (engine.outputs), which the public API returns as SGLang-shaped dicts (`text`, `output_ids`,
`meta_info`)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Callable, NamedTuple

from radixmesh.engine.detokenizer import IncrementalDetokenizer
from radixmesh.engine.outputs import Logprobs, RequestOutput
from radixmesh.engine.request import LogprobSpec, StepOutput
from radixmesh.engine.sampling.params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestSpec:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    logprob: LogprobSpec | None  # None: no logprobs
    sample_index: int = 0  # which of the prompt's `n` parallel samples this is
    return_text_in_logprobs: bool = False
    grammar: object | None = None  # the compiled structured-output constraint
    # Output tokens another worker already produced (and streamed): a migrated request continues after them, as if
    # it had produced them itself (they count for lengths, penalties, the seeded draw's step and stop strings).
    resume_ids: tuple[int, ...] = ()
    resume_text_chars: int | None = None  # characters of their text the client has (None: as a token-by-token stream)
    lora: str | None = None  # the LoRA adapter's name (None: the base model)


def resumed(specs: list[RequestSpec], resume_ids, vocab_size: int, text_chars: int | None = None
            ) -> list[RequestSpec]:
    """The one spec of a migrated request, continuing after `resume_ids` (ValueError when it cannot)."""
    if len(specs) != 1:
        raise ValueError("resume_ids continues one request with n = 1")
    spec = specs[0]
    ids = _validate_ids(list(resume_ids), vocab_size)
    if len(ids) >= spec.params.max_new_tokens:
        raise ValueError(f"resume_ids holds {len(ids)} tokens: nothing is left of max_new_tokens "
                         f"({spec.params.max_new_tokens})")
    return [dataclasses.replace(spec, resume_ids=tuple(ids), resume_text_chars=text_chars)]


def resume_req(req, resume_ids: tuple[int, ...]) -> None:
    """Give a new Req the output another worker produced: sent already (logprob blanks keep the lists aligned), fed
    through its grammar, counted by lengths, penalties (reset from output_ids on admission) and the seeded draw."""
    k = len(resume_ids)
    if req.matcher is not None:
        for token in resume_ids:
            if not req.matcher.accept_token(token):
                raise ValueError("resume_ids do not follow the request's grammar")
    req.output_ids = list(resume_ids)
    req.output_logprobs = [0.0] * k
    req.output_top_logprobs = [[] for _ in range(k)]
    req.output_token_ids_logprobs = [[] for _ in range(k)]
    req.sent_len = k


class RequestTiming(NamedTuple):
    """When one request's outputs reached its caller (time.monotonic() seconds), and its wait in the queue."""

    submitted: float  # the call that made the request started collecting its outputs
    first_token: float | None  # its first output token arrived (None: it produced none)
    finished: float
    queue_time_s: float | None  # arrival to first admission by the prefill planner (None: never admitted so)


def sample_rids(rid: str, n: int) -> list[str]:
    """Request ids of a prompt's n samples: the caller's id itself when n == 1, `<rid>-<index>` otherwise."""
    return [rid] if n == 1 else [f"{rid}-{j}" for j in range(n)]


def _parallel_samples(ids: list[int], params: SamplingParams, want_lp: LogprobSpec | None,
                      with_text: bool, grammar, rid: str | None) -> list[RequestSpec]:
    """`n` requests for one prompt; seeded ones get seed + index, so the samples differ yet stay reproducible."""
    out = []
    for j, sample_rid in enumerate(sample_rids(rid or uuid.uuid4().hex, params.n)):
        seed = params.sampling_seed + j if params.sampling_seed is not None else None
        copy = dataclasses.replace(params, sampling_seed=seed) if j else params
        out.append(RequestSpec(sample_rid, ids, copy, want_lp, j, with_text, grammar))
    return out


def _as_list(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


_INT = frozenset({int})


def all_ints(values) -> bool:
    """Whether every item of `values` is an int and none a bool (JSON's true/false), in C loops (the set of the
    items' types), where a generator over a long prompt's ids cost ~60 ns an id. True for no items."""
    return set(map(type, values)) <= _INT


def _validate_ids(ids, vocab_size: int) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not all_ints(ids):
        raise ValueError("input_ids must be a list of integers")
    if not ids:
        raise ValueError("the prompt is empty: give a non-empty prompt or input_ids")
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = [t for t in ids if t < 0 or t >= vocab_size]
        raise ValueError(f"token id(s) {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return list(ids)


def _check_lengths(n_in: int, raw_params: dict | None, params: SamplingParams, context_len: int,
                   max_total_tokens: int) -> None:
    if n_in >= context_len:
        raise ValueError(f"the input ({n_in} tokens) is longer than the model's context length "
                         f"({context_len} tokens)")
    if n_in >= max_total_tokens:
        raise ValueError(f"the input ({n_in} tokens) does not fit in the KV cache ({max_total_tokens} tokens)")
    if raw_params and "max_new_tokens" in raw_params and n_in + params.max_new_tokens > context_len:
        raise ValueError(f"requested {n_in} input + {params.max_new_tokens} new tokens, more than the model's "
                         f"context length ({context_len} tokens)")


def _check_token_params(params: SamplingParams, vocab_size: int, tokenizer) -> None:
    gate = [t for t in (params.reasoning_end_token_id, params.reasoning_start_token_id) if t is not None]
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in params.logit_bias]),
                      ("reasoning_end_token_id/reasoning_start_token_id", gate)):
        bad = [t for t in ids if t < 0 or t >= vocab_size]
        if bad:
            raise ValueError(f"{name} has token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer (this engine was started with skip_tokenizer_init)")


def _logprob_specs(n: int, return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob,
                   vocab_size: int) -> list[LogprobSpec | None]:
    flags = _as_list(return_logprob, n, "return_logprob")
    starts = _as_list(logprob_start_len, n, "logprob_start_len")
    tops = _as_list(top_logprobs_num, n, "top_logprobs_num")
    id_lists = token_ids_logprob if token_ids_logprob and isinstance(token_ids_logprob[0], list) \
        else [token_ids_logprob] * n
    if len(id_lists) != n:
        raise ValueError(f"token_ids_logprob has {len(id_lists)} entries for {n} prompts")
    out = []
    for want, start, top, ids in zip(flags, starts, tops, id_lists):
        if start is not None and (not isinstance(start, int) or isinstance(start, bool) or start < -1):
            raise ValueError(f"logprob_start_len must be an integer >= -1, got {start!r}")
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 0):
            raise ValueError(f"top_logprobs_num must be an integer >= 0, got {top!r}")
        ids = tuple(_int_list_or_empty(ids, "token_ids_logprob"))
        if any(t < 0 or t >= vocab_size for t in ids):
            raise ValueError(f"token_ids_logprob has ids outside the vocabulary [0, {vocab_size})")
        out.append(LogprobSpec(min(top or 0, vocab_size), ids, -1 if start is None else start) if want else None)
    return out


def _int_list_or_empty(value, name: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all_ints(value):
        raise ValueError(f"{name} must be a list of integers (or one list per prompt), got {value!r}")
    return list(value)


def normalize_batch(prompt, sampling_params, input_ids, return_logprob, *, tokenizer, vocab_size: int,
                    context_len: int, max_total_tokens: int, sampling_defaults: dict | None = None,
                    logprob_start_len=None, top_logprobs_num=None, token_ids_logprob=None,
                    return_text_in_logprobs: bool = False, compile_grammar=None,
                    rid=None) -> tuple[list[RequestSpec], bool]:
    """Validate everything before anything is queued. Returns (specs, whether the result is a list). A prompt with
    n > 1 becomes n consecutive specs, and its result a list of n dicts (per prompt, in order). `rid` (one id per
    prompt) names the requests for abort_request; see `sample_rids`."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of prompt and input_ids")
    if prompt is not None:
        if tokenizer is None:
            raise ValueError("this engine was started with skip_tokenizer_init: pass input_ids, not prompt")
        is_batch = isinstance(prompt, list)
        prompts = prompt if is_batch else [prompt]
        if not all(isinstance(p, str) for p in prompts):
            raise ValueError("prompt must be a string or a list of strings")
        if any(p == "" for p in prompts):
            raise ValueError("the prompt is empty: give a non-empty prompt or input_ids")
        id_lists = [tokenizer(p).input_ids for p in prompts]
    else:
        is_batch = bool(input_ids) and isinstance(input_ids[0], (list, tuple))
        id_lists = input_ids if is_batch else [input_ids]
    n = len(id_lists)
    if n == 0:
        raise ValueError("the batch is empty")
    raw = _as_list(sampling_params, n, "sampling_params")
    logprob_flags = _logprob_specs(n, return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob,
                                   vocab_size)
    if isinstance(rid, str) and n > 1:
        raise ValueError("a batch of prompts needs a list of rids, one per prompt")
    rids = _as_list(rid, n, "rid")
    if not all(r is None or (isinstance(r, str) and r) for r in rids):
        raise ValueError("rid must be a non-empty string (or a list of them)")
    specs = []
    for ids, raw_params, want_lp, one_rid in zip(id_lists, raw, logprob_flags, rids):
        ids = _validate_ids(ids, vocab_size)
        if raw_params is not None and not isinstance(raw_params, dict):
            raise ValueError("sampling_params must be a dict (or a list of dicts)")
        params = SamplingParams.from_dict(raw_params, sampling_defaults)
        _check_lengths(len(ids), raw_params, params, context_len, max_total_tokens)
        _check_token_params(params, vocab_size, tokenizer)
        if want_lp is not None and want_lp.start >= len(ids):
            raise ValueError(f"logprob_start_len ({want_lp.start}) must be < the prompt length ({len(ids)})")
        grammar = None
        if params.constraint is not None:
            if compile_grammar is None:
                raise ValueError(f"{params.constraint[0]} needs a tokenizer and grammar_backend='xgrammar'")
            grammar = compile_grammar(params)
        specs += _parallel_samples(ids, params, want_lp, bool(return_text_in_logprobs) and tokenizer is not None,
                                   grammar, one_rid)
    return specs, is_batch or len(specs) > n


class ResultBuilder:
    """Accumulates one request's outputs in the consumer's thread: streams detokenize incrementally, otherwise the
    text is decoded once at the end."""

    def __init__(self, spec: RequestSpec, tokenizer, stream: bool, segments: bool = False, interval: int = 1):
        self.spec = spec
        self.segments = segments  # stream disjoint segments (SGLang's --stream-output) instead of cumulative output
        self.interval = interval  # --stream-interval: emit the first token, then every `interval` tokens, and the end
        self.emitted = False  # a token went out
        self.tokenizer = tokenizer
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list = []
        self.input_logprobs: tuple[list, list, list] = ([], [], [])
        self.id_logprobs: list = []
        self.stream = stream
        self.detok = IncrementalDetokenizer(tokenizer, spec.params.skip_special_tokens,
                                            spec.params.spaces_between_special_tokens) if tokenizer and stream else None
        self.last: StepOutput | None = None
        self.sent_chars = 0  # characters of the detokenized stream already emitted
        self.sent_ids = len(spec.resume_ids or ())  # output tokens already emitted
        self.first_token_at: float | None = None  # time.monotonic() when the first output token arrived
        if spec.resume_ids:  # streamed by another worker: what it sent counts as sent (their logprobs are blanks)
            k = len(spec.resume_ids)
            self.output_ids = list(spec.resume_ids)
            self.logprobs, self.top_logprobs, self.id_logprobs = [0.0] * k, [[] for _ in range(k)], [[] for _ in
                                                                                                   range(k)]
            if self.detok is not None:
                # Token by token, as a stream that sent each: the detokenizer then holds back only a character
                # still incomplete at the end (one push of them all would hold back everything in that case).
                for token in self.output_ids:
                    self.detok.push([token])
                visible = len(self._visible(self.detok.text, False))
                self.sent_chars = visible if spec.resume_text_chars is None else spec.resume_text_chars

    def _visible(self, text: str, finished: bool) -> str:
        """The text a client may see: cut before a matched stop string (unless no_stop_trim); while running, hold
        back a tail that could still grow into a stop string."""
        params, reason = self.spec.params, self.last.finish_reason if self.last is not None else None
        if reason is not None and isinstance(reason.matched, str) and not params.no_stop_trim:
            cut = text.find(reason.matched)
            return text[:cut] if cut >= 0 else text
        if finished or not params.stop:
            return text
        hold = max((n for s in params.stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        return text[:len(text) - hold]

    def _trims(self, out: StepOutput | None) -> bool:
        """Whether the output ended on a stop token whose text is left out (SGLang's, unless no_stop_trim: with
        skip_special_tokens false a special EOS would otherwise show)."""
        reason = out.finish_reason if out is not None and out.finished else None
        return reason is not None and reason.stop_token and not self.spec.params.no_stop_trim

    def push(self, out: StepOutput) -> RequestOutput | None:
        """Record a scheduler output. When streaming, returns the output to send: cumulative text, ids and logprobs
        (SGLang's default), or with `segments` only what is new since the last one."""
        if self.first_token_at is None and out.new_token_ids:
            self.first_token_at = time.monotonic()
        self.output_ids += out.new_token_ids
        if out.input_logprobs is not None:
            self.input_logprobs = out.input_logprobs
        if out.new_logprobs:
            self.logprobs += out.new_logprobs
            self.top_logprobs += out.new_top_logprobs
            self.id_logprobs += out.new_token_ids_logprobs
        self.last = out
        if not self.stream:
            return None
        if self.detok is not None:
            self.detok.push(out.new_token_ids[:-1] if self._trims(out) else out.new_token_ids, final=out.finished)
        sent = self.sent_ids
        if self.interval > 1 and self.emitted and not out.finished and len(self.output_ids) - sent < self.interval:
            return None  # not due: these tokens go out with the next emission
        if len(self.output_ids) > sent:  # (an output with no token before the first one leaves the first one due)
            self.emitted = True
        self.sent_ids = len(self.output_ids)
        visible = self._visible(self.detok.text, out.finished) if self.detok is not None else ""
        if not self.segments:
            return self._output(visible, list(self.output_ids))
        text, self.sent_chars = visible[self.sent_chars:], max(self.sent_chars, len(visible))
        return self._output(text, self.output_ids[sent:], logprobs_from=sent)

    def _output(self, text: str, output_ids: list[int], logprobs_from: int = 0) -> RequestOutput:
        out = self.last
        return RequestOutput(self.spec.rid, text, output_ids, out.prompt_tokens, out.completion_tokens,
                             out.cached_tokens, out.finish_reason,
                             self._logprobs(logprobs_from) if self.spec.logprob is not None else None,
                             spec=out.spec)

    def _logprobs(self, start: int) -> Logprobs:
        """The lists the request asked for; output tokens from index `start` on."""
        spec = self.spec.logprob
        inputs, input_top, by_id = self._input_logprobs()
        output = [self._triple(lp, tok) for lp, tok in zip(self.logprobs[start:], self.output_ids[start:])]
        top = [[self._triple(*p) for p in row] for row in self.top_logprobs[start:]] if spec.top_logprobs_num else None
        ids = [[self._triple(*p) for p in row] for row in self.id_logprobs[start:]] if spec.token_ids_logprob else None
        return Logprobs(output, inputs, input_top, top, ids, by_id if spec.token_ids_logprob else None)

    def _input_logprobs(self) -> tuple[list, list, list]:
        """Prompt tokens from logprob_start_len on; the very first token has no logprob (None), as in SGLang."""
        start = self.spec.logprob.start
        if start < 0:
            return [], [], []
        chosen, tops, by_ids = self.input_logprobs
        ids = self.spec.input_ids
        head = [self._triple(None, ids[0])] if start == 0 else []
        logprobs = head + [self._triple(lp, t) for lp, t in zip(chosen, ids[max(start, 1):])]
        head = [None] if start == 0 else []
        top = head + [[self._triple(*p) for p in row] for row in tops]
        by_id = head + [[self._triple(*p) for p in row] for row in by_ids]
        return logprobs, top if self.spec.logprob.top_logprobs_num else [], by_id

    def _triple(self, logprob: float | None, token: int) -> tuple[float, int, str | None]:
        """SGLang's (logprob, token id, text) with the text only when return_text_in_logprobs."""
        text = self.tokenizer.decode([token]) if self.spec.return_text_in_logprobs else None
        return logprob, token, text

    def result(self) -> RequestOutput:
        text = ""
        if self.tokenizer is not None:
            ids = self.output_ids[:-1] if self._trims(self.last) else self.output_ids
            text = self.tokenizer.decode(ids, skip_special_tokens=self.spec.params.skip_special_tokens,
                                         spaces_between_special_tokens=self.spec.params.spaces_between_special_tokens)
            text = self._visible(text, finished=True)
        return self._output(text, list(self.output_ids))


class BatchCollector:
    """Routes one API call's scheduler outputs to per-request builders: yields streaming deltas (tagged with
    `index` for a batch) or collects the final outputs."""

    def __init__(self, specs: list[RequestSpec], tokenizer, stream: bool, is_batch: bool, segments: bool = False,
                 on_finish: Callable[[int, RequestTiming], None] | None = None, interval: int = 1):
        self.builders = [ResultBuilder(s, tokenizer, stream, segments, interval) for s in specs]
        self.outputs: list[RequestOutput | None] = [None] * len(specs)  # each request's final output (not streamed)
        self.stream, self.is_batch = stream, is_batch
        self.remaining = len(specs)
        self.on_finish = on_finish
        self.submitted = time.monotonic()

    @property
    def done(self) -> bool:
        return self.remaining == 0

    @property
    def results(self) -> list[dict | None]:
        """The final outputs as the public API returns them (SGLang's dicts; None: not finished, or streamed)."""
        return [out.to_dict() if out is not None else None for out in self.outputs]

    def record(self, i: int, out: StepOutput) -> RequestOutput | None:
        delta = self.builders[i].push(out)
        if out.finished:
            self.remaining -= 1
            if not self.stream:
                self.outputs[i] = self.builders[i].result()
            if self.on_finish is not None:
                self.on_finish(i, RequestTiming(self.submitted, self.builders[i].first_token_at, time.monotonic(),
                                                out.queue_time_s))
        if delta is not None and self.is_batch:
            delta.index = i
        return delta
