"""Worker GenerateResponse messages -> OpenAI text-completion JSON (streamed or whole), as openai_response builds
chat completions. The builders take each prompt's text (for `echo`) and token count; with several prompts, the
caller numbers prompt i's samples i*n .. i*n+n-1. Logprobs take the legacy completions format."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixmesh.v1 import common_pb2, worker_pb2
from radixmesh.services.router.openai_request import OpenAIJob
from radixmesh.services.router.openai_response import (TEXT_MARK, Tally, TalliedResult, envelope, finish_reason,
                                                       item_at, json_logprob, matched_stop, sse, template_events,
                                                       text_template, top_texts)


@dataclass(slots=True)
class LegacyLogprobs:
    """Completions format: parallel lists; `offset` is where the next token starts in the choice's text."""

    with_top: bool
    offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, lp: Any, start: int = 0) -> None:
        for i in range(start, len(lp.token_ids)):
            text = item_at(lp.texts, i, "")
            self.tokens.append(text)
            self.token_logprobs.append(json_logprob(lp.token_logprobs[i]))
            self.text_offset.append(self.offset)
            self.offset += len(text)
            top = item_at(lp.top_logprobs, i, None)
            alts: dict[str, float] | None = None
            if top is not None and len(top.token_ids):
                alts = {}
                for t, v in zip(top_texts(top), top.logprobs):
                    alts.setdefault(t, json_logprob(v))
            self.top_logprobs.append(alts)

    def take(self) -> dict[str, Any]:
        """The JSON object of what was added since the last take (the offset carries on)."""
        out = {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
               "top_logprobs": self.top_logprobs if self.with_top else None, "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out



def _per_prompt(job: OpenAIJob, values: Sequence | None, default: Any) -> list:
    values = list(values) if values is not None else [default] * len(job.prompts)
    if len(values) != len(job.prompts):
        raise ValueError(f"{len(values)} values for {len(job.prompts)} prompts")
    return values


class CompletionStream:
    """`text_completion` chunk dicts for a streamed completions request; with echo, each sample's first chunk starts
    with its prompt's text (and its logprobs with the prompt's, when asked). `prompt_texts` and `prompt_tokens` hold
    one value per prompt of the job."""

    def __init__(self, job: OpenAIJob, response_id: str, created: int, prompt_texts: Sequence[str] | None = None,
                 prompt_tokens: Sequence[int] | None = None) -> None:
        self.job = job
        self.prompt_texts = _per_prompt(job, prompt_texts, "")
        self._tally = Tally(job.n, _per_prompt(job, prompt_tokens, 0))
        self._lps = [LegacyLogprobs(job.top_logprobs > 0) for _ in self._tally.samples]
        self._head = envelope("text_completion", response_id, created, job)
        # one prompt, one sample, no logprobs: a text chunk's event is written from a template (events())
        self._template = text_template(self._chunk(0, TEXT_MARK, None)) \
            if len(job.prompts) == 1 and job.n == 1 and not job.want_logprobs else None

    @property
    def done(self) -> bool:
        return self._tally.done

    def events(self, msg: worker_pb2.GenerateResponse) -> bytes:
        """The SSE events of `on_message(msg)`'s chunks, in one piece; raises as on_message does (a text chunk of
        a single-sample stream after its first is written from a template, as ChatStream.events does)."""
        data = template_events(self._template, self._tally, msg)
        return b"".join(map(sse, self.on_message(msg))) if data is None else data

    def on_message(self, msg: worker_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """Zero or one chunk: new text and logprobs; the sample's last chunk carries its finish_reason."""
        s, which, index = self._tally.sample(msg)
        part = msg.chunk if which == "chunk" else msg.complete
        lp = self._lps[index] if self.job.want_logprobs else None
        text = ""
        if not s.started:
            s.started = True
            if self.job.echo:
                text = self.prompt_texts[index // self.job.n]
                if lp is not None:
                    lp.add(part.input_logprobs)
                    lp.offset = len(text)
        if which == "chunk":
            new = part.text
            if lp is not None:
                lp.add(part.output_logprobs)
                s.logprob_tokens += len(part.output_logprobs.token_ids)
            s.sent.append(new)
            text += new
            if not text and not (lp is not None and lp.tokens):
                return []
            return [self._chunk(index, text, lp)]
        text += s.rest_of(part.text)
        if lp is not None:
            lp.add(part.output_logprobs, s.logprob_tokens)
        s.finished = True
        return [self._chunk(index, text, lp, part.finish_reason)]

    def final_chunks(self) -> list[dict[str, Any]]:
        """The usage chunk (no choices) when the request asked for stream_options.include_usage."""
        if not self.job.include_usage:
            return []
        return [{**self._head, "choices": [], "usage": self._tally.usage()}]

    def _chunk(self, index: int, text: str, lp: LegacyLogprobs | None,
               fr: common_pb2.FinishReason | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "text": text, "logprobs": lp.take() if lp is not None else None,
                                  "finish_reason": None}
        if fr is not None:
            choice["finish_reason"] = finish_reason(fr)
            choice["matched_stop"] = matched_stop(fr)
        chunk = {**self._head, "choices": [choice]}
        if self.job.include_usage:
            chunk["usage"] = None
        return chunk


class CompletionResult(TalliedResult):
    """One `text_completion` dict from the `complete` messages of a non-streamed completions request."""

    def __init__(self, job: OpenAIJob, response_id: str, created: int, prompt_texts: Sequence[str] | None = None,
                 prompt_tokens: Sequence[int] | None = None) -> None:
        super().__init__(job, "text_completion", response_id, created, _per_prompt(job, prompt_tokens, 0))
        self.prompt_texts = _per_prompt(job, prompt_texts, "")

    def result(self) -> dict[str, Any]:
        choices = []
        for i, cm in self._tally.completes():
            text, logprobs = cm.text, None
            lp = LegacyLogprobs(self.job.top_logprobs > 0)
            if self.job.echo:
                prompt_text = self.prompt_texts[i // self.job.n]
                text = prompt_text + text
                lp.add(cm.input_logprobs)
                lp.offset = len(prompt_text)
            if self.job.want_logprobs:
                lp.add(cm.output_logprobs)
                logprobs = lp.take()
            choices.append({"index": i, "text": text, "logprobs": logprobs,
                            "finish_reason": finish_reason(cm.finish_reason),
                            "matched_stop": matched_stop(cm.finish_reason)})
        return {**self._head, "choices": choices, "usage": self._tally.usage()}
