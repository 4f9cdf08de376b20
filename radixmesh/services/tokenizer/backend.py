"""The tokenizer service's work, without gRPC: tokenize text or chat, detokenize batches, describe the tokenizer.

Calls run on a thread pool so the event loop stays free (the Rust tokenizers release the GIL). Each pool thread
owns a copy of the tokenizer: a fast tokenizer must not be used by two threads at once.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence, TypeVar

from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.model_source import resolve_model_dir
from radixmesh.engine.tokenizer_loader import load_tokenizer
from radixmesh.services.common.chat_render import ChatSpec, model_template, render_chat
from radixmesh.services.tokenizer.settings import TokenizerSettings
from radixmesh.services.common.chat_templates import load_chat_template

log = logging.getLogger(__name__)
T = TypeVar("T")
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


class Tokenized(NamedTuple):
    input_ids: list[int]
    prompt: str  # the text that was tokenized


class SpecialToken(NamedTuple):
    name: str
    content: str
    id: int


@dataclass(frozen=True, slots=True)
class TokenizerInfo:
    vocab_size: int  # len(tokenizer): the base vocabulary plus added tokens
    special_tokens: tuple[SpecialToken, ...]
    chat_template: str  # "" when the model has none and no override was given
    tokenizer_path: str
    eos_token_ids: tuple[int, ...]
    context_length: int


class TokenizerBackend:
    """Owns the tokenizer (one copy per worker thread) and the resolved chat template."""

    def __init__(self, tokenizer, info: TokenizerInfo, template_override: str | None, workers: int = 4):
        self._base = tokenizer
        self.info = info
        self.template_override = template_override
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenizer",
                                        initializer=self._init_thread)

    @classmethod
    def from_settings(cls, settings: TokenizerSettings) -> "TokenizerBackend":
        """Load the tokenizer, the template override and config.json; OSError / ValueError when one is unusable."""
        start = time.monotonic()
        path = settings.resolved_tokenizer_path
        tokenizer = load_tokenizer(path, settings.trust_remote_code, settings.revision)
        override = load_chat_template(settings.chat_template) if settings.chat_template else None
        info = describe(tokenizer, settings, override)
        log.info("loaded tokenizer %s in %.1f s: vocab %d, context %d, chat template: %s", path,
                 time.monotonic() - start, info.vocab_size, info.context_length,
                 settings.chat_template or ("model's" if info.chat_template else "none"))
        return cls(tokenizer, info, override, settings.tokenizer_worker_num)

    def _init_thread(self) -> None:
        self._local.tokenizer = copy.deepcopy(self._base)

    @property
    def _tokenizer(self):
        return self._local.tokenizer

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Run `fn(*args)` on the tokenizer pool."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ---- the work, called on pool threads ---------------------------------------------------------------------
    def tokenize_text(self, text: str, add_special_tokens: bool = True) -> Tokenized:
        return Tokenized(self._tokenizer.encode(text, add_special_tokens=add_special_tokens), text)

    def tokenize_chat(self, chat: ChatSpec) -> Tokenized:
        prompt = render_chat(self._tokenizer, chat, self.template_override)
        return Tokenized(self._tokenizer.encode(prompt, add_special_tokens=False), prompt)

    def detokenize(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True,
                   spaces_between_special_tokens: bool = True) -> list[str]:
        """One text per sequence; ValueError naming the first sequence with an id outside the vocabulary."""
        size = self.info.vocab_size
        for i, ids in enumerate(sequences):
            if ids and (min(ids) < 0 or max(ids) >= size):
                bad = min(ids) if min(ids) < 0 else max(ids)
                raise ValueError(f"sequences[{i}]: token id {bad} is outside the vocabulary [0, {size})")
        return self._tokenizer.batch_decode([list(ids) for ids in sequences], skip_special_tokens=skip_special_tokens,
                                            spaces_between_special_tokens=spaces_between_special_tokens)


def describe(tokenizer, settings: TokenizerSettings, template_override: str | None) -> TokenizerInfo:
    """Everything GetTokenizerInfo reports. Context length and EOS ids come from the model's config.json."""
    model_dir = resolve_model_dir(settings.model_path, settings.revision)
    config_file = os.path.join(model_dir, "config.json")
    model = ModelConfig.from_path(model_dir) if os.path.isfile(config_file) else None
    if settings.context_length is None and model is None:
        raise ValueError(f"{config_file} not found: pass --context-length")
    eos = set(model.eos_token_ids if model else ())
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return TokenizerInfo(
        vocab_size=len(tokenizer),
        special_tokens=special_tokens(tokenizer),
        chat_template=template_override or model_template(tokenizer),
        tokenizer_path=settings.resolved_tokenizer_path,
        eos_token_ids=tuple(sorted(eos)),
        context_length=settings.context_length or model.max_position_embeddings,
    )


def special_tokens(tokenizer) -> tuple[SpecialToken, ...]:
    """bos/eos/pad/unk by name, then every other added token marked special (name "additional_special_token")."""
    out = []
    for name in NAMED_SPECIAL_TOKENS:
        content = getattr(tokenizer, name, None)
        if content:
            out.append(SpecialToken(name, str(content), tokenizer.convert_tokens_to_ids(str(content))))
    named = {t.id for t in out}
    for token_id, added in sorted(tokenizer.added_tokens_decoder.items()):
        if added.special and token_id not in named:
            out.append(SpecialToken("additional_special_token", added.content, token_id))
    return tuple(out)
