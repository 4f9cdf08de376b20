"""Worker GenerateResponse messages -> OpenAI response JSON: chat completions (streamed or whole) and what text
completions share with them (SSE framing, chunk templates, finish reasons, per-sample tallies, logprob values;
the text-completion builders are services.router.completion_response).

A caller makes one builder per request and feeds it every GenerateResponse of that request, in arrival order
(with n > 1 the samples' messages interleave):

    stream = ChatStream(job, "chatcmpl-" + rid, created=int(time.time()), prompt_tokens=len(input_ids))
    async for msg in worker_stream:
        for chunk in stream.on_message(msg):    # raises OpenAIError on a worker GenerateError
            yield sse(chunk)
    for chunk in stream.final_chunks():         # the usage chunk when stream_options.include_usage
        yield sse(chunk)
    yield SSE_DONE                              # on OpenAIError e: yield sse(error_event(e)); yield SSE_DONE

    result = ChatResult(job, "chatcmpl-" + rid, created, prompt_tokens=len(input_ids))
    async for msg in worker_stream:
        result.on_message(msg)
    body = result.result()                      # raises OpenAIError(500) if a sample never completed

Streams emit whatever text the worker's chunks carry; a `complete` whose full text extends what was streamed (or
one that arrives without chunks) contributes the rest.
Logprobs that JSON cannot carry become null (NaN: the first prompt token) or -9999.0 (-inf), as OpenAI does.
Token texts in logprobs come from the worker (return_text_in_logprobs); the router never detokenizes."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any

import orjson
from aiohttp import web

from radixmesh.v1 import common_pb2, worker_pb2
from radixmesh.services.router.chat_output import CallsJson, OutputSpec, SampleParser, call_id
from radixmesh.services.router.openai_errors import OpenAIError, from_status, internal
from radixmesh.services.router.openai_request import OpenAIJob

SSE_DONE = b"data: [DONE]\n\n"
NEG_INF_LOGPROB = -9999.0
_FINISH = {common_pb2.FINISH_REASON_TYPE_STOP: "stop", common_pb2.FINISH_REASON_TYPE_LENGTH: "length",
           common_pb2.FINISH_REASON_TYPE_ABORT: "abort"}


def json_bytes(obj: Any) -> bytes:
    """`obj` as compact UTF-8 JSON. orjson writes it (a tenth of the stdlib's time); what orjson refuses (an integer
    past 64 bits, a key that is not a string) takes the stdlib's path. The two spell some floats differently
    (1e-06 / 1e-6): the same JSON numbers."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def sse(obj: Any) -> bytes:
    """One server-sent event carrying `obj` as compact UTF-8 JSON (json_bytes), on every streamed token."""
    return b"data: " + json_bytes(obj) + b"\n\n"


def json_body_response(obj: Any) -> web.Response:
    """A whole JSON response body written as the streamed events are (json_bytes: the same spelling of a value
    streamed or not, and strict JSON: a non-finite float is null, never NaN or Infinity)."""
    return web.Response(body=json_bytes(obj), content_type="application/json")


TEXT_MARK = "\x00"  # stands for a chunk's text in a template (as JSON: "\u0000")


def text_template(chunk: dict[str, Any]) -> tuple[bytes, bytes] | None:
    """The SSE event of `chunk`, whose one text field holds TEXT_MARK, cut around that field's JSON string: an event for
    any text is then `head + orjson.dumps(text) + tail`, the same bytes `sse` writes for the chunk with that text
    (a JSON string's encoding does not depend on what surrounds it). None where the event is not orjson's or the
    mark is not found exactly once."""
    try:
        event = b"data: " + orjson.dumps(chunk) + b"\n\n"
    except TypeError:
        return None
    mark = orjson.dumps(TEXT_MARK)
    if event.count(mark) != 1:
        return None
    head, _, tail = event.partition(mark)
    return head, tail


