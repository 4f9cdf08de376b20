"""FP8 checkpoints (engine.quantization.fp8) against their dequantized twins, float32 on CPU: block-wise (Hugging
Face's fine-grained FP8: `weight_scale_inv` per block), per-channel and per-tensor with static input scales, in
Hugging Face's `fp8` layout, in llm-compressor's compressed-tensors one and in NVIDIA ModelOpt's (declared in
config.json or in hf_quant_config.json, with KV cache scales beside the weights), each written by our fp8 writer
from a bundled tiny model, mixtures of experts included. The engine on the fp8 checkpoint
and transformers on the twin agree token for token (logprobs within 1e-4), under tensor parallelism too;
`--quantization fp8` equals the checkpoint rounded the same way and stays near the unquantized model; what we cannot
read is refused with the reason."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open

from radixmesh.engine.quantization import fp8
from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine
from tests.reference import hf_greedy, hf_token_logprobs

MAX_NEW = 12
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}
KINDS = {"block": dict(block=(32, 64)), "channel": {}, "tensor-static": dict(per_tensor=True, static_input=True),
         "ct-channel": dict(compressed_tensors=True), "ct-block": dict(block=(64, 32), compressed_tensors=True),
         "ct-tensor-static": dict(per_tensor=True, static_input=True, compressed_tensors=True),
         "modelopt-config": dict(modelopt="config"), "modelopt-file": dict(modelopt="file")}
MOE_KINDS = ("block", "modelopt-file")  # written from tiny-qwen3-moe (the rest from tiny-llama)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """kind -> (fp8 checkpoint, its float32 twin)."""
    out = {}
    for kind, how in KINDS.items():
        base = "tiny-qwen3-moe" if kind in MOE_KINDS else "tiny-llama"
        root = tmp_path_factory.mktemp(kind)
        q = fp8.write_checkpoint(model_path(base), str(root / "fp8"), **how)
        out[kind] = (q, fp8.dequantized_checkpoint(q, str(root / "twin")))
    return out


def _generate(path: str, prompts, **opts) -> list[dict]:
    with running_engine(path, skip_tokenizer_init=True, **opts) as llm:
        return llm.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)


def _tokens(outs: list[dict]) -> list[tuple]:
    return [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in outs]


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_checkpoints_match_their_dequantized_twin_in_transformers(checkpoints, kind):
    q, twin = checkpoints[kind]
    with safe_open(os.path.join(q, "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(n).get_dtype() for n in f.keys()}
    assert "F8_E4M3" in dtypes  # the writer really stored fp8
    prompts = parity_prompts(q)[:3]
    refs = hf_greedy(twin, prompts, MAX_NEW)
    outs = _generate(q, prompts)
    assert [o["output_ids"] for o in outs] == refs
    for p, out, ref in zip(prompts, outs, refs):
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(hf_token_logprobs(twin, p, ref), abs=1e-4)


@pytest.mark.parametrize("kind", ["block", "modelopt-file"])
def test_an_fp8_checkpoint_under_tensor_parallelism_matches_one_process(checkpoints, kind):
    # block: blocks of 32 rows x 64 columns, the ranks' cuts fall inside blocks too; modelopt-file: a mixture of
    # experts with one scale a tensor
    q, _ = checkpoints[kind]
    prompts = parity_prompts(q)[:2]
    one = _generate(q, prompts)
    two = _generate(q, prompts, tp_size=2)
    assert [o["output_ids"] for o in two] == [o["output_ids"] for o in one]
    for a, b in zip(one, two):
        assert [x[0] for x in a["meta_info"]["output_token_logprobs"]] == pytest.approx(
            [x[0] for x in b["meta_info"]["output_token_logprobs"]], abs=1e-5)


def test_online_fp8_equals_the_rounded_checkpoint_and_stays_near_the_unquantized_model(tmp_path):
    """--quantization fp8 rounds each linear weight to fp8 with a scale per output row: the same as our writer's
    per-channel checkpoint (so the same outputs exactly), and near the float32 model: per generated token, the
    unquantized model's logprob of the fp8 model's choice is within 0.05 of its own choice's on average."""
    base = model_path("tiny-llama")
    prompts = parity_prompts(base)[:3]
    online = _generate(base, prompts, quantization="fp8")
    written = _generate(fp8.write_checkpoint(base, str(tmp_path / "fp8")), prompts)
    assert [o["output_ids"] for o in online] == [o["output_ids"] for o in written]
    plain = _generate(base, prompts)
    gaps = []
    for p, o, ref in zip(prompts, online, plain):
        mine = hf_token_logprobs(base, p, o["output_ids"])
        theirs = [x[0] for x in ref["meta_info"]["output_token_logprobs"]]
        gaps += [t - m for m, t in zip(mine, theirs)]
    assert sum(gaps) / len(gaps) < 0.05, gaps


