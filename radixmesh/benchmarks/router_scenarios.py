"""The router benchmark's scenarios: one HTTP request shape each, and the check of its answer against what the
fake worker (benchmarks.fake_worker) generates. A check returns "" for a correct answer, else what is wrong."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from radixmesh.benchmarks.fake_worker import TOKEN_TEXT, token_ids

DONE = b"data: [DONE]\n\n"
PROMPT_LEN = 64


def prompt_ids(i: int) -> list[int]:
    """A distinct prompt per request (i < 10**9): its first block differs, so cache_aware finds no match and
    spreads the load, as with unrelated users."""
    head = [i % 1000, i // 1000 % 1000, i // 1000_000 % 1000]
    return head + [(i + j) % 1000 for j in range(PROMPT_LEN - len(head))]


def sse_events(body: bytes) -> list[bytes] | str:
    """The data payloads of an SSE body ending with [DONE] (without it), or what is wrong."""
    if not body.endswith(DONE):
        return f"stream does not end with [DONE]: ...{body[-120:]!r}"
    events = [e for e in body.split(b"\n\n") if e]
    if not all(e.startswith(b"data: ") for e in events):
        return "an SSE event is not a data line"
    return [e[6:] for e in events[:-1]]


def _generate_final(out: Any, n: int) -> str:
    meta = out.get("meta_info", {})
    if out.get("output_ids") != token_ids(n) or out.get("text") != TOKEN_TEXT * n:
        return f"wrong output: {str(out)[:200]}"
    if meta.get("completion_tokens") != n or (meta.get("finish_reason") or {}).get("type") != "length":
        return f"wrong meta_info: {meta}"
    return ""


def check_generate(n: int) -> Callable[[bytes], str]:
    return lambda body: _generate_final(json.loads(body), n)


def check_generate_stream(n: int) -> Callable[[bytes], str]:
    def check(body: bytes) -> str:
        events = sse_events(body)
        if isinstance(events, str):
            return events
        if len(events) != n + 1:  # one cumulative event per token, one for the finish
            return f"{len(events)} events for {n} tokens"
        return _generate_final(json.loads(events[-1]), n)
    return check


def check_chat_stream(n: int) -> Callable[[bytes], str]:
    def check(body: bytes) -> str:
        events = sse_events(body)
        if isinstance(events, str):
            return events
        deltas = sum(e.count(b'"content":' + json.dumps(TOKEN_TEXT).encode()) for e in events)
        last = json.loads(events[-1])["choices"][0]
        if deltas != n or last.get("finish_reason") != "length":
            return f"{deltas} content deltas for {n} tokens, last chunk {last}"
        return ""
    return check


def check_completion(n: int) -> Callable[[bytes], str]:
    def check(body: bytes) -> str:
        out = json.loads(body)
        choice = out["choices"][0]
        if choice["text"] != TOKEN_TEXT * n or choice["finish_reason"] != "length":
            return f"wrong choice: {str(choice)[:200]}"
        if out["usage"]["completion_tokens"] != n:
            return f"wrong usage: {out['usage']}"
        return ""
    return check


def _generate_body(n: int, stream: bool) -> Callable[[int], dict]:
    return lambda i: {"input_ids": prompt_ids(i), "sampling_params": {"max_new_tokens": n}, "stream": stream}


WORDS = ("river stone lantern harbor meadow copper winter signal orchard canyon violet ember thunder quiet "
         "marble falcon").split()


def prompt_text(i: int, words: int = 64) -> str:
    """A distinct 64-word prompt per request, as a client would send text: its first words differ."""
    return " ".join([str(i)] + [WORDS[(i + j * 7) % len(WORDS)] for j in range(words - 1)])


def _generate_text_body(n: int, stream: bool) -> Callable[[int], dict]:
    return lambda i: {"text": prompt_text(i), "sampling_params": {"max_new_tokens": n}, "stream": stream}


def _chat_body(n: int) -> Callable[[int], dict]:
    return lambda i: {"messages": [{"role": "user", "content": f"Tell me a story about the number {i}."}],
                      "max_tokens": n, "stream": True}


def _completion_body(n: int) -> Callable[[int], dict]:
    return lambda i: {"prompt": f"Once upon a time, number {i} walked into a bar and", "max_tokens": n}


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    description: str
    path: str
    tokens: int
    stream: bool
    body: Callable[[int], dict]
    check: Callable[[bytes], str]
    baseline: str | None = None  # the 1-token twin used for the per-extra-token cost


SCENARIOS = (
    Scenario("generate_1", "(a) POST /generate, input_ids, non-streaming, max_new_tokens 1", "/generate", 1,
             False, _generate_body(1, False), check_generate(1)),
    Scenario("generate_stream_1", "baseline of (b): /generate, input_ids, streaming, 1 token", "/generate", 1,
             True, _generate_body(1, True), check_generate_stream(1)),
    Scenario("generate_stream_64", "(b) /generate, input_ids, streaming, 64 tokens", "/generate", 64,
             True, _generate_body(64, True), check_generate_stream(64), baseline="generate_stream_1"),
    Scenario("chat_stream_1", "baseline of (c): /v1/chat/completions, streaming, 1 token", "/v1/chat/completions",
             1, True, _chat_body(1), check_chat_stream(1)),
    Scenario("chat_stream_64", "(c) /v1/chat/completions (tokenizer service), streaming, 64 tokens",
             "/v1/chat/completions", 64, True, _chat_body(64), check_chat_stream(64), baseline="chat_stream_1"),
    Scenario("completions_16", "(d) /v1/completions, text prompt, non-streaming, 16 tokens", "/v1/completions", 16,
             False, _completion_body(16), check_completion(16)),
    # the shape SGLang's router is measured on (16 streamed chunks): benchmarks.router_vs_sglang runs both routers
    Scenario("generate_16", "/generate, input_ids, non-streaming, 16 tokens", "/generate", 16, False,
             _generate_body(16, False), check_generate(16)),
    Scenario("generate_stream_16", "/generate, input_ids, streaming, 16 tokens", "/generate", 16, True,
             _generate_body(16, True), check_generate_stream(16), baseline="generate_stream_1"),
    Scenario("chat_stream_16", "/v1/chat/completions, streaming, 16 tokens", "/v1/chat/completions", 16, True,
             _chat_body(16), check_chat_stream(16), baseline="chat_stream_1"),
    # text prompts of 64 words: both routers route on the text and their workers tokenize it (ours through the
    # tokenizer service instead with --router-tokenizes, as for workers without a tokenizer)
    Scenario("generate_text_stream_16", "/generate, a 64-word text prompt, streaming, 16 tokens", "/generate", 16,
             True, _generate_text_body(16, True), check_generate_stream(16)),
)