def template_events(template: tuple[bytes, bytes] | None, tally: "Tally", msg: worker_pb2.GenerateResponse
                     ) -> bytes | None:
    """A text chunk of sample 0 after its first, as its stream's template makes it: the head, the text as JSON, the
    tail (b"" for no text); None, with nothing changed, for any other message or a stream without a template."""
    if template is None or msg.WhichOneof("response") != "chunk" or msg.index != 0:
        return None
    s = tally.samples[0]
    if not s.started or s.finished:
        return None
    c = msg.chunk
    tally.count(s, 0, c)
    text = c.text
    s.sent.append(text)
    return template[0] + orjson.dumps(text) + template[1] if text else b""


def error_event(err: OpenAIError) -> dict[str, Any]:
    """The `data: {"error": {...}}` payload that ends a stream that failed after its first byte."""
    return err.body()


def worker_error(err: worker_pb2.GenerateError) -> OpenAIError:
    return from_status(err.http_status_code, err.message or "the worker failed the request")


def finish_reason(fr: common_pb2.FinishReason) -> str:
    """"stop", "length" or "abort" (SGLang's names); an unspecified reason reads as "stop"."""
    return _FINISH.get(fr.type, "stop")


def matched_stop(fr: common_pb2.FinishReason) -> int | str | None:
    """SGLang's `matched_stop`: the stop token id or stop string that ended the sample, else None."""
    which = fr.WhichOneof("matched")
    return getattr(fr, which) if which else None


def json_logprob(x: float) -> float | None:
    if math.isnan(x):
        return None
    return NEG_INF_LOGPROB if math.isinf(x) and x < 0 else x


def item_at(seq: Any, i: int, default: Any) -> Any:
    return seq[i] if i < len(seq) else default


# ---------------------------------------------------------------------------------------------------------------
# Logprob formats (OutputLogprobs and InputLogprobs share their field names)


def chat_logprob_entries(lp: Any, start: int = 0) -> list[dict[str, Any]]:
    """Chat format, one entry per token from `start` on: {token, logprob, bytes, top_logprobs: [...]}."""
    entries = []
    for i in range(start, len(lp.token_ids)):
        text = item_at(lp.texts, i, "")
        top = item_at(lp.top_logprobs, i, None)
        alts = [] if top is None else [
            {"token": t, "logprob": json_logprob(v), "bytes": list(t.encode())}
            for t, v in zip(top_texts(top), top.logprobs)]
        entries.append({"token": text, "logprob": json_logprob(lp.token_logprobs[i]), "bytes": list(text.encode()),
                        "top_logprobs": alts})
    return entries


def top_texts(top: common_pb2.TopLogprobs) -> list[str]:
    return list(top.texts) if len(top.texts) == len(top.token_ids) else [""] * len(top.token_ids)


# ---------------------------------------------------------------------------------------------------------------
# Per-sample progress and usage


@dataclass(slots=True)
class _Sample:
    started: bool = False
    finished: bool = False
    sent: list[str] = field(default_factory=list)
    logprob_tokens: int = 0
    completion_tokens: int = 0
    complete: worker_pb2.GenerateComplete | None = None

    def rest_of(self, full: str) -> str:
        """The part of the full text not streamed yet ("" when the streamed text is not a prefix of it)."""
        sent = "".join(self.sent)
        return full[len(sent):] if full.startswith(sent) else ""


