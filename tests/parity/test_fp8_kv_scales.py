"""Per-layer KV cache scales (engine.quantization.kv_scales) with --kv-cache-dtype fp8_e4m3, float32 on CPU.

The checkpoint is the bundled tiny Llama with each layer's keys made 60-400 times larger (its queries as much
smaller) and its values 1/128-500 times their size (its output projection the inverse): the same function, but keys
and values an unscaled e4m3 cache clips at 448 or rounds into its subnormals. Its k_scale / v_scale tensors are
calibrated the way exporters do (the largest activation over other prompts / 448), and with them the fp8 cache
answers as the float32 cache does; the same weights without them do not. The scales travel through both attention
backends, tensor parallelism, the hierarchical cache and a prefill/decode handoff; a float cache ignores them. A
--quantization-param-path file (SGLang's) gives each TP rank its scales instead."""

from __future__ import annotations

import asyncio
import os
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine
from tests.reference import hf_model

GREEDY = {"max_new_tokens": 12, "temperature": 0}
KEY_GAIN = (100.0, 250.0, 60.0, 400.0)  # per layer of tiny-llama (4 layers)
VALUE_GAIN = (1 / 64, 500.0, 1 / 128, 300.0)
AGREE = 8  # greedy tokens every prompt must share with the float32 cache
E4M3_MAX = 448.0


def _write(dst: str, scales: list[tuple[float, float]] | None) -> str:
    """tiny-llama with the gains above folded into its attention (an identical function), and `scales` (per layer:
    k_scale, v_scale) as the checkpoint's scalar KV cache scales."""
    src = model_path("tiny-llama")
    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for i, (gk, gv) in enumerate(zip(KEY_GAIN, VALUE_GAIN)):
        at = f"model.layers.{i}.self_attn."
        tensors[at + "q_proj.weight"] /= gk
        tensors[at + "k_proj.weight"] *= gk
        tensors[at + "v_proj.weight"] *= gv
        tensors[at + "o_proj.weight"] /= gv
    for i, (ks, vs) in enumerate(scales or ()):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(ks, dtype=torch.float32)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(vs, dtype=torch.float32)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(src, f), dst)
    return dst


