"""IncrementalDetokenizer against real tokenizers: streamed deltas must add up to `tokenizer.decode(all ids)` exactly
and must never show U+FFFD for a character whose bytes are still arriving.

Tokenizers: a byte-level BPE and a sentencepiece-style BPE (Metaspace + byte fallback), both trained here on text
with multi-byte UTF-8 (accents, CJK, emoji) and given added special tokens, plus the bundled tiny-llama tokenizer.
Test texts also use characters the training text lacks, so they are split into single-byte tokens.
"""

from __future__ import annotations

import json
import random
import re

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from radixmesh.engine.detokenizer import IncrementalDetokenizer
from tests.conftest import model_path

FFFD = "\ufffd"
CORPUS = [
    "Hello world, this is a small test of the tokenizer.",
    "café naïve façade crème brûlée Ærøskøbing Ελληνικά русский язык",
    "中文测试，你好世界。日本語のテキストです。한국어 문장입니다.",
    "emoji 😀 👍🏽 🇯🇵 👨‍👩‍👧 🎉🎉 and more 😀😀",
    "  leading spaces and\ttabs\nnew lines\n\n  indented",
    "mixed 中文 and english 😀 café, numbers 12345 and symbols #$%&",
]
# Characters absent from CORPUS: every tokenizer here encodes them as several single-byte tokens.
UNSEEN = ["龍", "🦄", "ß", "𝄞", "ổ", "👩🏾‍🚀"]
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


def byte_level_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=400, min_frequency=1, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken("<tool>", special=False)])
    return _wrap(tok)


def metaspace_bpe() -> PreTrainedTokenizerFast:
    """Llama-2 / sentencepiece style: '▁' marks spaces (the decoder drops the one the first token gets), characters
    outside the vocabulary fall back to <0xXX> byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=300, min_frequency=2, special_tokens=SPECIALS))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(),
                                     decoders.Metaspace(replacement="▁", prepend_scheme="always")])
    return _wrap(tok)


@pytest.fixture(scope="module", params=["byte_level", "metaspace", "tiny_llama"])
def tokenizer(request):
    if request.param == "tiny_llama":
        return AutoTokenizer.from_pretrained(model_path("tiny-llama"))
    return byte_level_bpe() if request.param == "byte_level" else metaspace_bpe()


def random_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 6)):
        line = rng.choice(CORPUS)
        start = rng.randrange(len(line))
        parts.append(rng.choice([line[start:start + rng.randint(1, 30)], rng.choice(UNSEEN), rng.choice(SPECIALS),
                                 " ", "<tool>"]))
    return "".join(parts)


def random_ids(tok, rng: random.Random) -> list[int]:
    """Uniform ids. Byte-fallback tokens are left out: ByteFallback decodes a run of byte tokens as one unit and
    turns an invalid run into one U+FFFD per byte, so a later byte can rewrite text a stream already sent; models
    emit valid runs, which the text-derived sequences cover."""
    ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 30))]
    return [i for i in ids if not BYTE_TOKEN.fullmatch(tok.convert_ids_to_tokens(i))] or [ids[0] % 100 + 10]


def stream(tok, ids: list[int], rng: random.Random, **options) -> tuple[list[str], IncrementalDetokenizer]:
    """Push `ids` 1..4 at a time (final=True on the last push); return the deltas and the detokenizer."""
    detok = IncrementalDetokenizer(tok, **options)
    deltas, i = [], 0
    while i < len(ids):
        step = rng.randint(1, 4)
        deltas.append(detok.push(ids[i:i + step], final=i + step >= len(ids)))
        i += step
    return deltas, detok


OPTIONS = [dict(skip_special_tokens=s, spaces_between_special_tokens=b) for s in (True, False) for b in (True, False)]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: f"skip={o['skip_special_tokens']}-"
                                                          f"spaces={o['spaces_between_special_tokens']}")
def test_deltas_add_up_to_the_full_decode(tokenizer, options):
    rng = random.Random(20240611)
    checked_valid = 0
    for trial in range(500):
        if trial % 2:
            ids = random_ids(tokenizer, rng)
        else:
            ids = tokenizer.encode(random_text(rng), add_special_tokens=False)
        full = tokenizer.decode(ids, **options)
        deltas, detok = stream(tokenizer, ids, rng, **options)
        assert "".join(deltas) == full, (ids, deltas)
        assert detok.text == full
        if FFFD not in full:
            checked_valid += 1
            assert not any(FFFD in d for d in deltas), (ids, deltas)
    assert checked_valid >= 250


def _byte_tokens(tok, char: str) -> list[int]:
    ids = tok.encode(char, add_special_tokens=False)
    assert "".join(tok.decode([i]) for i in ids) != char  # really split inside the character
    return ids


@pytest.mark.parametrize("which", ["byte_level", "metaspace"])
def test_split_character_waits_for_its_last_byte(which):
    tok = byte_level_bpe() if which == "byte_level" else metaspace_bpe()
    prefix = tok.encode("Hello", add_special_tokens=False)
    unicorn = [i for i in _byte_tokens(tok, "🦄") if tok.decode([i]) != ""]
    assert len(unicorn) >= 2
    detok = IncrementalDetokenizer(tok)
    assert detok.push(prefix) == "Hello"
    held = [detok.push([i]) for i in unicorn[:-1]]
    assert held == [""] * len(held)
    last = detok.push(unicorn[-1:])
    assert last.endswith("🦄") and FFFD not in last
    assert detok.text == tok.decode(prefix + unicorn)


def test_final_push_flushes_an_incomplete_character():
    tok = byte_level_bpe()
    ok = tok.encode("ok ", add_special_tokens=False)
    ids = ok + _byte_tokens(tok, "🦄")[:-1]  # the unicorn's last byte never comes
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ok) == "ok "
    assert detok.push(ids[len(ok):]) == ""
    assert detok.push([], final=True) == tok.decode(ids)[len("ok "):]
    assert detok.text == tok.decode(ids) and detok.text.endswith(FFFD)


def test_metaspace_spaces_between_words_survive_token_by_token():
    tok = metaspace_bpe()
    ids = tok.encode("Hello world 中文 ok", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in ids]
    assert deltas[0] == "Hello"  # the first token's marker space is dropped, as decode drops it
    assert "".join(deltas) == "Hello world 中文 ok" == tok.decode(ids)


def test_skipped_special_tokens_emit_nothing_and_keep_spacing():
    tok = metaspace_bpe()
    words = tok.encode("Hello world", add_special_tokens=False)
    ids = [tok.convert_tokens_to_ids("<s>"), *words[:1], tok.convert_tokens_to_ids("<|im_end|>"), *words[1:]]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    deltas = [detok.push([i]) for i in ids]
    assert deltas[0] == "" and deltas[2] == ""
    assert detok.text == tok.decode(ids, skip_special_tokens=True) == "Hello world"