class Tally:
    """The samples of one request, `n` per prompt (prompt i's are i*n .. i*n+n-1): checks indices, records
    completion and token counts."""

    def __init__(self, n: int, prompt_tokens: Sequence[int | None]) -> None:
        self.n = n
        self.samples = [_Sample() for _ in range(n * len(prompt_tokens))]
        self.prompt_tokens = [p or 0 for p in prompt_tokens]
        self.cached_tokens = [0] * len(prompt_tokens)

    def sample(self, msg: worker_pb2.GenerateResponse) -> tuple[_Sample, str, int]:
        """(the message's sample, which part of the response it holds, its index); raises OpenAIError on a worker
        error. (Runs per streamed message: each upb field is read once.)"""
        which = msg.WhichOneof("response")
        index = msg.index
        if which == "error":
            raise worker_error(msg.error)
        if which is None:
            raise internal(f"the worker sent an empty response for sample {index}")
        if index >= len(self.samples):
            raise internal(f"the worker sent sample index {index} for a request with {len(self.samples)} choices")
        s = self.samples[index]
        if s.finished:
            raise internal(f"the worker sent more after sample {index} completed")
        self.count(s, index // self.n, msg.chunk if which == "chunk" else msg.complete.usage)
        return s, which, index

    def count(self, s: _Sample, group: int, part: Any) -> None:
        """The token counts of a chunk or a complete's usage (the largest seen of each)."""
        if (p := part.prompt_tokens) > self.prompt_tokens[group]:
            self.prompt_tokens[group] = p
        if (c := part.cached_tokens) > self.cached_tokens[group]:
            self.cached_tokens[group] = c
        if (t := part.completion_tokens) > s.completion_tokens:
            s.completion_tokens = t

    def record(self, msg: worker_pb2.GenerateResponse) -> None:
        """For whole (non-streamed) results: keep each sample's `complete`."""
        s, which, _ = self.sample(msg)
        if which == "complete":
            s.complete, s.finished = msg.complete, True

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.samples)

    def completes(self) -> list[tuple[int, worker_pb2.GenerateComplete]]:
        missing = [i for i, s in enumerate(self.samples) if not s.finished]
        if missing:
            raise internal(f"the worker stream ended before sample(s) {missing} completed")
        return [(i, s.complete) for i, s in enumerate(self.samples)]

    def usage(self) -> dict[str, Any]:
        """Each prompt's tokens once (as OpenAI counts n > 1), completion tokens summed over the samples."""
        prompt = sum(self.prompt_tokens)
        completion = sum(s.completion_tokens for s in self.samples)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)}}


def envelope(obj: str, response_id: str, created: int, job: OpenAIJob) -> dict[str, Any]:
    return {"id": response_id, "object": obj, "created": created, "model": job.model}


class TalliedResult:
    """What the non-streamed chat and completions results share: the messages' tally and the response's head."""

    def __init__(self, job: OpenAIJob, obj: str, response_id: str, created: int,
                 prompt_tokens: Sequence[int | None]) -> None:
        self.job = job
        self._tally = Tally(job.n, prompt_tokens)
        self._head = envelope(obj, response_id, created, job)

    @property
    def done(self) -> bool:
        return self._tally.done

    def on_message(self, msg: worker_pb2.GenerateResponse) -> None:
        """Records a `complete`; a chunk only updates token counts; raises OpenAIError on a worker error."""
        self._tally.record(msg)


# ---------------------------------------------------------------------------------------------------------------
# Chat completions


def _chat_finish(fr: common_pb2.FinishReason, called: bool) -> str:
    """A sample that stopped after making tool calls finished with "tool_calls", as OpenAI's do."""
    reason = finish_reason(fr)
    return "tool_calls" if called and reason == "stop" else reason


