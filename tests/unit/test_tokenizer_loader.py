"""engine.tokenizer_loader gives the tokenizer AutoTokenizer gives (the same class, vocabulary, special tokens, chat
template and outputs) for every bundled model and for tokenizer configs that take AutoTokenizer's other branches,
and skips the model's config module where it can (a fresh process loading tiny-llama's tokenizer does not import
Llama's config module)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from radixmesh.engine.tokenizer_loader import _plain_config, load_tokenizer
from tests.conftest import EMBEDDING_MODELS, ROOT, TINY_MODELS, model_path

TEXT = "Hello, world! Ünïcode 東京 12345 <|im_end|>  spaces\tand\nnew lines"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]


def _same(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    ids = theirs.encode(TEXT)
    assert ours.encode(TEXT) == ids
    assert ours.decode(ids) == theirs.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.chat_template == theirs.chat_template
    if theirs.chat_template:
        assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
            theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("name", TINY_MODELS + EMBEDDING_MODELS)
def test_every_bundled_model_gets_autotokenizers_tokenizer(name):
    path = model_path(name)
    assert _plain_config(path) is not None  # the bundled models all take the short way
    _same(load_tokenizer(path), AutoTokenizer.from_pretrained(path))


@pytest.mark.parametrize("declared", ["LlamaTokenizerFast", "TokenizersBackend", "Qwen2TokenizerFast", "GPT2Tokenizer"])
def test_a_declared_class_is_resolved_as_autotokenizer_resolves_it(tmp_path, declared):
    """A Llama checkpoint whose tokenizer config names other classes: AutoTokenizer's branches for a byte-level
    tokenizer.json under a Llama class name, for a class that differs from the model type's, and for a plain one."""
    path = tmp_path / "model"
    shutil.copytree(model_path("tiny-llama"), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": declared}))
    _same(load_tokenizer(str(path)), AutoTokenizer.from_pretrained(str(path)))


@pytest.mark.parametrize("change", ["no tokenizer class", "remote code", "no model type", "no config"])
def test_anything_else_is_left_to_autotokenizer(tmp_path, change):
    path = tmp_path / "model"
    shutil.copytree(model_path("tiny-qwen2"), path)
    tokenizer = json.loads((path / "tokenizer_config.json").read_text())
    model = json.loads((path / "config.json").read_text())
    if change == "no tokenizer class":
        del tokenizer["tokenizer_class"]
    elif change == "remote code":
        model["auto_map"] = {"AutoConfig": "configuration_x.XConfig"}
    elif change == "no model type":
        del model["model_type"]
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    (path / "config.json").write_text(json.dumps(model))
    if change == "no config":
        (path / "config.json").unlink()
    assert _plain_config(str(path)) is None
    if change in ("no tokenizer class", "no config"):  # the others need the remote code or the type to load at all
        _same(load_tokenizer(str(path)), AutoTokenizer.from_pretrained(str(path)))


def test_loading_a_llama_tokenizer_skips_llamas_config_module():
    code = ("import sys; from radixmesh.engine.tokenizer_loader import load_tokenizer; "
            f"load_tokenizer({model_path('tiny-llama')!r}); "
            "print('transformers.models.llama.configuration_llama' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "False"
