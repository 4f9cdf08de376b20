"""GPT-OSS (GptOssForCausalLM) token-exact with transformers (float32, CPU), a tiny random checkpoint written here by
transformers itself: attention with sinks (drawn large enough to move the outputs) over alternating sliding (a window
of 6 tokens, shorter than most prompts) and full layers, YaRN RoPE, q/k/v/o biases, a biased router, experts stored
stacked and interleaved with biases on both products and a clamped SwiGLU whose limit bites. Every generated token's
logprob is compared too; the checkpoint is checked to depend on the sinks, the clamp and the biases (dropping any of
them changes transformers' own tokens), so a model that ignored one would fail.

Also: the Triton attention kernels and expert kernels (Triton's interpreter), tensor and expert parallelism (gloo),
a config.json without the fields GptOssConfig defaults, the defaults against transformers', MXFP4 checkpoints (ours
written like OpenAI's, dequantized at load; the dequantization against transformers'), and the refusals."""

from __future__ import annotations

import json

import pytest
import torch

from tests.engine_utils import running_engine
from tests.parity.test_model_families import COMMON, GREEDY, PROMPTS as SHORT_PROMPTS
from tests.parity.test_model_families_more import PROMPTS, _check, _refused
from tests.reference import hf_greedy, hf_token_logprobs

WINDOW = 6
FIELDS = dict(num_hidden_layers=4, head_dim=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
              sliding_window=WINDOW, swiglu_limit=0.6, rope_parameters={
                  "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 128, "rope_theta": 10000.0})


def write_gpt_oss(path, seed: int = 7, expert_std: float = 0.15, **fields) -> str:
    """A random GPT-OSS checkpoint of COMMON's shape with FIELDS (and `fields`): norms from [0.5, 1.5), biases from
    N(0, 0.3), sinks from N(0, 1.5), the experts' weights from N(0, expert_std)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    config = GptOssConfig(**{**COMMON, **FIELDS, **fields})
    model = GptOssForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.3)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.5)
            elif name.endswith(("gate_up_proj", "down_proj")):
                p.normal_(0.0, expert_std)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))


def test_gpt_oss_matches_transformers(checkpoint):
    _check(checkpoint)


@torch.inference_mode()
def _tokens_without(path: str, what: str) -> list[list[int]]:
    """transformers' greedy tokens with the checkpoint's sinks, clamp or biases taken out (of a copy: hf_model's
    cached model is every other test's reference)."""
    import copy

    from tests.reference import eos_ids, hf_model

    model = copy.deepcopy(hf_model(path))
    for name, p in model.named_parameters():
        if what == "sinks" and name.endswith("sinks"):
            p.fill_(-1e4)
        if what == "biases" and name.endswith("bias") and "experts" in name:
            p.zero_()
    for layer in model.model.layers:
        if what == "clamp":
            layer.mlp.experts.limit = 1e4
    outs = []
    for prompt in PROMPTS:
        ids = list(prompt)
        for _ in range(GREEDY["max_new_tokens"]):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] in eos_ids(model):
                break
        outs.append(ids[len(prompt):])
    return outs


@pytest.mark.parametrize("what", ["sinks", "clamp", "biases"])
def test_the_checkpoint_depends_on_what_gpt_oss_adds(checkpoint, what):
    assert _tokens_without(checkpoint, what) != hf_greedy(checkpoint, PROMPTS, GREEDY["max_new_tokens"])


def test_triton_attention_and_experts_match_transformers_in_the_interpreter(checkpoint):
    """The sinks in the decode (split and merged) and extend kernels, the experts' biases and activation between the
    grouped GEMMs; one request alone decodes on the few-token expert launches (kernels.moe_decode), which compute
    them in their own kernels."""
    from radixmesh.kernels.moe_decode import use_decode_path

    _check(checkpoint, attention_backend="triton", moe_runner_backend="triton")
    assert use_decode_path(1, 2, 8) and not use_decode_path(2, 2, 8)
    prompt = PROMPTS[1]
    with running_engine(checkpoint, skip_tokenizer_init=True, attention_backend="triton", moe_runner_backend="triton",
                        chunked_prefill_size=16) as llm:
        out = llm.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 6}, return_logprob=True)
    ref = hf_greedy(checkpoint, [prompt], 6)[0]
    assert out["output_ids"] == ref
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(hf_token_logprobs(checkpoint, prompt, ref), abs=1e-4)


