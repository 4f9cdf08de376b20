"""--model-path as a Hugging Face model id, read from the local Hugging Face cache without network
(engine.model_source): the engine's config, weights and tokenizer and the tokenizer service all read the snapshot
--revision names; a model neither on disk nor cached is refused saying where it looked.

The cache is built in tmp_path in huggingface_hub's layout (models--org--name/{blobs,snapshots/<commit>,refs/<ref>},
files as links to their blobs), checked by huggingface_hub's own scan_cache_dir."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.model_source import resolve_model_dir
from radixmesh.engine.tokenizer_loader import load_tokenizer
from tests.conftest import ROOT, model_path
from tests.engine_utils import running_engine
from tests.reference import hf_greedy

REPO = "tiny-org/tiny-model"
MAIN, OTHER = "a" * 40, "b" * 40  # commit hashes


def add_snapshot(cache: Path, repo_id: str, commit: str, source: str, refs: tuple[str, ...] = ()) -> Path:
    """A snapshot of `source`'s files under `commit` as huggingface_hub stores it: content-addressed blobs, the
    snapshot's files linking to them, each ref a file holding the commit."""
    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in sorted(Path(source).iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """A cache holding REPO: main is tiny-llama, branch `qwen` (and its commit) is tiny-qwen2; huggingface_hub
    pointed at it as HF_HUB_CACHE would (the variable is read when huggingface_hub is imported)."""
    from huggingface_hub import constants, scan_cache_dir

    cache = tmp_path / "hub"
    add_snapshot(cache, REPO, MAIN, model_path("tiny-llama"), ("main",))
    add_snapshot(cache, REPO, OTHER, model_path("tiny-qwen2"), ("qwen",))
    info = scan_cache_dir(cache)
    assert [r.repo_id for r in info.repos] == [REPO] and len(next(iter(info.repos)).revisions) == 2
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_a_model_id_resolves_to_its_cached_snapshot(hub_cache):
    assert resolve_model_dir(REPO) == str(hub_cache / f"models--tiny-org--tiny-model/snapshots/{MAIN}")
    assert ModelConfig.from_path(REPO).architecture == "LlamaForCausalLM"
    assert ModelConfig.from_path(REPO, "qwen").architecture == "Qwen2ForCausalLM"
    assert ModelConfig.from_path(REPO, OTHER).path.endswith(OTHER)
    local = model_path("tiny-qwen3")
    assert resolve_model_dir(local, "qwen") == local  # a folder is read as it is


def test_a_model_nowhere_is_refused_saying_where_it_looked(hub_cache):
    with pytest.raises(FileNotFoundError) as err:
        ModelConfig.from_path("tiny-org/absent")
    msg = str(err.value)
    assert "'tiny-org/absent' is not a directory" in msg and "at revision main" in msg
    assert str(hub_cache / "models--tiny-org--absent") in msg and "hf download tiny-org/absent" in msg
    with pytest.raises(FileNotFoundError, match="at revision v9"):
        ModelConfig.from_path(REPO, "v9")
    with pytest.raises(FileNotFoundError, match="nor a Hugging Face model id"):
        ModelConfig.from_path(str(hub_cache / "no" / "such" / "folder"))


def test_the_engine_serves_a_model_id_at_a_revision(hub_cache):
    """Config, weights and tokenizer from the `qwen` snapshot: the outputs are tiny-qwen2's."""
    prompt = load_tokenizer(REPO, revision="qwen").encode("hello world")
    assert prompt == load_tokenizer(model_path("tiny-qwen2")).encode("hello world")
    assert prompt != load_tokenizer(REPO).encode("hello world")  # main's, tiny-llama's, starts with its BOS
    refs = hf_greedy(model_path("tiny-qwen2"), [prompt], 8)
    with running_engine(REPO, revision="qwen") as llm:
        assert llm.model_config.architecture == "Qwen2ForCausalLM"
        assert llm.tokenizer.encode("hello world") == prompt
        out = llm.generate(prompt="hello world", sampling_params={"max_new_tokens": 8, "temperature": 0})
        assert out["output_ids"] == refs[0]
        assert llm.get_server_info()["model_path"] == REPO


def test_the_tokenizer_service_reads_the_same_snapshot(hub_cache):
    from radixmesh.services.tokenizer.backend import TokenizerBackend
    from radixmesh.services.tokenizer.settings import TokenizerSettings

    backend = TokenizerBackend.from_settings(TokenizerSettings(model_path=REPO, revision="qwen"))
    try:
        qwen = ModelConfig.from_path(model_path("tiny-qwen2"))
        assert backend.info.eos_token_ids == tuple(sorted(qwen.eos_token_ids))
        assert backend.info.context_length == qwen.max_position_embeddings
        tokenized = asyncio.run(backend.run(backend.tokenize_text, "hello world"))  # on its pool's threads
        assert tokenized.input_ids == load_tokenizer(model_path("tiny-qwen2")).encode("hello world")
    finally:
        backend.close()


def test_hf_home_locates_the_cache(tmp_path):
    """Without HF_HUB_CACHE the cache is HF_HOME/hub, as huggingface_hub reads the environment."""
    add_snapshot(tmp_path / "home" / "hub", REPO, MAIN, model_path("tiny-llama"), ("main",))
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    code = f"from radixmesh.engine.model_source import resolve_model_dir; print(resolve_model_dir({REPO!r}))"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "HF_HOME": str(tmp_path / "home")}, cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(tmp_path / "home" / "hub" / "models--tiny-org--tiny-model" / "snapshots" / MAIN)


def test_serve_hands_the_revision_to_the_tokenizer_and_workers():
    """`radixmesh serve --model-path ID --revision R`: the tokenizer service and every worker parse the same
    model id and revision (each resolves it in its own process)."""
    from radixmesh.engine.config import EngineArgs
    from radixmesh.services.launch import LaunchSettings, plan
    from radixmesh.services.tokenizer.settings import TokenizerSettings
    from radixmesh.services.worker.settings import WorkerSettings
    from radixmesh.settings import build_parser

    children = plan(LaunchSettings(num_workers=2), {"model_path": REPO, "revision": "qwen"})
    parsers = {"radixmesh.services.tokenizer": (TokenizerSettings,), "radixmesh.services.worker": (WorkerSettings,
                                                                                                  EngineArgs)}
    seen = 0
    for child in children:
        if child.argv[0] in parsers:
            args = build_parser("", *parsers[child.argv[0]]).parse_args(child.argv[1:])
            assert (args.model_path, args.revision) == (REPO, "qwen"), child.name
            seen += 1
    assert seen == 3
