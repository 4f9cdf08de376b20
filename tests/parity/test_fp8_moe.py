"""fp8 mixture-of-experts checkpoints with their experts held in fp8 (issue 52; --fp8-gemm-backend triton, on CPU in
Triton's interpreter), float32, against the same checkpoint served dequantized (--fp8-gemm-backend auto on CPU).

The model is tiny-qwen3-moe's first layer (sparse) alone, a quarter of its interpreted kernels: its circuit decides
every greedy step by a wide margin (here >= 1.5 nats), so fp8's rounding of the experts' activations (block-wise
checkpoints quantize them per token and group of 128 columns, kernels.moe_fp8) moves logprobs far less than the
margins (~1e-3) and the greedy tokens cannot move. Per-channel experts read 16-bit activations: the products are
the dequantized weights' (logprobs within float32 summation order); so do block-wise experts at one token
(kernels.moe_decode_fp8, every decode step at batch 1), where the grouped GEMMs (prefill) quantize them. Each
checkpoint is our fp8 writer's (engine.quantization.fp8.write_checkpoint). Loading alone (no forward) checks every
format's held experts against the dequantized ones bit for bit, Mixtral's and --quantization fp8's too, and their
bytes."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixmesh.engine.quantization import fp8
from radixmesh.kernels.fp8_quant import dequantize_weight
from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine

KERNELS = {"fp8_gemm_backend": "triton", "moe_runner_backend": "triton", "chunked_prefill_size": 16}
BLOCK = (32, 128)  # 128-column groups as DeepSeek-V3's and Qwen3-FP8's; 32 rows: q, k and v (head_dim 48) start there
LOGPROB_TOL = 1e-2  # block-wise experts: activations in fp8 move logprobs ~1e-3 here


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory) -> str:
    """tiny-qwen3-moe's first layer (sparse) alone: embedding, layer 0, norm and head."""
    src, dst = model_path("tiny-qwen3-moe"), str(tmp_path_factory.mktemp("one-layer"))
    for f in os.listdir(src):
        if f != "model.safetensors":
            shutil.copy(os.path.join(src, f), dst)
    weights = load_file(os.path.join(src, "model.safetensors"))
    save_file({name: t for name, t in weights.items()
               if not name.startswith("model.layers.") or name.startswith("model.layers.0.")},
              os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config.update(num_hidden_layers=1, max_window_layers=1, mlp_only_layers=[])
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


@pytest.fixture(scope="module")
def checkpoints(one_layer, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fp8-moe")
    kinds = {"block": dict(block=BLOCK), "channel": {}, "tensor": dict(per_tensor=True),
             "ct-block": dict(block=BLOCK, compressed_tensors=True), "tp-block": dict(block=(16, 32))}
    return {kind: fp8.write_checkpoint(one_layer, str(root / kind), **how) for kind, how in kinds.items()}


def _experts(model) -> list[torch.nn.Module]:
    from radixmesh.engine.layers.moe import FusedMoE

    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def _serve(path: str, steps: int, **opts) -> tuple[list[int], list[float], list[float]]:
    """`steps` greedy tokens of one prompt, their logprobs, and each step's margin (top-1 minus top-2 logprob)."""
    with running_engine(path, skip_tokenizer_init=True, **opts) as llm:
        if opts.get("fp8_gemm_backend") == "triton":  # (rank 0's experts under tensor parallelism)
            assert all(p.weight.dtype == torch.float8_e4m3fn for m in _experts(llm.runner.model) for p in (m.w13, m.w2))
        out = llm.generate(input_ids=parity_prompts(path)[1], return_logprob=True, top_logprobs_num=2,
                           sampling_params={"max_new_tokens": steps, "temperature": 0})
    meta = out["meta_info"]
    return (out["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]],
            [top[0][0] - top[1][0] for top in meta["output_top_logprobs"]])


def _matches_the_dequantized_model(path: str, tol: float, steps: int = 8, **opts) -> None:
    ids, logprobs, _ = _serve(path, steps, **opts)
    want, want_logprobs, margins = _serve(path, steps)
    assert len(want) == steps and min(margins) > 2 * tol  # a step whose logprobs stay within tol cannot flip
    assert ids == want
    assert logprobs == pytest.approx(want_logprobs, abs=tol)


def test_block_fp8_experts_on_the_kernels_track_the_dequantized_model(checkpoints, monkeypatch):
    """Every product reads fp8 weights, the attention's decode-sized ones with float32 activations. Batch 1: the
    prompt's prefill runs the experts' grouped GEMMs with fp8 activations (W8A8), so the first token's logprob is
    held within LOGPROB_TOL (seen: 2.5e-5); every decode step's experts run kernels.moe_decode_fp8 (one token is
    always few enough), W8A16 with the block scales, so those steps' logprobs are the dequantized model's within
    float32 summation order (seen: 1.5e-6). Greedy tokens equal throughout."""
    from radixmesh.kernels import moe_decode_fp8

    tokens = []  # the token count of each call of the few-token path
    real = moe_decode_fp8.decode_experts_fp8

    def counted(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        tokens.append(len(x))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(moe_decode_fp8, "decode_experts_fp8", counted)
    ids, logprobs, _ = _serve(checkpoints["block"], 8, **KERNELS)
    assert tokens == [1] * 7  # the 7 decode steps of the one sparse layer; the prompt's prefill was grouped
    want, want_logprobs, margins = _serve(checkpoints["block"], 8)
    assert ids == want and min(margins) > 2 * LOGPROB_TOL
    assert logprobs[0] == pytest.approx(want_logprobs[0], abs=LOGPROB_TOL)
    assert logprobs[1:] == pytest.approx(want_logprobs[1:], abs=1e-5)


def test_per_channel_fp8_experts_on_the_kernels_equal_the_dequantized_model(checkpoints):
    _matches_the_dequantized_model(checkpoints["channel"], 1e-4, **KERNELS)


def test_tensor_parallel_ranks_hold_their_experts_rows_and_block_scales(checkpoints):
    """tp_size 2 on blocks of 16 x 32: each rank holds its half of every expert's intermediate rows (w13) and
    columns (w2) in fp8 with the block scales of those rows and columns (here the experts run the twin)."""
    _matches_the_dequantized_model(checkpoints["tp-block"], LOGPROB_TOL, steps=4, tp_size=2,
                                   fp8_gemm_backend="triton", chunked_prefill_size=16)


def _load(path: str, load_format: str = "auto", **opts):
    from radixmesh.engine.model_config import ModelConfig
    from radixmesh.engine.models.loader import load_model

    return load_model(ModelConfig.from_path(path), load_format, torch.float32, torch.device("cpu"), 64, **opts)


def _dequantized(part: torch.nn.Module) -> torch.Tensor:
    return torch.stack([dequantize_weight(w, s, part.fp8.block) for w, s in zip(part.weight, part.weight_scale)])


def _check_held(held, plain) -> None:
    """Every layer's experts in `held` are fp8 whose dequantized weights are `plain`'s exactly, in about half the
    bytes of bfloat16 weights (scales included)."""
    pairs = list(zip(_experts(held), _experts(plain)))
    assert pairs
    for moe, ref in pairs:
        for part, want in ((moe.w13, ref.w13.weight), (moe.w2, ref.w2.weight)):
            assert part.weight.dtype == torch.float8_e4m3fn and part.weight_scale.dtype == torch.float32
            assert torch.equal(_dequantized(part), want)
            assert part.weight.nbytes + part.weight_scale.nbytes <= 0.55 * want.numel() * 2


@pytest.mark.parametrize("kind", ["block", "channel", "tensor", "ct-block"])
def test_fp8_experts_are_held_as_their_checkpoint_says(checkpoints, kind):
    """Block scales (Hugging Face's weight_scale_inv, llm-compressor's weight_scale), one per row, one per tensor."""
    _check_held(_load(checkpoints[kind], fp8_gemm_backend="triton"), _load(checkpoints[kind]))


def test_online_fp8_rounds_the_experts_as_the_writer_does(one_layer, checkpoints):
    """--quantization fp8 on a 16-bit MoE checkpoint: each expert's rows rounded with their own scale, the same
    codes and scales our writer stores."""
    online = _load(one_layer, quantization="fp8", fp8_gemm_backend="triton")
    written = _load(checkpoints["channel"], fp8_gemm_backend="triton")
    _check_held(online, _load(checkpoints["channel"]))
    for a, b in zip(_experts(online), _experts(written)):
        for x, y in ((a.w13, b.w13), (a.w2, b.w2)):
            assert torch.equal(x.weight.view(torch.uint8), y.weight.view(torch.uint8))
            assert torch.equal(x.weight_scale, y.weight_scale)


def test_dummy_weights_under_online_fp8_hold_the_experts_in_fp8(one_layer):
    """--load-format dummy --quantization fp8 (the benchmarks' fp8 MoE shapes): fp8 codes and scales for experts."""
    moe, = _experts(_load(one_layer, "dummy", quantization="fp8", fp8_gemm_backend="triton"))
    for part in (moe.w13, moe.w2):
        assert part.weight.dtype == torch.float8_e4m3fn and part.weight_scale.shape == part.weight.shape[:2]
        assert part.weight.float().abs().amax() > 100 and bool((part.weight_scale == 0.02 / 448).all())


def _tiny_transformers_moe(path: str, config_cls: str, model_cls: str, **fields) -> str:
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(vocab_size=64, hidden_size=64, num_attention_heads=2,
                                               num_key_value_heads=2, head_dim=32, num_hidden_layers=1,
                                               max_position_embeddings=64, **fields)
    getattr(transformers, model_cls)(config).float().save_pretrained(path)
    return path


def test_mixtral_experts_w1_w3_w2_are_held_in_fp8(tmp_path):
    base = _tiny_transformers_moe(str(tmp_path / "mixtral"), "MixtralConfig", "MixtralForCausalLM",
                                  intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
    q = fp8.write_checkpoint(base, str(tmp_path / "fp8"), block=(32, 32))
    _check_held(_load(q, fp8_gemm_backend="triton"), _load(q))


def test_an_expert_part_starting_inside_a_block_is_refused(tmp_path):
    """moe_intermediate_size 48 with blocks of 32 rows: the up projection's rows start at 48 of the stacked w13,
    inside its second block row, whose one scale cannot hold both the gate's and the up's blocks."""
    base = _tiny_transformers_moe(str(tmp_path / "qwen3-moe"), "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                                  intermediate_size=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
    q = fp8.write_checkpoint(base, str(tmp_path / "fp8"), block=(32, 32))
    with pytest.raises(ValueError, match=r"experts\.\d\.up_proj\.weight fills rows from 48 .* inside a block"):
        _load(q, fp8_gemm_backend="triton")
    assert _experts(_load(q))  # the dequantized path serves it