@torch.inference_mode()
def _calibrate(path: str) -> list[tuple[float, float]]:
    """Per layer (k_scale, v_scale): the largest k_proj / v_proj output over calibration prompts (other than the
    tests') / 448, keys with 1.5x room for RoPE (a rotated pair's element reaches sqrt(2) x the larger of the two)."""
    model = hf_model(path)
    amax: dict[tuple[str, int], float] = {}

    def hook(key):
        def record(_module, _inputs, out):
            amax[key] = max(amax.get(key, 0.0), float(out.abs().max()))
        return record

    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.self_attn.k_proj.register_forward_hook(hook(("k", i))))
        handles.append(layer.self_attn.v_proj.register_forward_hook(hook(("v", i))))
    for prompt in parity_prompts(path, seed=1)[:4]:
        model(torch.tensor([prompt]))
    for h in handles:
        h.remove()
    return [(amax["k", i] * 1.5 / E4M3_MAX, amax["v", i] / E4M3_MAX) for i in range(len(KEY_GAIN))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("kv-scales")
    bare = _write(str(root / "bare"), None)
    scales = _calibrate(bare)
    return {"bare": bare, "scaled": _write(str(root / "scaled"), scales), "scales": scales}


def _prompts(path: str) -> list[list[int]]:
    p = parity_prompts(path)
    return [p[0], p[3], p[4], p[5]]  # 3, 57, 125 and 133 tokens; the last two share 120


def _generate(path: str, **opts) -> list[dict]:
    with running_engine(path, skip_tokenizer_init=True, **opts) as llm:
        return llm.generate(input_ids=_prompts(path), sampling_params=GREEDY, return_logprob=True)


def _logprobs(out: dict) -> list[float]:
    return [x[0] for x in out["meta_info"]["output_token_logprobs"]]


def _gap(outs: list[dict], refs: list[dict]) -> float:
    """Mean |logprob difference| of the chosen tokens while the two runs agree (and at the first token they don't)."""
    gaps = []
    for out, ref in zip(outs, refs):
        n = next((i + 1 for i, (a, b) in enumerate(zip(out["output_ids"], ref["output_ids"])) if a != b),
                 len(ref["output_ids"]))
        gaps += [abs(a - b) for a, b in zip(_logprobs(out)[:n], _logprobs(ref)[:n])]
    return sum(gaps) / len(gaps)


@pytest.fixture(scope="module")
def float_cache(checkpoints) -> list[dict]:
    return _generate(checkpoints["scaled"])


def test_checkpoint_scales_keep_an_fp8_cache_near_the_float_cache(checkpoints, float_cache):
    """Stated tolerance: the first 8 greedy tokens equal the float32 cache's, and the chosen tokens' logprobs are
    within 0.05 of its on average; without the scales (1.0) the same weights are more than 0.2 away."""
    with running_engine(checkpoints["scaled"], kv_cache_dtype="fp8_e4m3", skip_tokenizer_init=True) as llm:
        pool = llm.runner.kv_pool
        assert pool.k_scale == pytest.approx([k for k, _ in checkpoints["scales"]], rel=1e-6)
        assert pool.v_scale == pytest.approx([v for _, v in checkpoints["scales"]], rel=1e-6)
        outs = llm.generate(input_ids=_prompts(checkpoints["scaled"]), sampling_params=GREEDY, return_logprob=True)
    for out, ref in zip(outs, float_cache):
        assert out["output_ids"][:AGREE] == ref["output_ids"][:AGREE]
    assert 0 < _gap(outs, float_cache) < 0.05  # (0: the cache was not fp8)
    unscaled = _generate(checkpoints["bare"], kv_cache_dtype="fp8_e4m3")
    assert _gap(unscaled, float_cache) > 0.2  # the scales are what keeps this checkpoint's fp8 cache right


def test_a_float_cache_ignores_the_scales(checkpoints, float_cache):
    """As SGLang does: a checkpoint's KV cache scales are not refused by a float32 cache, and change nothing."""
    with running_engine(checkpoints["scaled"], skip_tokenizer_init=True) as llm:
        assert set(llm.runner.kv_pool.k_scale + llm.runner.kv_pool.v_scale) == {1.0}
    bare = _generate(checkpoints["bare"])
    assert [o["output_ids"] for o in float_cache] == [o["output_ids"] for o in bare]
    for a, b in zip(float_cache, bare):
        assert _logprobs(a) == _logprobs(b)


def test_the_triton_kernels_apply_the_scales_as_torch_native_does(checkpoints):
    """Both backends over the same scaled fp8 cache (Triton's interpreter): prefill in 32-token chunks (the second
    attends to the first from the cache) and decode."""
    path, got = checkpoints["scaled"], {}
    prompts = _prompts(path)[:2]  # (the interpreter is slow: 3 and 57 tokens)
    for backend in ("torch_native", "triton"):
        with running_engine(path, kv_cache_dtype="fp8_e4m3", attention_backend=backend, chunked_prefill_size=32,
                            skip_tokenizer_init=True) as llm:
            got[backend] = llm.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 8},
                                        return_logprob=True)
    assert [o["output_ids"] for o in got["triton"]] == [o["output_ids"] for o in got["torch_native"]]
    for a, b in zip(got["triton"], got["torch_native"]):
        assert _logprobs(a) == pytest.approx(_logprobs(b), abs=1e-4)


