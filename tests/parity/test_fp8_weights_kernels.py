"""fp8 weights held in fp8 and run by the fp8 kernels inside the engine (--fp8-gemm-backend triton; on CPU in Triton's
interpreter), float32, against the fp8 checkpoint's dequantized twin in transformers.

Products of up to 16 rows (decode, and prefill in chunks of 16) read the fp8 weights with float32 activations
(kernels.fp8_gemv): the same products as the twin's, so the outputs are token-exact and the logprobs within 1e-4.
Longer prefills quantize their activations per token (and group of bk columns for block-wise weights) before the
fp8 GEMM (kernels.fp8_quant, kernels.fp8_gemm); the reference then rounds the prompt positions' inputs of every
projection the same way (kernels.fp8_quant's twin) and is again token-exact. Tensor parallelism cuts the block
scales with their weights, and a cut inside a block is refused."""

from __future__ import annotations

import contextlib

import pytest
import torch

from radixmesh.engine.quantization import fp8
from radixmesh.kernels.fp8_quant import dequantize_groups, group_quant_reference
from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine
from tests.reference import eos_ids, hf_greedy, hf_model, hf_token_logprobs

# a prefill and two decode steps (the second reads keys and values the first one's fp8 products wrote): each step runs
# the same products again, and Triton's interpreter runs every product of every step
MAX_NEW = 3
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}
KERNELS = {"fp8_gemm_backend": "triton", "skip_tokenizer_init": True}
SHORT = {"chunked_prefill_size": 16}  # every product has at most 16 rows: fp8 weights, float32 activations
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KINDS = {"block": dict(block=(32, 64)), "channel": {}, "ct-tensor-static": dict(per_tensor=True, static_input=True,
                                                                               compressed_tensors=True)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """kind -> (fp8 checkpoint of tiny-llama, its float32 twin)."""
    out = {}
    for kind, how in KINDS.items():
        root = tmp_path_factory.mktemp(kind)
        q = fp8.write_checkpoint(model_path("tiny-llama"), str(root / "fp8"), **how)
        out[kind] = (q, fp8.dequantized_checkpoint(q, str(root / "twin")))
    return out


def _held(llm) -> list[torch.nn.Module]:
    return [m for m in llm.runner.model.modules() if getattr(m, "fp8", None) is not None]


_runs: dict[tuple, tuple[list[dict], int]] = {}


def _generate(path: str, prompts, **opts) -> tuple[list[dict], int]:
    """The engine's greedy outputs (with logprobs) and how many modules hold fp8 weights. An engine of the same
    arguments given the same prompts is run once per module (a deterministic greedy run: the decode test's channel
    run is the online test's rounded-checkpoint side, its block run the tensor-parallel test's one-process side)."""
    key = (path, tuple(map(tuple, prompts)), tuple(sorted(opts.items())))
    if key not in _runs:
        with running_engine(path, **KERNELS, **opts) as llm:
            held = _held(llm)
            assert all(m.weight.dtype == torch.float8_e4m3fn for m in held)
            _runs[key] = llm.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True), len(held)
    return _runs[key]


def _logprobs(out: dict) -> list[float]:
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


@pytest.mark.parametrize("kind", KINDS)
def test_decode_sized_products_on_fp8_weights_match_the_twin(checkpoints, kind):
    q, twin = checkpoints[kind]
    prompts = parity_prompts(q)[:2]  # (Triton's interpreter runs every product: few prompts keep it quick)
    refs = hf_greedy(twin, prompts, MAX_NEW)
    outs, held = _generate(q, prompts, **SHORT)
    assert held == 4 * 4  # each layer's qkv, o, gate/up and down projections
    assert [o["output_ids"] for o in outs] == refs
    for p, out, ref in zip(prompts, outs, refs):
        assert _logprobs(out) == pytest.approx(hf_token_logprobs(twin, p, ref), abs=1e-4)


@contextlib.contextmanager
def _prompt_inputs_rounded(model, prompt_len: int, group: int | None):
    """transformers' projections with their inputs at the first `prompt_len` positions quantized to fp8 per token
    (and group) and back, as the engine's prefill GEMMs take them."""
    def hook(module, args):
        x = args[0]
        flat = x.reshape(-1, x.shape[-1])
        q, s = group_quant_reference(flat[:prompt_len], group)
        return (torch.cat([dequantize_groups(q, s, group), flat[prompt_len:]]).view_as(x),)

    handles = [m.register_forward_pre_hook(hook) for name, m in model.named_modules()
               if name.rsplit(".", 1)[-1] in PROJECTIONS]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.inference_mode()
