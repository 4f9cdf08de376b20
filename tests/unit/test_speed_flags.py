"""The speed flags under SGLang's names (attention backends, CUDA graphs, overlap scheduling): parsing, resolution,
clear errors, and an engine that imports and runs on CPU with Triton and FlashInfer unavailable."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from radixmesh.engine.attention import registry
from radixmesh.engine.config import EngineArgs, resolve_args
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.cuda_graph_runner import clip_batch_sizes, graph_batch_sizes
from radixmesh.settings import add_settings, resolve
from tests.conftest import model_path

ROOT = Path(__file__).resolve().parents[2]


def _parse(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    add_settings(parser, EngineArgs)
    return resolve(parser.parse_args(["--model-path", "m", *argv]), EngineArgs)[0]


def test_flags_use_sglang_names():
    kw = _parse(["--attention-backend", "triton", "--prefill-attention-backend", "flashinfer",
                 "--decode-attention-backend", "triton", "--cuda-graph-max-bs", "64", "--cuda-graph-bs", "1", "2",
                 "8", "--disable-cuda-graph", "--disable-overlap-schedule"])
    assert kw == {"model_path": "m", "attention_backend": "triton", "prefill_attention_backend": "flashinfer",
                  "decode_attention_backend": "triton", "cuda_graph_max_bs": 64, "cuda_graph_bs": (1, 2, 8),
                  "disable_cuda_graph": True, "disable_overlap_schedule": True}
    # ours, with no SGLang twin
    assert _parse(["--disable-pdl", "--decode-gemm", "cublas"]) == {"model_path": "m", "disable_pdl": True,
                                                                    "decode_gemm": "cublas"}


def _resolve(**kw) -> EngineArgs:
    path = model_path("tiny-llama")
    return resolve_args(EngineArgs.from_kwargs(path, **kw), ModelConfig.from_path(path))


def test_cpu_defaults():
    args = _resolve(device="cpu")
    assert (args.attention_backend, args.prefill_attention_backend, args.decode_attention_backend) == \
        ("torch_native",) * 3
    assert args.disable_cuda_graph and not args.disable_overlap_schedule


def test_prefill_and_decode_backends_default_to_the_main_one():
    args = _resolve(device="cpu", attention_backend="triton", decode_attention_backend="torch_native")
    assert (args.prefill_attention_backend, args.decode_attention_backend) == ("triton", "torch_native")


@pytest.mark.parametrize("flag", ["attention_backend", "prefill_attention_backend", "decode_attention_backend"])
def test_unknown_backend_names_the_flag(flag):
    with pytest.raises(ValueError, match=f"unknown {flag} 'fa9'; available: flashinfer, torch_native, triton"):
        _resolve(device="cpu", **{flag: "fa9"})


@pytest.mark.parametrize("kw,message", [({"cuda_graph_max_bs": 0}, "cuda_graph_max_bs must be >= 1"),
                                        ({"cuda_graph_bs": (4, 0)}, "cuda_graph_bs sizes must be >= 1"),
                                        ({"decode_gemm": "cutlass"},
                                         "decode_gemm must be 'auto', 'gemv' or 'cublas', got 'cutlass'")])
def test_bad_graph_sizes_and_products(kw, message):
    with pytest.raises(ValueError, match=message):
        _resolve(device="cpu", **kw)


@pytest.mark.parametrize("installed", [True, False])
def test_default_backend_on_cuda(monkeypatch, installed):
    real = importlib.util.find_spec
    monkeypatch.setattr(registry.importlib.util, "find_spec",
                        lambda name, *a: (object() if installed else None) if name == "flashinfer" else real(name, *a))
    assert registry.default_backend("cuda", "bfloat16", 128) == ("flashinfer" if installed else "triton")
    assert registry.default_backend("cuda:1", "float16", 64) == ("flashinfer" if installed else "triton")
    assert registry.default_backend("cuda", "float32", 128) == "triton"  # FlashInfer has no float32 kernels
    assert registry.default_backend("cuda", "bfloat16", 48) == "triton"  # nor this head size
    assert registry.default_backend("cpu", "bfloat16", 128) == "torch_native"


@pytest.mark.parametrize("major,decode", [(9, "triton"), (10, "triton"), (8, "flashinfer")])
def test_a_flashinfer_default_decodes_on_triton_from_hopper_on(monkeypatch, major, decode):
    import torch

    from radixmesh.engine import config

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: seen.append(index) or (major, 0))
    monkeypatch.setattr(registry, "default_backend", lambda device, dtype, head_dim: "flashinfer")
    assert registry.default_decode_backend("cuda:1", "flashinfer") == decode and seen == [1]
    assert registry.default_decode_backend("cuda", "triton") == "triton"
    assert registry.default_decode_backend("cpu", "torch_native") == "torch_native"
    path = model_path("tiny-llama")

    def resolved(**kw):
        names = config._resolve_attention(EngineArgs.from_kwargs(path, **kw), "cuda", "bfloat16", 128)
        return tuple(names[k] for k in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"))

    assert resolved() == ("flashinfer", "flashinfer", decode)  # no flag: the measured-faster decode
    # any backend flag is obeyed as given
    assert resolved(attention_backend="flashinfer") == ("flashinfer",) * 3
    assert resolved(decode_attention_backend="flashinfer") == ("flashinfer",) * 3
    assert resolved(prefill_attention_backend="triton") == ("flashinfer", "triton", decode)


def test_no_cuda_keeps_the_flashinfer_default_for_the_device_check(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert registry.default_decode_backend("cuda", "flashinfer") == "flashinfer"


def test_graph_batch_sizes():
    assert graph_batch_sizes((8, 1, 8, 3), None, 256) == [1, 3, 8]
    assert graph_batch_sizes(None, 20, 256) == [1, 2, 4, 8, 12, 16, 20]
    assert graph_batch_sizes(None, None, 48) == [1, 2, 4, 8, 12, 16, 24, 32, 40, 48]
    default = graph_batch_sizes(None, None, 1024)
    assert default[0] == 1 and default[-1] == 256 and default == sorted(set(default))


def test_graph_sizes_clipped_to_max_running():
    assert clip_batch_sizes([1, 2, 4, 8, 12, 16], 10) == [1, 2, 4, 8, 10]
    assert clip_batch_sizes([1, 2, 4], 10) == [1, 2, 4]
    assert clip_batch_sizes([], 10) == []


def test_graph_support_is_read_from_the_backend_class():
    assert registry.supports_cuda_graph("triton") and registry.supports_cuda_graph("flashinfer")
    assert not registry.supports_cuda_graph("torch_native")


_BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('triton', 'flashinfer'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
"""


def _run(code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", _BLOCKER + code], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=300)


def test_engine_runs_on_cpu_without_triton_or_flashinfer():
    code = (f"from radixmesh.engine import Engine\n"
            f"llm = Engine(model_path={model_path('tiny-qwen2')!r}, device='cpu', log_level='warning')\n"
            "out = llm.generate(input_ids=[5, 6, 7], sampling_params={'max_new_tokens': 4, 'temperature': 0})\n"
            "llm.shutdown()\n"
            "assert len(out['output_ids']) == 4, out\n"
            "assert not any(m.split('.')[0] in ('triton', 'flashinfer') or m.startswith('radixmesh.kernels') "
            "for m in sys.modules)\n")
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_triton_backend_on_cpu_says_what_it_needs():
    code = (f"from radixmesh.engine import Engine\n"
            f"Engine(model_path={model_path('tiny-qwen2')!r}, device='cpu', attention_backend='triton')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert proc.returncode != 0
    assert "attention_backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for testing)" in proc.stderr