def _with_quant(tmp_path, quant: dict) -> str:
    path = tmp_path / "q"
    shutil.copytree(model_path("tiny-llama"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return str(path)


@pytest.mark.parametrize("quant,match", [
    ({"quant_method": "awq", "bits": 4}, "awq quantization"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
        "type": "int", "num_bits": 4, "strategy": "group"}}}}, "compressed-tensors quantization"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"weights": {
        "type": "float", "num_bits": 8, "strategy": "group"}}}}, "strategy='group'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two positive integers"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}, "ModelOpt quantization with "
     "quant_algo='NVFP4'"),
])
def test_what_we_cannot_read_is_refused_with_the_reason(tmp_path, quant, match):
    with pytest.raises(ValueError, match=match):
        with running_engine(_with_quant(tmp_path, quant), skip_tokenizer_init=True):
            pass


def test_modelopt_s_own_file_is_read_and_what_it_names_we_cannot_read_is_refused(tmp_path, checkpoints):
    """ModelOpt's exports declare their quantization in hf_quant_config.json beside config.json: an NVFP4 one is
    refused by its algorithm (not read as plain floats); --quantization modelopt insists on a ModelOpt checkpoint."""
    q, _ = checkpoints["modelopt-file"]
    assert os.path.isfile(os.path.join(q, "hf_quant_config.json"))
    assert "quantization_config" not in json.loads(open(os.path.join(q, "config.json")).read())
    nvfp4 = tmp_path / "nvfp4"
    shutil.copytree(model_path("tiny-llama"), nvfp4)
    (nvfp4 / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}))
    with pytest.raises(ValueError, match="ModelOpt quantization with quant_algo='NVFP4' is not implemented"):
        with running_engine(str(nvfp4), skip_tokenizer_init=True):
            pass
    prompts = parity_prompts(q)[:1]
    assert _tokens(_generate(q, prompts, quantization="modelopt")) == _tokens(_generate(q, prompts))
    with running_engine(q, skip_tokenizer_init=True, kv_cache_dtype="fp8_e4m3") as llm:  # its KV scales are read
        assert llm.runner.kv_pool.k_scale == llm.runner.kv_pool.v_scale == (0.0625,) * llm.model_config.num_layers
    for flag in ("modelopt", "modelopt_fp8"):
        with pytest.raises(ValueError, match=f"quantization '{flag}' reads an NVIDIA ModelOpt FP8 checkpoint"):
            with running_engine(checkpoints["channel"][0], skip_tokenizer_init=True, quantization=flag):
                pass


def test_w8a8_fp8_rounds_an_unquantized_checkpoint_as_fp8_does():
    base = model_path("tiny-llama")
    prompts = parity_prompts(base)[:2]
    assert _tokens(_generate(base, prompts, quantization="w8a8_fp8")) == \
        _tokens(_generate(base, prompts, quantization="fp8"))


def test_an_fp8_weight_without_its_scale_is_refused(tmp_path, checkpoints):
    from safetensors.torch import save_file

    q, _ = checkpoints["channel"]
    broken = tmp_path / "broken"
    shutil.copytree(q, broken)
    with safe_open(os.path.join(q, "model.safetensors"), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys() if not n.endswith("layers.0.self_attn.q_proj.weight_scale")}
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="q_proj.weight.*has no weight_scale"):
        with running_engine(str(broken), skip_tokenizer_init=True):
            pass
    with pytest.raises(ValueError, match="quantization 'int4' is not implemented"):
        with running_engine(model_path("tiny-llama"), quantization="int4"):
            pass


def test_quantize_and_dequantize_round_trip_within_fp8_precision():
    w = torch.randn(40, 70, generator=torch.Generator().manual_seed(0))
    for block, per_tensor in ((None, False), (None, True), ((16, 32), False)):
        q, scale = fp8.quantize(w, block, per_tensor)
        assert q.dtype == torch.float8_e4m3fn
        back = fp8.dequantize(q, scale, block)
        assert ((back - w).abs() <= w.abs() * 2 ** -3 + scale.max() * 2 ** -6).all()  # 3 mantissa bits


def test_routers_the_embedding_and_the_head_keep_their_dtype_under_online_fp8():
    """As SGLang leaves them: Qwen's and Mixtral's routers, the embedding, the head, the shared expert's gate."""
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.0.block_sparse_moe.gate.weight", "lm_head.weight",
                 "model.embed_tokens.weight", "model.layers.0.mlp.shared_expert_gate.weight"):
        assert fp8.quantized_online(name, w) is w, name
    for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.block_sparse_moe.experts.1.w1.weight"):
        assert not torch.equal(fp8.quantized_online(name, w), w), name  # rounded to fp8
