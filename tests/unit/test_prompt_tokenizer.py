"""The worker's tokenization of text prompts (services.worker.prompts) gives the tokenizer service's ids for every
bundled model, including text where a tokenizer's Python side could differ from its backend's batch encode."""

from __future__ import annotations

import asyncio

import pytest

from radixmesh.services.tokenizer.backend import TokenizerBackend
from radixmesh.services.tokenizer.settings import TokenizerSettings
from radixmesh.services.worker.prompts import PromptTokenizer
from tests.conftest import model_path

TEXTS = ["Hello, world!", "  leading and trailing spaces  ", "tabs\tand\nnewlines\r\n",
         "ünïcödé and 你好 and 🙂", "<s> a spelled special token </s>", "<|im_start|>user\nhi<|im_end|>",
         "1234567890 3.14159 -42", "a" * 3000]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_prompt_ids_are_the_tokenizer_services(model):
    backend = TokenizerBackend.from_settings(TokenizerSettings(model_path=model_path(model)))
    prompts = PromptTokenizer(model_path(model))

    async def both():
        ours = [await prompts.ids(t) for t in TEXTS]
        theirs = [(await backend.run(backend.tokenize_text, t)).input_ids for t in TEXTS]
        return ours, theirs

    try:
        ours, theirs = asyncio.run(both())
        assert ours == theirs
        with pytest.raises(ValueError, match="neither input_ids nor text"):
            asyncio.run(prompts.ids(""))
    finally:
        prompts.close()
        backend.close()