class ChatStream:
    """`chat.completion.chunk` dicts for a streamed chat request; `response_id` becomes each chunk's `id`. With a
    non-plain `spec`, each sample's text is split into reasoning_content, content and tool_calls deltas."""

    def __init__(self, job: OpenAIJob, response_id: str, created: int, prompt_tokens: int | None = None,
                 spec: OutputSpec = OutputSpec()) -> None:
        self.job = job
        self.spec = spec
        self._tally = Tally(job.n, [prompt_tokens])
        self._head = envelope("chat.completion.chunk", response_id, created, job)
        self._parsers = [None if spec.plain else SampleParser(spec) for _ in range(job.n)]
        self._calls = [CallsJson() for _ in range(job.n)]
        # one sample, plain text, no logprobs: a content delta's event is written from a template (events())
        self._template = text_template(self._chunk(0, {"content": TEXT_MARK})) \
            if spec.plain and job.n == 1 and not job.want_logprobs else None

    @property
    def done(self) -> bool:
        return self._tally.done

    def events(self, msg: worker_pb2.GenerateResponse) -> bytes:
        """The SSE events of `on_message(msg)`'s chunks, in one piece; raises as on_message does. A content chunk
        of a plain single-sample stream (the common case, every token) skips the chunk dicts (template_events)."""
        data = template_events(self._template, self._tally, msg)
        return b"".join(map(sse, self.on_message(msg))) if data is None else data

    def on_message(self, msg: worker_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """The chunks this message yields: a role chunk first per sample, content deltas, a finish chunk last."""
        s, which, index = self._tally.sample(msg)
        out = []
        if not s.started:
            s.started = True
            out.append(self._chunk(index, {"role": "assistant", "content": ""}))
        if which == "chunk":
            c = msg.chunk
            text = c.text
            entries = []
            if self.job.want_logprobs:
                entries = chat_logprob_entries(c.output_logprobs, 0)
                s.logprob_tokens += len(c.output_logprobs.token_ids)
            s.sent.append(text)
            return out + self._deltas(index, text, entries)
        cm = msg.complete
        entries = self._entries(cm.output_logprobs, s.logprob_tokens)
        rest = s.rest_of(cm.text)
        s.finished = True
        parser = self._parsers[index]
        if parser is None:
            out.append(self._chunk(index, {"content": rest} if rest else {}, entries, cm.finish_reason))
            return out
        out += self._deltas(index, rest, entries, final=True)
        called = bool(self._calls[index].ids)
        out.append(self._chunk(index, {}, None, cm.finish_reason, called))
        return out

    def _deltas(self, index: int, text: str, entries: list[dict[str, Any]], final: bool = False) -> list[dict]:
        """Delta chunks for new text; the logprob entries ride on the first (an empty delta when there is none)."""
        parser = self._parsers[index]
        if parser is None:
            return [self._chunk(index, {"content": text}, entries)] if text or entries else []
        parts = parser.feed(text)
        if final:
            parts.add(parser.finish())
        deltas = []
        if parts.reasoning:
            deltas.append({"reasoning_content": parts.reasoning})
        if parts.content:
            deltas.append({"content": parts.content})
        if parts.calls:
            deltas.append({"tool_calls": [self._calls[index].delta(d) for d in parts.calls]})
        if entries and not deltas:
            deltas.append({})
        return [self._chunk(index, d, entries if i == 0 else None) for i, d in enumerate(deltas)]

    def final_chunks(self) -> list[dict[str, Any]]:
        """The usage chunk (no choices) when the request asked for stream_options.include_usage."""
        if not self.job.include_usage:
            return []
        return [{**self._head, "choices": [], "usage": self._tally.usage()}]

    def _entries(self, lp: common_pb2.OutputLogprobs, start: int) -> list[dict[str, Any]]:
        return chat_logprob_entries(lp, start) if self.job.want_logprobs else []

    def _chunk(self, index: int, delta: dict[str, Any], entries: list[dict[str, Any]] | None = None,
               fr: common_pb2.FinishReason | None = None, called: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "delta": delta,
                                  "logprobs": {"content": entries} if entries else None, "finish_reason": None}
        if fr is not None:
            choice["finish_reason"] = _chat_finish(fr, called)
            choice["matched_stop"] = matched_stop(fr)
        chunk = {**self._head, "choices": [choice]}
        if self.job.include_usage:
            chunk["usage"] = None
        return chunk


class ChatResult(TalliedResult):
    """One `chat.completion` dict from the `complete` messages of a non-streamed chat request."""

    def __init__(self, job: OpenAIJob, response_id: str, created: int, prompt_tokens: int | None = None,
                 spec: OutputSpec = OutputSpec()) -> None:
        super().__init__(job, "chat.completion", response_id, created, [prompt_tokens])
        self.spec = spec

    def result(self) -> dict[str, Any]:
        choices = []
        for i, cm in self._tally.completes():
            logprobs = {"content": chat_logprob_entries(cm.output_logprobs)} if self.job.want_logprobs else None
            message, called = self._message(cm.text)
            choices.append({"index": i, "message": message, "logprobs": logprobs,
                            "finish_reason": _chat_finish(cm.finish_reason, called),
                            "matched_stop": matched_stop(cm.finish_reason)})
        return {**self._head, "choices": choices, "usage": self._tally.usage()}

    def _message(self, text: str) -> tuple[dict[str, Any], bool]:
        if self.spec.plain:
            return {"role": "assistant", "content": text}, False
        reasoning, content, calls = SampleParser(self.spec).whole(text)
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if self.spec.reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [{"id": call_id(), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return message, bool(calls)