def _w8a8_prefill_reference(twin: str, prompt: list[int], group: int | None) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from the twin whose prompt positions' projection inputs are rounded."""
    model = hf_model(twin)
    out: list[int] = []
    with _prompt_inputs_rounded(model, len(prompt), group):
        for _ in range(MAX_NEW):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
            out.append(int(logits.argmax()))
            if out[-1] in eos_ids(model):
                break
        logits = model(torch.tensor([prompt + out])).logits[0].float()
    steps = torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(out)], dim=-1)
    return out, steps.gather(1, torch.tensor(out)[:, None]).squeeze(1).tolist()


@pytest.mark.parametrize("kind,group", [("block", 64), ("channel", None)])
def test_long_prefills_quantize_activations_as_the_reference_does(checkpoints, kind, group):
    q, twin = checkpoints[kind]
    prompts = [parity_prompts(q)[2][:18]]  # 18 tokens: the prefill forward has more than 16 rows
    outs, _ = _generate(q, prompts)
    for p, out in zip(prompts, outs):
        ids, logprobs = _w8a8_prefill_reference(twin, p, group)
        assert out["output_ids"] == ids
        assert _logprobs(out) == pytest.approx(logprobs, abs=1e-4)


def test_block_scales_shard_with_their_weights_under_tensor_parallelism(checkpoints):
    """tp_size 2 on blocks of 32 x 64: each rank holds its rows' (columns') block scales; token-exact with one
    process, logprobs within 1e-5 (the row-parallel sums add in another order)."""
    q, _ = checkpoints["block"]
    # the decode test's prompts and options: its one-process run (block kind) is this test's `one`, and each rank's
    # prefill and decode products still go through the fp8 kernels with its shard of the block scales
    prompts = parity_prompts(q)[:2]
    one, _ = _generate(q, prompts, **SHORT)
    two, _ = _generate(q, prompts, tp_size=2, **SHORT)
    assert [o["output_ids"] for o in two] == [o["output_ids"] for o in one]
    for a, b in zip(one, two):
        assert _logprobs(a) == pytest.approx(_logprobs(b), abs=1e-5)


def test_a_tensor_parallel_cut_inside_a_block_is_refused(tmp_path):
    """tiny-qwen3-moe has 2 KV heads of 48: at tp_size 2 each rank's 48 k rows cut a block of 32 rows."""
    q = fp8.write_checkpoint(model_path("tiny-qwen3-moe"), str(tmp_path / "fp8"), block=(32, 64))
    with pytest.raises(Exception, match="cut a block of 32 rows"):
        with running_engine(q, tp_size=2, **KERNELS):
            pass


def test_online_fp8_on_the_kernels_equals_the_rounded_checkpoint(checkpoints):
    base = model_path("tiny-llama")
    prompts = parity_prompts(base)[:2]
    online, held = _generate(base, prompts, quantization="fp8", **SHORT)
    written, _ = _generate(checkpoints["channel"][0], prompts, **SHORT)
    assert held == 16
    assert [o["output_ids"] for o in online] == [o["output_ids"] for o in written]
    for a, b in zip(online, written):
        assert _logprobs(a) == pytest.approx(_logprobs(b), abs=1e-6)


def test_the_kernel_backend_is_refused_on_cpu_without_the_interpreter(monkeypatch):
    from radixmesh.engine import config
    from radixmesh.engine.config import EngineArgs, resolve_args
    from radixmesh.engine.model_config import ModelConfig

    path = model_path("tiny-llama")
    monkeypatch.setattr(config, "_triton_interpreting", lambda: False)
    with pytest.raises(ValueError, match="fp8_gemm_backend triton runs"):
        resolve_args(EngineArgs(model_path=path, device="cpu", fp8_gemm_backend="triton"), ModelConfig.from_path(path))
    with pytest.raises(ValueError, match="fp8_gemm_backend 'cutlass' is not implemented"):
        resolve_args(EngineArgs(model_path=path, device="cpu", fp8_gemm_backend="cutlass"), ModelConfig.from_path(path))


def test_dummy_weights_under_online_fp8_are_held_in_fp8():
    """--load-format dummy --quantization fp8 (the benchmarks' fp8 8B shape): fp8 codes and scales, and it runs."""
    with running_engine(model_path("tiny-llama"), load_format="dummy", quantization="fp8", **KERNELS) as llm:
        held = _held(llm)
        assert len(held) == 16
        assert all(m.weight.float().abs().amax() > 100 and bool((m.weight_scale == 0.02 / 448).all()) for m in held)
        out = llm.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 2, "temperature": 0})
    assert len(out[0]["output_ids"]) == 2
