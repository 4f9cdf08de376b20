"""The mixed load of `python -m radixmesh.benchmarks.soak`: one coroutine per request kind, each checking what it got
back, and the per-interval and whole-run tallies of outcomes.

Kinds (each request draws one by the weights of --mix):
- chat_stream: streamed /v1/chat/completions (usage included); ok when the stream ends with [DONE], the last choice
  has a finish_reason and the usage reports at most max_tokens completion tokens.
- completion: /v1/completions, not streamed; ok when the text is a string and the usage is within max_tokens.
- long_prompt: /v1/completions whose prompt is token ids filling the context window less the output and a little
  slack (half of them share a long prefix, so the radix cache both hits and evicts); ok when prompt_tokens matches.
- abort: a streamed chat completion or /generate of 256 tokens (ignore_eos) that the client closes after 1-4 events;
  ok when events arrived before the close. The worker must free its pages: the end-of-run KV check sees it.
- structured: /v1/chat/completions with response_format json_schema; ok only when the content parses and validates.
- generate: SGLang's /generate, streamed or not; ok when output_ids and completion_tokens agree and it finished.

A failed request is counted under its kind and one error category: http_<status>, timeout, connection,
invalid_output (a 200 whose body breaks the checks above) or bad_stream (a stream without its ending)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import jsonschema
import numpy as np

KINDS = ("chat_stream", "completion", "long_prompt", "abort", "structured", "generate")
DEFAULT_MIX = "chat_stream=3,completion=2,long_prompt=1,abort=2,structured=2,generate=2"
ABORT_TOKENS = 256
LONG_SLACK = 16  # long prompts leave max_tokens plus up to this many tokens of the context window free
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "member", "color"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}, "member": {"type": "boolean"},
                         "color": {"enum": ["red", "green", "blue"]}}}
WORDS = ("cache page token router worker stream radix tree prefix batch decode prefill sky river stone cat small "
         "quick light the a of to and in on blue green kernel tensor queue clock").split()
SYSTEM = "You are a terse assistant. " * 8  # shared by half the chats: their prefix is in the radix cache


class Failure(Exception):
    def __init__(self, category: str, detail: str):
        super().__init__(f"{category}: {detail}")
        self.category, self.detail = category, detail


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: str
    latency_s: float
    error: str | None = None  # the category; None when the request succeeded
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Target:
    base_url: str
    model: str
    context_length: int
    vocab_size: int
    request_timeout_s: float


def parse_mix(text: str) -> dict[str, float]:
    """"kind=weight,..." -> {kind: weight}; ValueError naming the bad part."""
    mix = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, _, weight = part.partition("=")
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r} in --mix (kinds: {', '.join(KINDS)})")
        try:
            mix[kind] = float(weight)
        except ValueError:
            raise ValueError(f"--mix: {part!r} is not kind=weight") from None
        if mix[kind] < 0:
            raise ValueError(f"--mix: negative weight in {part!r}")
    if not any(mix.values()):
        raise ValueError("--mix gives every kind weight 0")
    return mix


class Client:
    """Sends one request of a given kind over `session` and checks the answer. `rng` draws prompts and lengths;
    `prefix` (token ids, shared by every client) heads half the long prompts."""

    def __init__(self, session: aiohttp.ClientSession, target: Target, rng: random.Random, prefix: list[int]):
        self.session, self.t, self.rng, self.prefix = session, target, rng, prefix

    async def run(self, kind: str) -> Outcome:
        start = time.perf_counter()
        try:
            await asyncio.wait_for(getattr(self, kind)(), self.t.request_timeout_s)
        except Failure as f:
            return Outcome(kind, time.perf_counter() - start, f.category, f.detail[:300])
        except TimeoutError:
            return Outcome(kind, time.perf_counter() - start, "timeout", f"no answer in {self.t.request_timeout_s} s")
        except (aiohttp.ClientError, OSError) as e:
            return Outcome(kind, time.perf_counter() - start, "connection", f"{type(e).__name__}: {e}"[:300])
        return Outcome(kind, time.perf_counter() - start)

    # ---- transport --------------------------------------------------------------------------------------------
    async def _post(self, path: str, body: dict) -> dict:
        async with self.session.post(self.t.base_url + path, json=body) as resp:
            raw = await resp.read()
        if resp.status != 200:
            raise Failure(f"http_{resp.status}", raw.decode(errors="replace"))
        try:
            return json.loads(raw)
        except ValueError:
            raise Failure("invalid_output", f"not JSON: {raw[:200]!r}") from None

    async def _events(self, path: str, body: dict, stop_after: int | None = None) -> tuple[list[dict], bool]:
        """The SSE events' JSON of a stream, and whether it ended with [DONE]. With stop_after, closes the
        connection after that many events (a client-side abort)."""
        events, done, pending = [], False, b""
        async with self.session.post(self.t.base_url + path, json=body) as resp:
            if resp.status != 200:
                raise Failure(f"http_{resp.status}", (await resp.read()).decode(errors="replace"))
            async for chunk in resp.content.iter_any():
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        continue
                    try:
                        events.append(json.loads(data))
                    except ValueError:
                        raise Failure("bad_stream", f"event is not JSON: {data[:200]!r}") from None
                    if "error" in events[-1]:
                        raise Failure("bad_stream", f"error event: {events[-1]['error']}")
                if stop_after is not None and len(events) >= stop_after:
                    resp.close()  # drops the connection mid-stream
                    return events, False
        return events, done

    # ---- prompts ----------------------------------------------------------------------------------------------
    def _text(self, lo: int, hi: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(lo, hi)))

    def _messages(self) -> list[dict]:
        msgs = [{"role": "system", "content": SYSTEM}] if self.rng.random() < 0.5 else []
        return msgs + [{"role": "user", "content": self._text(4, 40)}]

    @staticmethod
    def _usage_ok(body: dict, max_tokens: int) -> None:
        usage = body.get("usage") or {}
        if not 0 <= usage.get("completion_tokens", -1) <= max_tokens:
            raise Failure("invalid_output", f"usage {usage} for max_tokens {max_tokens}")

    # ---- kinds ------------------------------------------------------------------------------------------------
    async def chat_stream(self) -> None:
        n = self.rng.randint(8, 48)
        events, done = await self._events("/v1/chat/completions", {
            "model": self.t.model, "messages": self._messages(), "max_tokens": n, "stream": True,
            "temperature": 0.8, "stream_options": {"include_usage": True}})
        finish = [c.get("finish_reason") for e in events for c in e.get("choices") or () if c.get("finish_reason")]
        if not done or not finish:
            raise Failure("bad_stream", f"[DONE] {done}, finish reasons {finish}, {len(events)} events")
        self._usage_ok(events[-1], n)

    async def completion(self) -> None:
        n = self.rng.randint(4, 32)
        body = await self._post("/v1/completions", {"model": self.t.model, "prompt": self._text(2, 60),
                                                    "max_tokens": n, "temperature": 0.7})
        choice = (body.get("choices") or [{}])[0]
        if not isinstance(choice.get("text"), str) or choice.get("finish_reason") not in ("stop", "length"):
            raise Failure("invalid_output", f"choice {choice}")
        self._usage_ok(body, n)

    async def long_prompt(self) -> None:
        n = self.rng.randint(4, 16)
        size = self.t.context_length - n - self.rng.randint(1, LONG_SLACK)
        head = self.prefix if self.rng.random() < 0.5 else []
        ids = (head + [self.rng.randrange(3, self.t.vocab_size) for _ in range(size - len(head))])[:size]
        body = await self._post("/v1/completions", {"model": self.t.model, "prompt": ids, "max_tokens": n,
                                                    "temperature": 0.0})
        if (body.get("usage") or {}).get("prompt_tokens") != size:
            raise Failure("invalid_output", f"usage {body.get('usage')} for a {size}-token prompt")
        self._usage_ok(body, n)

    async def abort(self) -> None:
        keep = self.rng.randint(1, 4)
        if self.rng.random() < 0.5:
            body = {"model": self.t.model, "messages": self._messages(), "max_tokens": ABORT_TOKENS, "stream": True,
                    "ignore_eos": True}
            events, _ = await self._events("/v1/chat/completions", body, stop_after=keep)
        else:
            body = {"text": self._text(4, 40), "stream": True,
                    "sampling_params": {"max_new_tokens": ABORT_TOKENS, "ignore_eos": True}}
            events, _ = await self._events("/generate", body, stop_after=keep)
        if len(events) < keep:
            raise Failure("bad_stream", f"the stream ended after {len(events)} of the {keep} events read")

    async def structured(self) -> None:
        body = await self._post("/v1/chat/completions", {
            "model": self.t.model, "messages": self._messages(), "max_tokens": 128, "temperature": 0.9,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                                       "strict": True}}})
        content = ((body.get("choices") or [{}])[0].get("message") or {}).get("content")
        try:
            jsonschema.validate(json.loads(content), SCHEMA)
        except (TypeError, ValueError, jsonschema.ValidationError) as e:
            raise Failure("invalid_output", f"{type(e).__name__}: {content!r}") from None

    async def generate(self) -> None:
        n = self.rng.randint(4, 32)
        body = {"text": self._text(2, 60), "sampling_params": {"max_new_tokens": n, "temperature": 0.7}}
        if self.rng.random() < 0.5:
            out = await self._post("/generate", body)
        else:
            events, done = await self._events("/generate", {**body, "stream": True})
            if not events or not done:
                raise Failure("bad_stream", f"[DONE] {done} after {len(events)} events")
            out = events[-1]
        meta = out.get("meta_info") or {}
        ids = out.get("output_ids")
        if not meta.get("finish_reason") or not isinstance(ids, list) or len(ids) != meta.get("completion_tokens"):
            raise Failure("invalid_output", f"{len(ids or ())} output ids, meta_info {meta}")
        if len(ids) > n or not isinstance(out.get("text"), str):
            raise Failure("invalid_output", f"{len(ids)} output ids for max_new_tokens {n}")


@dataclass(slots=True)
class Tally:
    """Outcomes since the last reset: per kind, successes, errors by category and latencies (s)."""
    ok: Counter = field(default_factory=Counter)
    errors: dict = field(default_factory=dict)  # kind -> Counter(category)
    latencies: dict = field(default_factory=dict)  # kind -> [s]

    def add(self, o: Outcome) -> None:
        self.latencies.setdefault(o.kind, []).append(o.latency_s)
        if o.error is None:
            self.ok[o.kind] += 1
        else:
            self.errors.setdefault(o.kind, Counter())[o.error] += 1

    def failed(self) -> int:
        return sum(sum(c.values()) for c in self.errors.values())

    def invalid(self) -> int:
        return sum(c["invalid_output"] for c in self.errors.values())

    def report(self) -> dict:
        """{requests, failed, invalid_outputs, latency_ms: {p50, p90, p99, max}, kinds: {kind: {...}}}."""
        every = [s for v in self.latencies.values() for s in v]
        kinds = {k: {"requests": len(v), "ok": self.ok[k], "errors": dict(self.errors.get(k, {})),
                     "latency_ms": percentiles(v)} for k, v in sorted(self.latencies.items())}
        return {"requests": len(every), "failed": self.failed(), "invalid_outputs": self.invalid(),
                "latency_ms": percentiles(every), "kinds": kinds}


def percentiles(seconds: list[float]) -> dict:
    if not seconds:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = np.percentile(seconds, [50, 90, 99]) * 1000
    return {"p50": round(p50, 1), "p90": round(p90, 1), "p99": round(p99, 1), "max": round(max(seconds) * 1000, 1)}
