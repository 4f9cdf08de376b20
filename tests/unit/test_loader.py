"""Model loading: sharded checkpoints, dummy weights, dtypes, and clear errors for broken checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixmesh.engine.config import EngineArgs, resolve_args

from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.loader import load_model
from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine
from tests.reference import hf_greedy

GREEDY = {"max_new_tokens": 12, "temperature": 0}


def _copy_model(tmp_path, name="tiny-llama", with_weights=True):
    src = model_path(name)
    dst = tmp_path / name
    shutil.copytree(src, dst, ignore=None if with_weights else shutil.ignore_patterns("*.safetensors"))
    return dst


def _load(path, **kw):
    cfg = ModelConfig.from_path(str(path))
    return load_model(cfg, kw.get("load_format", "auto"), torch.float32, torch.device("cpu"), 128)


def test_sharded_checkpoint_gives_the_same_outputs(tmp_path):
    dst = _copy_model(tmp_path)
    tensors = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, dst / file)
        weight_map.update({k: file for k in keys})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    prompts = parity_prompts(str(dst))[:4]
    with running_engine(str(dst)) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == hf_greedy(model_path("tiny-llama"), prompts, 12)


def test_missing_shard_names_the_file(tmp_path):
    dst = _copy_model(tmp_path)
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00009.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00009.safetensors"):
        _load(dst)


def test_no_weights_is_a_clear_error(tmp_path):
    dst = _copy_model(tmp_path, with_weights=False)
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        _load(dst)


def test_corrupt_weight_file_names_the_file(tmp_path):
    dst = _copy_model(tmp_path)
    data = (dst / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match="model.safetensors"):
        _load(dst)


def test_missing_tensor_names_the_key(tmp_path):
    dst = _copy_model(tmp_path)
    tensors = load_file(dst / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        _load(dst)


def test_wrong_shape_names_the_key(tmp_path):
    dst = _copy_model(tmp_path)
    tensors = load_file(dst / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape"):
        _load(dst)


def test_unknown_architecture_is_named(tmp_path):
    dst = _copy_model(tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["GPTBananaForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTBananaForCausalLM"):
        _load(dst)


def test_dummy_weights_need_only_the_config(tmp_path):
    dst = _copy_model(tmp_path, with_weights=False)
    with running_engine(str(dst), load_format="dummy", skip_tokenizer_init=True) as llm:
        out = llm.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    assert len(out["output_ids"]) == 12


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_on_cpu_runs(dtype):
    path = model_path("tiny-qwen3")
    with running_engine(path, dtype=dtype) as llm:
        assert llm.runner.model.model.embed_tokens.weight.dtype == getattr(torch, dtype)
        out = llm.generate(input_ids=parity_prompts(path)[2], sampling_params=GREEDY)
    assert len(out["output_ids"]) > 0


def test_arg_resolution():
    cfg = ModelConfig.from_path(model_path("tiny-llama"))
    args = resolve_args(EngineArgs(model_path=cfg.path, device="cpu"), cfg)
    assert (args.page_size, args.dtype, args.attention_backend, args.context_length) == (
        1, "float32", "torch_native", cfg.max_position_embeddings)
    assert cfg.rope_scaling and cfg.rope_scaling.get("rope_type") == "llama3"
    for bad in (dict(page_size=3), dict(schedule_policy="random"), dict(dtype="int8"), dict(load_format="gguf"),
                dict(kv_cache_dtype="int8")):
        with pytest.raises(ValueError):
            resolve_args(EngineArgs(model_path=cfg.path, device="cpu", **bad), cfg)
    fp8_flashinfer = resolve_args(EngineArgs(model_path=cfg.path, device="cpu", kv_cache_dtype="fp8_e4m3",
                                             attention_backend="flashinfer"), cfg)  # (it reads fp8 pages)
    assert fp8_flashinfer.decode_attention_backend == "flashinfer"
    fp8 = resolve_args(EngineArgs(model_path=cfg.path, device="cpu", kv_cache_dtype="fp8_e5m2"), cfg)
    assert fp8.kv_cache_dtype == "fp8_e5m2" and fp8.dtype == "float32"
