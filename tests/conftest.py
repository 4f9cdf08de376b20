"""Shared fixtures: the bundled tiny models (built by `make model`) and a transformers reference."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

from tests.file_order import longest_first

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
TINY_MODELS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe")
EMBEDDING_MODELS = ("tiny-qwen3-embed",)  # --is-embedding checkpoints (not for generation parity)


def _ensure_models() -> None:
    if all((MODELS / m / "config.json").is_file() for m in TINY_MODELS + EMBEDDING_MODELS):
        return
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_models.py"), "--out", str(MODELS)],
                   check=True)


@pytest.fixture(scope="session", autouse=True)
def fork_server(tmp_path_factory):
    """One fork server per test process (radixmesh.services.forkserver), named to every launcher by
    RADIXMESH_FORK_SERVER: the services of the meshes tests launch start from it without importing torch and
    transformers again (most of a tiny mesh's start-up CPU). A launch whose environment differs in variables a
    preloaded module may have read (forkserver.env_difference) starts its services afresh, as does one with
    tests.e2e.mesh.NOT_FORKED. Off on machines with a GPU (the suite there measures what users run) and with
    RADIXMESH_TEST_FORK_SERVER=0."""
    from radixmesh.services.forkserver import ENV

    if os.environ.get("RADIXMESH_TEST_FORK_SERVER", "1") == "0" or os.environ.get(ENV) or _has_cuda():
        yield None
        return
    folder = tmp_path_factory.mktemp("forkserver")
    log = open(folder / "forkserver.log", "w")
    proc, path = start_fork_server(folder, "--exit-with-parent", out=log)
    if not path.exists():  # the suite runs without it (slower), saying why
        log.close()
        warnings.warn(f"no fork server: {(folder / 'forkserver.log').read_text()[-2000:]}")
        yield None
        return
    os.environ[ENV] = str(path)
    try:
        yield path
    finally:
        os.environ.pop(ENV, None)
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def fork_socket(folder: Path) -> Path:
    """A fork server's socket path in `folder`, or in a short folder of /tmp where the path would pass AF_UNIX's
    107 bytes (a long temporary folder)."""
    path = folder / "sock"
    if len(str(path)) <= 100:
        return path
    short = tempfile.mkdtemp(prefix="rmfs-", dir="/tmp" if os.path.isdir("/tmp") else None)
    atexit.register(shutil.rmtree, short, ignore_errors=True)  # (the test process's end: every caller's server is gone)
    return Path(short) / "sock"


def start_fork_server(folder: Path, *args: str, out=subprocess.DEVNULL,
                      timeout: float = 120.0) -> tuple[subprocess.Popen, Path]:
    """`python -m radixmesh.services.forkserver ARGS` run from `folder` (a test's PYTEST_CURRENT_TEST free to differ),
    once its socket exists; a server that exits or does not listen in `timeout` is killed and its socket path left
    absent (the caller checks path.exists())."""
    path = fork_socket(folder)
    proc = subprocess.Popen([sys.executable, "-m", "radixmesh.services.forkserver", "--socket", str(path),
                             "--free-env", "PYTEST_CURRENT_TEST", *args], cwd=folder, stdout=out,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if not path.exists():
        proc.kill()
        proc.wait()
    return proc, path


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="session")
def models_dir() -> Path:
    _ensure_models()
    return MODELS


def model_path(name: str) -> str:
    _ensure_models()
    return str(MODELS / name)


DIFFUSE_VOCAB = 512


def _random_llama(path, lm_head_std: float) -> str:
    """A tiny Llama with seeded random weights; small projection weights keep attention spread over the whole
    context (unlike the bundled tiny models, built to look back only a few tokens)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=DIFFUSE_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=None,
                      bos_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08 if "proj" in name else lm_head_std if "lm_head" in name else 1.0)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def diffuse_model(tmp_path_factory) -> str:
    return _random_llama(tmp_path_factory.mktemp("diffuse") / "tiny-diffuse-llama", lm_head_std=1.0)


@pytest.fixture(scope="session")
def broad_model(tmp_path_factory) -> str:
    """Next-token distributions spread over dozens of tokens (for distribution tests)."""
    return _random_llama(tmp_path_factory.mktemp("broad") / "tiny-broad-llama", lm_head_std=0.3)


def pytest_collection_modifyitems(config, items):
    import torch

    longest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread per process (this one and every process a test starts: workers, tensor-parallel ranks): the
# suite runs several torch processes at once on a few cores, where each one's OpenMP threads spin-wait for the
# others' cores (on 2 cores, 4 TP ranks took 3x as long, and a TP mesh 2x). Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# Without a GPU, Triton kernels (tests/kernels, the triton attention backend) run in Triton's interpreter; the
# variable must be set before any module decorates a kernel.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.triton_interpreter import install as _install_interpreter_patch

    _install_interpreter_patch()  # the interpreter without its per-helper repatch (a quarter of its time)