def test_the_scales_under_tensor_parallelism(checkpoints):
    """Two ranks each hold half the KV heads and every layer's (replicated) scales: the answers are one process's."""
    one = _generate(checkpoints["scaled"], kv_cache_dtype="fp8_e4m3")
    two = _generate(checkpoints["scaled"], kv_cache_dtype="fp8_e4m3", tp_size=2)
    assert [o["output_ids"] for o in two] == [o["output_ids"] for o in one]
    for a, b in zip(one, two):
        assert _logprobs(a) == pytest.approx(_logprobs(b), abs=1e-3)


def test_the_hierarchical_cache_brings_scaled_pages_back_unchanged(checkpoints):
    """Pages leave the device for host memory and come back as bytes, read with the same scales: a tiered engine
    answers conversations as one that keeps them all on the device."""
    path, rng = checkpoints["scaled"], random.Random(0)
    convs = [[rng.randrange(5, 900) for _ in range(60)] for _ in range(5)]
    common = dict(kv_cache_dtype="fp8_e4m3", skip_tokenizer_init=True, page_size=4)
    with running_engine(path, max_total_tokens=4096, **common) as roomy, \
            running_engine(path, max_total_tokens=192, enable_hierarchical_cache=True, hicache_ratio=8,
                           **common) as tiered:
        for _ in range(2):
            for i, conv in enumerate(convs):
                want = roomy.generate(input_ids=conv, sampling_params=GREEDY)
                got = tiered.generate(input_ids=conv, sampling_params=GREEDY)
                assert got["output_ids"] == want["output_ids"]
                convs[i] = conv + want["output_ids"] + [rng.randrange(5, 900) for _ in range(8)]
        assert tiered.get_load()["host_hit_tokens"] > 0


def test_a_prefill_decode_handoff_reads_the_pages_with_the_same_scales(checkpoints):
    """The prefill worker's fp8 pages reach the decode worker as bytes; both load the checkpoint's scales, so the
    handed-over requests decode as a colocated engine does."""
    from tests.unit.test_pd_handoff import LP, OPTS, Pair, _same

    path = checkpoints["scaled"]
    opts = {**OPTS, "kv_cache_dtype": "fp8_e4m3"}
    with running_engine(path, **opts) as p, running_engine(path, **opts) as d, running_engine(path, **opts) as c:
        assert p.runner.kv_pool.k_scale == d.runner.kv_pool.k_scale != (1.0,) * len(KEY_GAIN)
        pair = Pair(p, d)
        sp = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}

        async def run():
            for ids in _prompts(path)[1:3]:
                _same(await pair.generate(ids, sp, verify=True, **LP),
                      await c.async_generate(input_ids=ids, sampling_params=sp, **LP))
        asyncio.run(run())


def test_a_param_file_s_scales_under_tensor_parallelism(checkpoints, tmp_path):
    """SGLang's --quantization-param-path: one scale a layer for keys and values, a map for each TP rank. Two ranks,
    each reading its own map, answer as one process reading the file, and with the scales, not without them."""
    import json

    per_layer = {str(i): max(k, v) for i, (k, v) in enumerate(checkpoints["scales"])}

    def param_file(ranks: int) -> str:
        path = tmp_path / f"kv_scales_tp{ranks}.json"
        path.write_text(json.dumps({"model_type": "llama", "kv_cache": {
            "dtype": "float8_e4m3fn", "scaling_factor": {str(r): per_layer for r in range(ranks)}}}))
        return str(path)

    bare = checkpoints["bare"]
    one = _generate(bare, kv_cache_dtype="fp8_e4m3", quantization_param_path=param_file(1))
    two = _generate(bare, kv_cache_dtype="fp8_e4m3", quantization_param_path=param_file(2), tp_size=2)
    assert [o["output_ids"] for o in two] == [o["output_ids"] for o in one]
    for a, b in zip(one, two):
        assert _logprobs(a) == pytest.approx(_logprobs(b), abs=1e-3)
    unscaled = _generate(bare, kv_cache_dtype="fp8_e4m3")
    assert [_logprobs(o) for o in unscaled] != [_logprobs(o) for o in one]