def test_the_gate_in_one_launch_with_the_router_bias_matches_transformers(checkpoint, monkeypatch):
    """One request decoding (a token a step): the residual add, the norm, the biased router and the routing in
    kernels.moe_gate's one launch, as on CUDA, forced here in Triton's interpreter: transformers' tokens and
    logprobs."""
    from radixmesh.engine.models import moe
    from radixmesh.kernels import moe_gate

    launches, gate = [], moe_gate.moe_gate
    monkeypatch.setattr(moe, "use_kernels", lambda t: True)
    monkeypatch.setattr(moe_gate, "moe_gate", lambda *a, **k: launches.append(k["router_bias"]) or gate(*a, **k))
    prompt = PROMPTS[1]
    with running_engine(checkpoint, skip_tokenizer_init=True, moe_runner_backend="triton") as llm:
        out = llm.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 6}, return_logprob=True)
    ref = hf_greedy(checkpoint, [prompt], 6)[0]
    assert out["output_ids"] == ref
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(hf_token_logprobs(checkpoint, prompt, ref), abs=1e-4)
    assert launches and all(b is not None for b in launches)


@pytest.mark.parametrize("parallel", [dict(tp_size=2), dict(tp_size=2, ep_size=2)], ids=["tp2", "ep2"])
def test_gpt_oss_over_two_ranks(checkpoint, parallel):
    """TP: each rank its heads' sinks, its interleaved gate/up columns, rank 0 the down bias; EP: whole experts."""
    _check(checkpoint, atol=1e-5, **parallel)


