"""Prompts that arrive as text or chat messages (GenerateRequest.text / .chat with no input_ids), rendered and
tokenized in the worker as SGLang's server does: the router then neither tokenizes nor calls the tokenizer service
for them. A chat prompt is rendered with the chat template the tokenizer service uses (the model's, or
--chat-template's: the router sends chat only to workers whose template's SHA-256 is the service's).

Tokenization runs on a thread of its own with a tokenizer of its own (a fast tokenizer must not be used by two
threads at once, and the engine's is used on the event loop). A fast tokenizer's batch encode releases the GIL while
it works, so a long prompt costs neither the event loop nor the scheduler thread its time; a slow (Python)
tokenizer holds the GIL, as it would anywhere. The ids are those of the tokenizer service's Tokenize (the same files,
special tokens added), which tests/services/test_worker_text_prompts.py checks."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import NamedTuple

from radixmesh.engine.tokenizer_loader import load_tokenizer
from radixmesh.services.common.chat_render import chat_from_proto, model_template, render_chat, template_sha256
from radixmesh.services.common.chat_templates import load_chat_template
from radixmesh.v1 import tokenizer_pb2

log = logging.getLogger(__name__)


class RenderedChat(NamedTuple):
    ids: list[int]
    text: str  # the template's rendering, which `ids` tokenize


class PromptTokenizer:
    def __init__(self, tokenizer_path: str, revision: str | None = None, chat_template: str | None = None):
        """Starts loading the tokenizer on the tokenizing thread: requests that come before it is ready wait.
        `chat_template`: --chat-template (a built-in name or a file; ValueError when unusable), else the model's."""
        self._override = load_chat_template(chat_template) if chat_template else None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prompt-tokenizer")
        self._loaded = self._pool.submit(load_tokenizer, tokenizer_path, revision=revision)
        self._encode = self._encode_rendered = None

    @classmethod
    def for_engine(cls, engine, chat_template: str | None = None) -> "PromptTokenizer | None":
        """None for an engine without a tokenizer (--skip-tokenizer-init): its requests must carry input_ids."""
        if engine.tokenizer is None:
            return None
        return cls(engine.args.tokenizer_path, engine.args.revision, chat_template)

    async def template_sha256(self) -> str:
        """The SHA-256 of the chat template chat prompts are rendered with ("" when there is none), once the
        tokenizer has loaded ("" too when it failed to load: its error is each prompt's)."""
        try:
            tokenizer = await asyncio.wrap_future(self._loaded)
        except Exception as e:  # noqa: BLE001 - reported with every text or chat request that needs it
            log.warning("the prompt tokenizer did not load: %s", e)
            return ""
        return template_sha256(self._override or model_template(tokenizer))

    async def chat_ids(self, chat: tokenizer_pb2.ChatInput) -> list[int]:
        """A chat prompt's ids: the template's rendering, tokenized with no special tokens added (the template wrote
        them), as the tokenizer service's Tokenize does; ValueError for messages the template cannot take."""
        return (await self.chat_prompt(chat)).ids

    async def chat_prompt(self, chat: tokenizer_pb2.ChatInput) -> RenderedChat:
        """chat_ids' ids with the rendering they tokenize (the tokenizer service's TokenizeResponse.prompt)."""
        spec = chat_from_proto(chat)
        return await asyncio.wrap_future(self._pool.submit(self._tokenize_chat, spec))

    async def ids(self, text: str) -> list[int]:
        """`text`'s token ids, special tokens added; ValueError for an empty text or one the tokenizer rejects."""
        if not text:
            raise ValueError("the request has neither input_ids nor text")
        return await asyncio.wrap_future(self._pool.submit(self._tokenize, text))

    def _tokenize(self, text: str) -> list[int]:
        if self._encode is None:
            self._encode = _encoder(self._loaded.result())
        return _ids(self._encode, text, "the prompt")

    def _tokenize_chat(self, spec) -> RenderedChat:
        tokenizer = self._loaded.result()
        if self._encode_rendered is None:
            self._encode_rendered = _encoder(tokenizer, add_special_tokens=False)
        text = render_chat(tokenizer, spec, self._override)
        return RenderedChat(_ids(self._encode_rendered, text, "the chat prompt"), text)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _ids(encode, text: str, what: str) -> list[int]:
    """encode(text); the tokenizer's own errors (e.g. text it cannot encode) and no ids at all are the request's."""
    try:
        ids = encode(text)
    except Exception as e:  # noqa: BLE001 - whatever the tokenizer raises
        raise ValueError(f"{what} could not be tokenized: {e}") from None
    if not ids:
        raise ValueError(f"{what} tokenizes to no tokens")
    return ids


# Text whose ids the backend's encode must give as the tokenizer's own encode does before it is used: spaces,
# digits, accents, tabs, newlines and special-token spellings, where a tokenizer class's Python side may differ.
_PROBE = "Hello, world!  1234 \u00fcn\u00efc\u00f6d\u00e9 \u4f60\u597d\n\tand\ttabs <s> </s> <|im_start|> <|endoftext|>"


def _encoder(tokenizer, add_special_tokens: bool = True):
    """text -> ids (with special tokens unless told not). For a fast tokenizer, its backend's batch encode of one
    text: what `tokenizer.encode` computes, without holding the GIL (the single-text encode holds it throughout). A
    tokenizer class that does more in Python (the probe's ids differ) keeps its own encode."""
    def plain(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    backend = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        return plain

    def batched(text: str) -> list[int]:
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    if batched(_PROBE) != plain(_PROBE):
        log.warning("%s encodes in Python beyond its backend: prompts are tokenized with the GIL held",
                    type(tokenizer).__name__)
        return plain
    return batched
