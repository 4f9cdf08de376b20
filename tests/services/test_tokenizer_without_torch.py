"""The tokenizer service's process leaves torch out (services/tokenizer/without_torch.py): every bundled model's
tokenizer, loaded and used by the service's own backend in a process where torch is marked absent, gives what it gives
beside torch (this pytest process has it): token ids, texts, special tokens, chat template and its renderings, with
and without tools; torch is never imported there. A tokenizer that needs torch gets the process started again with
torch allowed, and --trust-remote-code keeps torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from radixmesh.services.tokenizer.without_torch import ALLOW_ENV, leave_out

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TEXTS = ["Hello there, how are you?", "東京 is a city 🙂", "  leading spaces\n\nnew lines\t tabs", "<|im_start|>x",
         "<|begin_of_text|>y", "a" * 300]
TOOL = {"type": "function", "function": {"name": "pick", "description": "pick one",
                                         "parameters": {"type": "object", "properties": {"k": {"type": "integer"}}}}}

# Run in a fresh process as `python -c`: argv[1] "leave out" marks torch absent first; prints the answers as JSON.
# (This module imports nothing that imports torch: not tests.conftest, which does.)
SCRIPT = """
import json, sys
if sys.argv[1] == "leave out":
    from radixmesh.services.tokenizer.without_torch import leave_out
    assert leave_out(False)
from tests.services.test_tokenizer_without_torch import answers
print(json.dumps([answers(path) for path in sys.argv[2:]]))
print(json.dumps(sys.modules.get("torch") is not None))
"""


def answers(path: str) -> dict:
    """What the tokenizer service's backend answers for the model at `path` (JSON-ready)."""
    from radixmesh.services.common.chat_render import ChatSpec
    from radixmesh.services.tokenizer.backend import TokenizerBackend
    from radixmesh.services.tokenizer.settings import TokenizerSettings

    backend = TokenizerBackend.from_settings(TokenizerSettings(model_path=path, tokenizer_worker_num=1))
    try:
        backend._init_thread()  # the calls below run on this thread, not the pool's: give it its copy
        run = backend
        ids = [run.tokenize_text(t).input_ids for t in TEXTS] + [run.tokenize_text(t, False).input_ids for t in TEXTS]
        chats = [ChatSpec([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]),
                 ChatSpec([{"role": "user", "content": "pick"}], tools=[TOOL]),
                 ChatSpec([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                          add_generation_prompt=False, continue_final_message=True)]
        rendered = []
        for chat in chats:
            try:
                rendered.append(list(run.tokenize_chat(chat)))  # ids and the rendered text
            except ValueError as e:  # a template that cannot take the chat: the same error either way
                rendered.append(f"ValueError: {e}")
        texts = [run.detokenize(ids, skip) for skip in (True, False)]
        texts.append(run.detokenize(ids[:3] + [[1, 2, 3, 500, 999]], True, False))
        info = backend.info
        return {"ids": ids, "chats": rendered, "texts": texts, "vocab": info.vocab_size,
                "special": [list(t) for t in info.special_tokens], "template": info.chat_template,
                "eos": list(info.eos_token_ids), "context": info.context_length}
    finally:
        backend.close()


def _in_fresh_process(mode: str, paths: list[str], env: dict | None = None) -> tuple[list[dict], bool]:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode, *paths], cwd=ROOT, capture_output=True, text=True,
                          timeout=180, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-4000:]
    got, torch_loaded = proc.stdout.strip().splitlines()[-2:]
    return json.loads(got), json.loads(torch_loaded)


def test_every_bundled_tokenizer_answers_the_same_without_torch():
    from tests.conftest import EMBEDDING_MODELS, TINY_MODELS, model_path

    paths = [model_path(m) for m in TINY_MODELS + EMBEDDING_MODELS]
    got, torch_loaded = _in_fresh_process("leave out", paths)
    assert not torch_loaded  # the point: transformers did not import it
    import torch  # noqa: F401 - this process has torch, as the tokenizer service used to

    assert got == json.loads(json.dumps([answers(p) for p in paths]))


def test_left_out_only_where_no_code_may_want_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch"))  # restored after the test
    assert not leave_out(trust_remote_code=True)
    import torch

    assert sys.modules["torch"] is torch and not leave_out(False)  # imported already: nothing to save
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setenv(ALLOW_ENV, "1")
    assert not leave_out(False) and "torch" not in sys.modules


RESTART = """
import os, sys
from radixmesh.services.tokenizer.without_torch import ALLOW_ENV, leave_out, restart_with_torch
print(os.environ.get(ALLOW_ENV), os.getpid(), leave_out(False), flush=True)
try:
    import torch
except ImportError as e:
    restart_with_torch(e)
print("torch", torch.__version__, os.getpid())
"""


def test_a_tokenizer_that_needs_torch_gets_the_process_started_again_with_torch():
    """restart_with_torch: the same pid runs the same command line again, torch allowed this time."""
    env = {k: v for k, v in os.environ.items() if k != ALLOW_ENV}
    proc = subprocess.run([sys.executable, "-c", RESTART], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first, second, third = proc.stdout.split("\n")[:3]
    pid = first.split()[1]
    assert first == f"None {pid} True" and second == f"1 {pid} False", proc.stdout
    assert third.startswith("torch ") and third.endswith(f" {pid}"), proc.stdout
    assert "the tokenizer needs torch" in proc.stderr, proc.stderr


@pytest.mark.parametrize("flags", [(), ("--trust-remote-code",)], ids=["tokenizer", "remote code"])
def test_the_service_process_runs_without_torch_unless_remote_code_may_run(tmp_path, flags):
    """The real service, as `python -m` starts it: serving without libtorch mapped (with it under
    --trust-remote-code)."""
    from tests.services.test_tokenizer_service import _start, _wait_serving

    server = _start("t", tmp_path, *flags)
    try:
        _wait_serving(server)
        with open(f"/proc/{server.proc.pid}/maps") as fh:
            mapped = "libtorch" in fh.read()
        assert mapped == bool(flags), server.output()
        assert "PyTorch was not found" not in server.output()  # transformers' notice is not the service's news
    finally:
        server.proc.kill()
        server.proc.wait(timeout=10)
        server.channel.close()