def test_a_config_without_gpt_oss_defaults_is_read_as_transformers_reads_it(tmp_path):
    """config.json without attention_bias, sliding_window, layer_types, head_dim, RoPE, rms_norm_eps or the SwiGLU's
    constants: transformers' GptOssConfig defaults them (head_dim 64, not hidden / heads; YaRN of factor 32 from
    4,096 positions; every other layer from 0 sliding over 128 tokens), and so does engine.model_config."""
    path = write_gpt_oss(tmp_path, seed=8, head_dim=64, sliding_window=128, swiglu_limit=7.0, rms_norm_eps=1e-5,
                         rope_parameters=None, layer_types=None)
    raw = json.loads((tmp_path / "config.json").read_text())
    for field in ("attention_bias", "sliding_window", "layer_types", "head_dim", "rope_parameters", "rope_scaling",
                  "rope_theta", "swiglu_alpha", "swiglu_limit", "rms_norm_eps"):
        raw.pop(field, None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    _check(path)


def test_the_defaults_are_gpt_oss_configs():
    from transformers import GptOssConfig

    from radixmesh.engine.layers.rope_scaling import _DEFAULT_THETA
    from radixmesh.engine.model_config import _DEFAULT_RMS_NORM_EPS, CONFIG_DEFAULTS, ROPE_DEFAULTS

    hf = GptOssConfig(num_hidden_layers=4)
    arch = "GptOssForCausalLM"
    assert {k: getattr(hf, k) for k in CONFIG_DEFAULTS[arch]} == CONFIG_DEFAULTS[arch]
    rope = dict(hf.rope_parameters)
    assert rope.pop("rope_theta") == _DEFAULT_THETA[arch] and rope == ROPE_DEFAULTS[arch]
    assert hf.rms_norm_eps == _DEFAULT_RMS_NORM_EPS[arch]
    assert hf.layer_types == ["sliding_attention", "full_attention"] * 2


def test_mxfp4_elsewhere_and_flashinfer_are_refused(tmp_path):
    """MXFP4 is read for GPT-OSS's experts only; a backend without sinks is refused for a model with them."""
    from radixmesh.engine.attention.base import AttentionBackend, AttentionShape
    from tests.parity.test_model_families_more import _config_dir

    path = _config_dir(tmp_path, "LlamaConfig", quantization_config={"quant_method": "mxfp4"})
    _refused(path, "mxfp4", "GptOssForCausalLM's experts, not LlamaForCausalLM's")

    class NoSinks(AttentionBackend):
        name = "flashinfer"

        def plan(self, batch):
            return None

        def forward(self, *args):
            return None

    with pytest.raises(ValueError, match="has no attention sinks, which this model's layers use"):
        NoSinks(AttentionShape(4, 2, 16, 0.25, sinks=True), None, None)


# ---- MXFP4 (GPT-OSS as published: the experts in 4-bit codes with power-of-two group scales) ---------------------

@pytest.fixture(scope="module")
def mxfp4_pair(checkpoint, tmp_path_factory) -> tuple[str, str]:
    """(the MXFP4 checkpoint our writer makes of `checkpoint`, its dequantized float32 twin)."""
    from radixmesh.engine.quantization import mxfp4

    root = tmp_path_factory.mktemp("mxfp4")
    q = mxfp4.write_checkpoint(checkpoint, str(root / "mxfp4"))
    return q, mxfp4.dequantized_checkpoint(q, str(root / "twin"))


def test_mxfp4_dequantizes_as_transformers_does():
    """Our dequantization equals transformers' (integrations.mxfp4) bit for bit on random codes and scales, and our
    writer's codes dequantize back within each group's rounding (half the widest gap between codes, 2, times its
    scale, which is at most a third of its largest magnitude)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from radixmesh.engine.quantization import mxfp4

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 135, (3, 40, 2), generator=gen, dtype=torch.uint8)
    ours = mxfp4.dequantize(blocks, scales).transpose(1, 2)  # [experts, in, out]: the bf16 layout
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))
    w = torch.randn(3, 40, 64, generator=gen) * 0.2
    back = mxfp4.dequantize(*mxfp4.quantize(w), dtype=torch.float32)
    scale = w.reshape(3, 40, 2, 32).abs().amax(-1, keepdim=True) / 3  # each group's scale, at most
    assert ((back - w).reshape(3, 40, 2, 32).abs() <= scale + 1e-7).all()


def test_an_mxfp4_checkpoint_matches_its_dequantized_twin(mxfp4_pair):
    """The experts dequantized at load: token-exact with transformers on the twin, logprobs within 1e-4; over two
    ranks the codes are cut by experts (EP) or by output rows (TP) before they are dequantized."""
    q, twin = mxfp4_pair
    _check(q, reference=twin)
    _check(q, reference=twin, atol=1e-5, tp_size=2)
    _check(q, reference=twin, atol=1e-5, tp_size=2, ep_size=2)


def test_an_mxfp4_checkpoint_is_held_in_mxfp4_on_the_kernels(mxfp4_pair):
    """On the Triton kernels (the interpreter here, a GPU's default) the experts stay MXFP4 as stored, their rows
    only reordered (kernels.moe_mxfp4 decodes them in registers: the grouped GEMMs of a prefill, the few-token
    launches of a lone request's decode): token-exact with transformers on the twin, logprobs within 1e-4; EP holds
    its whole experts so too. (A TP cut of 16 intermediate columns, half a group of 32, dequantizes as it reads:
    the test above.)"""
    q, twin = mxfp4_pair
    kernels = dict(attention_backend="triton", moe_runner_backend="triton")

    def held_in_mxfp4(llm):
        experts = [m for n, m in llm.runner.model.named_modules() if n.endswith("mlp.experts")]
        assert experts and all(m.w13.q.dtype == m.w2.s.dtype == torch.uint8 for m in experts)

    _check(q, reference=twin, inspect=held_in_mxfp4, **kernels)
    _check(q, reference=twin, atol=1e-5, tp_size=2, ep_size=2, inspect=held_in_mxfp4, **kernels)


def test_a_tensor_parallel_cut_on_whole_groups_holds_the_codes_as_cut(tmp_path_factory):
    """intermediate_size 64 over two ranks: each rank's 32 columns are whole groups of 32, so its rows of the
    interleaved gate/up codes and its groups of the down codes are read as stored and held in MXFP4 on the kernels
    (--quantization fp8 beside them: the attention in fp8, the experts as they are); token-exact with transformers on
    the twin."""
    from radixmesh.engine.quantization import mxfp4

    root = tmp_path_factory.mktemp("mxfp4_tp")
    q = mxfp4.write_checkpoint(write_gpt_oss(root / "float", seed=11, intermediate_size=64), str(root / "mxfp4"))
    twin = mxfp4.dequantized_checkpoint(q, str(root / "twin"))
    _check(q, reference=twin, atol=1e-5, tp_size=2, attention_backend="triton", moe_runner_backend="triton")
    with running_engine(q, skip_tokenizer_init=True, quantization="fp8", fp8_gemm_backend="triton",
                        moe_runner_backend="triton") as llm:
        experts = [m for n, m in llm.runner.model.named_modules() if n.endswith("mlp.experts")]
        out = llm.generate(input_ids=SHORT_PROMPTS[:1], sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert experts and all(m.w13.q.dtype == torch.uint8 for m in experts) and len(out[0]["output_ids"]) == 3


def test_without_kernels_the_mxfp4_experts_are_dequantized_once_after_the_load(mxfp4_pair, monkeypatch):
    """On CPU without Triton's interpreter (a user's CPU run) the codes loaded as stored become float experts once,
    after the load: the plain-torch experts read them, token-exact with transformers on the twin."""
    from radixmesh.engine.models import gpt_oss

    q, twin = mxfp4_pair
    monkeypatch.setattr(gpt_oss, "_interpreting", lambda: False)
    with running_engine(q, skip_tokenizer_init=True) as llm:
        experts = [m for n, m in llm.runner.model.named_modules() if n.endswith("mlp.experts")]
        out = llm.generate(input_ids=PROMPTS[1], sampling_params={**GREEDY, "max_new_tokens": 6})
    assert experts and all(m.w13.weight.dtype == torch.float32 and not hasattr(m.w13, "q") for m in experts)
    assert out["output_ids"] == hf_greedy(twin, [PROMPTS[1]], 6)[0]


def test_dummy_weights_of_an_mxfp4_config_are_mxfp4_and_the_roofline_counts_their_bytes(mxfp4_pair):
    """--load-format dummy (the benchmarks') on an MXFP4 config: random codes under scales of 2^-8, finite logprobs;
    a step reads 17/32 of a byte an expert weight (engine.bench_roofline)."""
    from radixmesh.engine.bench_roofline import _experts

    q, _ = mxfp4_pair
    with running_engine(q, skip_tokenizer_init=True, load_format="dummy", attention_backend="triton",
                        moe_runner_backend="triton") as llm:
        experts = [m for n, m in llm.runner.model.named_modules() if n.endswith("mlp.experts")]
        out = llm.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 3, "temperature": 0},
                           return_logprob=True)
        layers = _experts(llm.runner.model)
    assert all(bool((m.w13.s == 119).all()) and m.w13.q.float().std() > 50 for m in experts)
    assert all(torch.isfinite(torch.tensor(lp)) for lp, _, _ in out["meta_info"]["output_token_logprobs"])
    assert all(nbytes * 32 == elements * 17 for nbytes, elements, _, _ in layers)


def test_quantization_mxfp4_names_the_checkpoint_it_reads(checkpoint, mxfp4_pair):
    from radixmesh.engine.config import EngineArgs, resolve_args
    from radixmesh.engine.model_config import ModelConfig

    q, _ = mxfp4_pair
    assert resolve_args(EngineArgs(model_path=q, device="cpu", quantization="mxfp4"), ModelConfig.from_path(q))
    _refused(checkpoint, "quantization 'mxfp4' reads an MXFP4 checkpoint", quantization="mxfp4")


def test_online_fp8_keeps_the_experts_and_holds_the_attention_in_fp8(checkpoint):
    """--quantization fp8 on the kernels (interpreter): q/k/v and o held in fp8, the experts (whose biases and
    activation the fp8 expert kernels do not compute) in float32; it generates."""
    with running_engine(checkpoint, skip_tokenizer_init=True, quantization="fp8", fp8_gemm_backend="triton",
                        chunked_prefill_size=16) as llm:
        held = {n for n, m in llm.runner.model.named_modules() if getattr(m, "fp8", None) is not None}
        experts = [m for n, m in llm.runner.model.named_modules() if n.endswith("mlp.experts")]
        out = llm.generate(input_ids=SHORT_PROMPTS[:1], sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert held == {f"model.layers.{i}.self_attn.{p}" for i in range(4) for p in ("qkv_proj", "o_proj")}
    assert all(m.w13.weight.dtype == torch.float32 and m.extras is not None for m in experts)
    assert len(out[0]["output_ids"]) == 3


def test_ngram_speculative_decoding_keeps_gpt_oss_tokens(checkpoint):
    """Draft tokens verified as decode rows over the sinks and the window: the tokens plain decoding gives, on
    prompts whose continuations repeat (drafts proposed and kept)."""
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 5, 9, 5, 9, 5], list(range(20, 50))]
    greedy = {"max_new_tokens": 16, "temperature": 0}
    with running_engine(checkpoint, skip_tokenizer_init=True, speculative_algorithm="NGRAM") as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=greedy)
    assert [o["output_ids"] for o in outs] == hf_greedy(checkpoint, prompts, 16)
    assert sum(o["meta_info"]["spec_accept_token_num"] for o in outs) > 0
