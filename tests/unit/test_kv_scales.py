"""KV cache scales in checkpoints (engine.quantization.kv_scales, loader.load_kv_scales) and the pool that applies
them (engine.cache.kv_pool): the names exporters give them, 1.0 where a layer has none, a clear refusal of a scale we
cannot use, nothing read (and nothing refused) for a float cache, and an fp8 pool that stores clamp(x / scale); and
SGLang's --quantization-param-path file of per-rank scales in their place."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixmesh.engine import Engine
from radixmesh.engine.cache.kv_pool import KVPool
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models import loader
from radixmesh.engine.quantization.kv_scales import KvScales
from tests.conftest import model_path
from tests.engine_utils import running_engine

LAYERS = 4  # tiny-llama's


def _with(tmp_path, extra: dict[str, torch.Tensor], name: str = "m"):
    """A copy of tiny-llama whose checkpoint also holds `extra`."""
    dst = tmp_path / name
    shutil.copytree(model_path("tiny-llama"), dst)
    tensors = load_file(dst / "model.safetensors")
    tensors.update(extra)
    save_file(tensors, dst / "model.safetensors")
    return dst


def _scales(path, kv_cache_dtype="fp8_e4m3") -> KvScales | None:
    return loader.load_kv_scales(ModelConfig.from_path(str(path)), kv_cache_dtype, "auto")


def _at(layer: int, tail: str) -> str:
    return f"model.layers.{layer}.self_attn.{tail}"


@pytest.mark.parametrize("k_name,v_name,shape", [
    ("k_scale", "v_scale", ()),  # vLLM, SGLang, llm-compressor
    ("k_proj.output_scale", "v_proj.output_scale", (1,)),  # exporters' static output scales
    ("k_proj.k_scale", "v_proj.v_scale", (1,)),  # ModelOpt
    ("attn.k_scale", "attn.v_scale", ()),  # vLLM's module names
])
def test_the_names_exporters_give_read_the_same_scales(tmp_path, k_name, v_name, shape):
    extra = {}
    for i in range(LAYERS):
        extra[_at(i, k_name)] = torch.full(shape, 0.5 + i)
        extra[_at(i, v_name)] = torch.full(shape, 0.25 * (i + 1), dtype=torch.bfloat16)
    assert _scales(_with(tmp_path, extra)) == KvScales((0.5, 1.5, 2.5, 3.5), (0.25, 0.5, 0.75, 1.0))


def test_one_kv_scale_sets_both_and_a_layer_without_scales_keeps_one(tmp_path):
    extra = {_at(0, "kv_scale"): torch.tensor(2.0), _at(2, "k_scale"): torch.tensor(3.0),
             _at(3, "v_scale"): torch.tensor(0.5)}
    assert _scales(_with(tmp_path, extra)) == KvScales((2.0, 1.0, 3.0, 1.0), (2.0, 1.0, 1.0, 0.5))


@pytest.mark.parametrize("name,tensor,words", [
    (_at(1, "k_scale"), torch.tensor([0.5, 0.7]), ("shape (2,)", "per-head")),
    (_at(1, "v_scale"), torch.ones(2, 64), ("shape (2, 64)", "one scale per layer")),
    (_at(1, "k_scale"), torch.tensor(3, dtype=torch.int32), ("I32", "a scale is a float")),
    (_at(1, "k_scale"), torch.tensor(0.0), ("is 0.0", "positive finite")),
    (_at(1, "v_scale"), torch.tensor(-1.0), ("is -1.0", "positive finite")),
    (_at(1, "k_scale"), torch.tensor(float("nan")), ("is nan", "positive finite")),
    (_at(4, "k_scale"), torch.tensor(1.0), ("layer 4", "num_hidden_layers=4")),
], ids=["per-head", "per-channel", "integer", "zero", "negative", "nan", "no-such-layer"])
def test_a_scale_we_cannot_use_is_refused_by_name(tmp_path, name, tensor, words):
    path = _with(tmp_path, {name: tensor})
    with pytest.raises(ValueError) as err:
        _scales(path)
    assert repr(name) in str(err.value)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_two_different_scales_for_one_layer_are_refused(tmp_path):
    path = _with(tmp_path, {_at(2, "k_scale"): torch.tensor(0.5), _at(2, "k_proj.output_scale"): torch.tensor(0.6)})
    with pytest.raises(ValueError, match="layer 2 has two different KV cache scales"):
        _scales(path)
    same = _with(tmp_path, {_at(2, "k_scale"): torch.tensor(0.5), _at(2, "kv_scale"): torch.tensor(0.5)}, "same")
    assert _scales(same) == KvScales((1.0, 1.0, 0.5, 1.0), (1.0, 1.0, 0.5, 1.0))


def test_a_malformed_scale_stops_an_fp8_engine_and_is_ignored_by_a_float_one(tmp_path):
    """As SGLang: the scales are read only for an fp8 cache (load_kv_scales returns None otherwise), so a float
    cache neither reads nor refuses them; the fp8 engine fails to start with the reason."""
    path = _with(tmp_path, {_at(0, "k_scale"): torch.tensor([0.5, 0.7])})
    with pytest.raises(ValueError, match="per-head or per-channel KV cache scales"):
        Engine(model_path=str(path), device="cpu", dtype="float32", kv_cache_dtype="fp8_e4m3", log_level="warning")
    assert _scales(path, "auto") is None and _scales(path, "float32") is None
    with running_engine(str(path), skip_tokenizer_init=True) as llm:
        assert llm.runner.kv_pool.k_scale == (1.0,) * LAYERS
        assert len(llm.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})["output_ids"]) == 2


def test_a_scale_outside_a_decoder_layers_attention_is_refused_at_load(tmp_path):
    """Names that say KV cache scale but sit where no attention reads them: the model would be served without
    them, so the loader refuses the checkpoint (whatever the cache's dtype)."""
    path = _with(tmp_path, {"model.layers.0.mlp.k_scale": torch.tensor(0.5)})
    with pytest.raises(ValueError, match="looks like an fp8 KV cache scale"):
        loader.load_model(ModelConfig.from_path(str(path)), "auto", torch.float32, torch.device("cpu"), 128)


# ---- --quantization-param-path ---------------------------------------------------------------------------------------

def _param_file(tmp_path, ranks: dict, dtype="float8_e4m3fn", model_type="llama", name="kv_cache_scales.json") -> str:
    doc = {"model_type": model_type, "kv_cache": {"dtype": dtype, "scaling_factor": ranks}}
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def _from_file(path, file, kv_cache_dtype="fp8_e4m3", rank=0, size=1, load_format="auto"):
    return loader.load_kv_scales(ModelConfig.from_path(str(path)), kv_cache_dtype, load_format, file, rank, size)


def test_a_param_file_gives_each_rank_its_scales_in_place_of_the_checkpoint_s(tmp_path):
    """One scale a layer for keys and values, from the rank's own map (ranks hold different KV heads); the
    checkpoint's scales are not used once a file is given; dummy weights take the file too."""
    ckpt = _with(tmp_path, {_at(i, "k_scale"): torch.tensor(9.0) for i in range(LAYERS)})
    file = _param_file(tmp_path, {"0": {str(i): 0.5 + i for i in range(LAYERS)},
                                  "1": {str(i): 2.0 for i in range(LAYERS)}})
    assert _from_file(ckpt, file, rank=0, size=2) == KvScales((0.5, 1.5, 2.5, 3.5), (0.5, 1.5, 2.5, 3.5))
    assert _from_file(ckpt, file, rank=1, size=2, load_format="dummy") == KvScales((2.0,) * LAYERS, (2.0,) * LAYERS)


@pytest.mark.parametrize("ranks,kwargs,words", [
    ({"0": {str(i): 1.0 for i in range(LAYERS)}}, {"dtype": "float8_e5m2"}, "for a 'float8_e5m2' KV cache"),
    ({"0": {str(i): 1.0 for i in range(LAYERS)}}, {"model_type": "qwen2"}, "made for model_type 'qwen2'"),
    ({"0": {str(i): 1.0 for i in range(LAYERS)}, "1": {str(i): 1.0 for i in range(LAYERS)}}, {},
     "runs with tp_size 1"),
    ({"0": {str(i): 1.0 for i in range(LAYERS - 1)}}, {}, "each needs one"),
    ({"0": {**{str(i): 1.0 for i in range(LAYERS - 1)}, str(LAYERS - 1): "x"}}, {}, "not a number"),
    ({"0": {**{str(i): 1.0 for i in range(LAYERS - 1)}, str(LAYERS - 1): -1.0}}, {}, "positive finite"),
])
def test_a_param_file_that_does_not_fit_is_refused_with_the_reason(tmp_path, ranks, kwargs, words):
    with pytest.raises(ValueError, match=words):
        _from_file(model_path("tiny-llama"), _param_file(tmp_path, ranks, **kwargs))


def test_a_param_file_is_for_an_e4m3_cache_read_by_no_float_one_and_must_parse(tmp_path):
    file = _param_file(tmp_path, {"0": {str(i): 1.0 for i in range(LAYERS)}})
    with pytest.raises(ValueError, match="--kv-cache-dtype is fp8_e5m2"):
        _from_file(model_path("tiny-llama"), file, "fp8_e5m2")
    assert _from_file(model_path("tiny-llama"), file, "auto") is None
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable JSON file"):
        _from_file(model_path("tiny-llama"), str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="no kv_cache.scaling_factor"):
        _from_file(model_path("tiny-llama"), _param_file(tmp_path, [], name="list.json"))


def test_stored_pages_are_keyed_by_the_scales_they_were_stored_under(tmp_path):
    """The storage tiers' page keys bind the layout, and an fp8 cache's layout binds the values of its scales (every
    TP rank's), wherever they come from: pages stored under other scales are never read back under these, and pages
    stored under the same values are, whether a file or the checkpoint gave them."""
    from radixmesh.engine.cache.build import kv_layout
    from radixmesh.engine.config import EngineArgs

    values = [4.0, 0.25, 8.0, 2.0]
    ckpt = _with(tmp_path, {_at(i, "kv_scale"): torch.tensor(v) for i, v in enumerate(values)}, name="llama")
    plain = _with(tmp_path, {}, name="plain/llama")  # (the same directory name as ckpt's, without scales)
    file = _param_file(tmp_path, {"0": {str(i): v for i, v in enumerate(values)}}, name="a.json")
    spaced = tmp_path / "b.json"  # the same values in other bytes
    spaced.write_text(json.dumps(json.loads(open(file).read()), indent=4))
    ones = _param_file(tmp_path, {"0": {str(i): 1.0 for i in range(LAYERS)}}, name="c.json")
    twos = _param_file(tmp_path, {"0": {str(i): 2.0 for i in range(LAYERS)}}, name="d.json")
    per_rank = _param_file(tmp_path, {"0": {str(i): 2.0 for i in range(LAYERS)},
                                      "1": {str(i): 2.0 for i in range(LAYERS)}}, name="e.json")
    per_rank2 = _param_file(tmp_path, {"0": {str(i): 2.0 for i in range(LAYERS)},
                                       "1": {str(i): 3.0 for i in range(LAYERS)}}, name="f.json")

    def layout(path, file=None, dtype="fp8_e4m3", tp=1):
        args = EngineArgs(model_path=str(path), kv_cache_dtype=dtype, quantization_param_path=file, page_size=1,
                          tp_size=tp)
        return kv_layout(args, ModelConfig.from_path(str(path)))
    assert layout(plain, file) == layout(plain, str(spaced)) == layout(ckpt)  # the same values
    assert layout(plain) == layout(plain, ones)  # 1.0 everywhere: no scales
    assert len({layout(plain), layout(plain, file), layout(plain, twos)}) == 3
    assert layout(plain, per_rank, tp=2) != layout(plain, per_rank2, tp=2)  # (rank 1's scales differ)
    assert layout(ckpt, dtype="bfloat16") == layout(plain, file, "bfloat16")  # (a float cache reads no scales)


def test_an_engine_serves_the_same_with_a_param_file_as_with_the_checkpoint_s_scales(tmp_path):
    """The same per-layer scales from the file (--quantization-param-path) or in the checkpoint: the same pool
    scales, tokens and logprobs; with scales large enough to change what the fp8 cache stores, so a file that was not
    applied would show."""
    values = [4.0, 0.25, 8.0, 2.0]
    ckpt = _with(tmp_path, {_at(i, "kv_scale"): torch.tensor(v) for i, v in enumerate(values)})
    file = _param_file(tmp_path, {"0": {str(i): v for i, v in enumerate(values)}})
    got = {}
    for name, path, extra in (("file", model_path("tiny-llama"), {"quantization_param_path": file}),
                              ("checkpoint", str(ckpt), {}), ("none", model_path("tiny-llama"), {})):
        with running_engine(path, skip_tokenizer_init=True, kv_cache_dtype="fp8_e4m3", **extra) as llm:
            scales = llm.runner.kv_pool.k_scale, llm.runner.kv_pool.v_scale
            out = llm.generate(input_ids=[5, 6, 7, 8, 9], sampling_params={"max_new_tokens": 6, "temperature": 0},
                               return_logprob=True)
        got[name] = scales, out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert got["file"][0] == (tuple(values), tuple(values))
    assert got["file"] == got["checkpoint"]
    assert got["none"][2] != got["file"][2]


# ---- the pool ---------------------------------------------------------------------------------------------------------

def _pool(dtype, scales=None) -> KVPool:
    return KVPool(4, 4, 2, 2, 8, dtype, torch.device("cpu"), scales)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_an_fp8_pool_stores_x_over_its_scale_and_reads_back_x(dtype):
    """Keys of magnitude ~2000 (beyond e4m3's 448) and values of ~0.001 (in its subnormals): with the scales they
    come back within fp8's relative precision (2^-4 for e4m3, 2^-3 for e5m2); the stored bytes are clamp(x / s)."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(6, 2, 8, generator=gen) * 2000
    v = torch.randn(6, 2, 8, generator=gen) * 1e-3
    pool = _pool(dtype, ((1.0, 2000 * 4 / 448), (1.0, 1e-3 * 4 / 448)))
    loc = torch.tensor([4, 5, 6, 9, 10, 11])
    pool.write(1, loc, k, v)
    assert torch.equal(pool.k[1][loc], (k / pool.k_scale[1]).to(dtype))
    got_k, got_v = pool.read(1, loc, torch.float32)
    bound = 2 ** -4 if dtype == torch.float8_e4m3fn else 2 ** -3
    for got, want in ((got_k, k), (got_v, v)):
        big = want.abs() > 0.05 * want.abs().max()  # (smaller ones are in fp8's subnormals even when scaled)
        assert ((got - want).abs()[big] <= bound * want.abs()[big]).all()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_values_beyond_the_range_are_clamped_not_inf(dtype):
    pool = _pool(dtype, ((1.0, 2.0), (1.0, 1.0)))
    big = torch.finfo(dtype).max
    x = torch.ones(3, 2, 8)
    x[0], x[1] = 3 * big, -5 * big
    pool.write(1, torch.tensor([1, 2, 3]), x, x)
    k, v = pool.read(1, torch.tensor([1, 2, 3]), torch.float32)
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
    assert k.abs().max() == 2.0 * big and v.abs().max() == big


def test_scales_belong_to_an_fp8_pool_of_the_models_layers():
    with pytest.raises(ValueError, match="apply to an fp8 KV cache only"):
        _pool(torch.float32, ((2.0, 1.0), (1.0, 1.0)))
    with pytest.raises(ValueError, match="for 3 / 2 layers, but the pool has 2"):
        _pool(torch.float8_e4m3fn, ((1.0,) * 3, (1.0, 1.0)))
    assert _pool(torch.float32, ((1.0, 1.0), (1.0, 1.0))).k_scale == (1.0, 1.0)


def test_a_prefill_decode_pair_refuses_pages_that_would_read_back_wrong():
    """The handoff's kv_format (sent by the decode worker, compared by the prefill worker): fp8_e4m3 and fp8_e5m2
    pages have the same bytes, and so do pages under other scales, so both are named in it; a float cache's is its
    dtype; an older decode worker sends none and is not refused for it."""
    from radixmesh.engine.disaggregation.kv_pages import check_kv_format, kv_format

    scales = ((1.0, 2.0), (1.0, 1.0))
    e4m3 = kv_format(_pool(torch.float8_e4m3fn, scales))
    other_scales = kv_format(_pool(torch.float8_e4m3fn, ((1.0, 3.0), (1.0, 1.0))))
    e5m2 = kv_format(_pool(torch.float8_e5m2, scales))
    assert e4m3 == kv_format(_pool(torch.float8_e4m3fn, scales)) and kv_format(_pool(torch.float32)) == "float32"
    assert len({e4m3, other_scales, e5m2, "float32"}) == 4
    check_kv_format(e4m3, e4m3)
    check_kv_format(e4m3, "")
    for theirs in (other_scales, e5m2):
        with pytest.raises(ValueError, match="same --kv-cache-dtype and KV cache scales"):
            check_kv_format(e4m3, theirs)
