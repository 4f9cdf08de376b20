"""What the engine hands its callers for one request: a typed RequestOutput, either a streamed delta (cumulative, or
only what is new with stream_output) or the final result. Servers read it as it is (the worker converts it to its
proto messages); the public Engine API turns it into SGLang's dict, {"text", "output_ids", "meta_info": {...}},
at its edge (`to_dict`)."""

from __future__ import annotations

from dataclasses import dataclass

from radixmesh.engine.request import FinishReason, SpecCounts

# SGLang's (logprob, token id, text) of one token; the text only with return_text_in_logprobs, and the logprob None
# for the first prompt token (it has none).
Triple = tuple[float | None, int, str | None]
# Per position the candidates' triples (best first, or in the requested order); None for the first prompt token.
TripleRows = list[list[Triple] | None]


@dataclass(slots=True)
class Logprobs:
    """One output's logprob lists (meta_info's `*_logprobs` keys), for a request with return_logprob. A list the
    request did not ask for is None, and its key absent from meta_info."""

    output: list[Triple]  # output_token_logprobs
    input: list[Triple]  # input_token_logprobs: prompt tokens from logprob_start_len on ([] without it)
    input_top: TripleRows  # input_top_logprobs ([] without top_logprobs_num)
    output_top: TripleRows | None = None  # output_top_logprobs: with top_logprobs_num
    output_by_id: TripleRows | None = None  # output_token_ids_logprobs: with token_ids_logprob
    input_by_id: TripleRows | None = None  # input_token_ids_logprobs: with token_ids_logprob

    def add_to(self, meta: dict) -> None:
        """Put the lists into a meta_info dict, under SGLang's keys (the lists themselves, not copies)."""
        meta["input_token_logprobs"], meta["input_top_logprobs"] = self.input, self.input_top
        if self.input_by_id is not None:
            meta["input_token_ids_logprobs"] = self.input_by_id
        meta["output_token_logprobs"] = self.output
        if self.output_top is not None:
            meta["output_top_logprobs"] = self.output_top
        if self.output_by_id is not None:
            meta["output_token_ids_logprobs"] = self.output_by_id


@dataclass(slots=True)
class RequestOutput:
    """One request's output: new (a segment) or so far (cumulative) or final, as the call asked."""

    rid: str  # the request's id (meta_info.id)
    text: str
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: FinishReason | None = None  # None: still running
    logprobs: Logprobs | None = None  # None: the request did not ask for logprobs
    index: int | None = None  # which request of a batch call a streamed delta belongs to (None: not a batch)
    spec: SpecCounts | None = None  # speculative decoding's counts (None: speculation is off)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def meta_info(self) -> dict:
        """SGLang's meta_info of this output."""
        meta = {"id": self.rid, "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens,
                "finish_reason": self.finish_reason.to_dict() if self.finish_reason is not None else None}
        if self.logprobs is not None:
            self.logprobs.add_to(meta)
        if self.spec is not None:
            meta.update(self.spec.meta_info())
        return meta

    def to_dict(self) -> dict:
        """SGLang's dict of this output, as Engine.generate and async_generate return it (`index` in a batch's
        streamed deltas only)."""
        out = {"text": self.text, "output_ids": self.output_ids, "meta_info": self.meta_info()}
        if self.index is not None:
            out["index"] = self.index
        return out
