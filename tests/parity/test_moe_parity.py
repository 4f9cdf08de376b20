"""Mixture-of-experts models token-exact with transformers (float32, CPU): Mixtral, Qwen2-MoE (shared expert, sparse
every other layer), Qwen3-MoE (a dense layer in mlp_only_layers) and OLMoE (q/k norms over the whole projection, with
and without clip_qkv), each a tiny random checkpoint written here by
transformers itself (per-expert tensors, as published), through the public Engine API, with tensor parallelism too.
Every generated token's logprob is compared as well: a wrong expert, weight or routing rule moves those far beyond
the tolerance even where the greedy choice survives."""

from __future__ import annotations

import functools
import zlib

import pytest
import torch

from tests.engine_utils import force_rotary_kernel, running_engine
from tests.reference import hf_greedy, hf_token_logprobs

VOCAB, MAX_NEW = 256, 16
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, initializer_range=0.15, eos_token_id=VOCAB - 1, bos_token_id=1,
              tie_word_embeddings=False)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=96, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=80, num_hidden_layers=4, num_experts=6, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=True,
                       decoder_sparse_step=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=80, num_hidden_layers=3, num_experts=8, num_experts_per_tok=3,
                       moe_intermediate_size=32, head_dim=16, norm_topk_prob=False, mlp_only_layers=[1])),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=32, num_hidden_layers=2, num_experts=6, num_experts_per_tok=2,
                   norm_topk_prob=False)),
    "olmoe_clipped": ("OlmoeConfig", "OlmoeForCausalLM",  # clip_qkv: a bound the normed q and k pass
                      dict(intermediate_size=32, num_hidden_layers=2, num_experts=6, num_experts_per_tok=3,
                           norm_topk_prob=True, clip_qkv=0.8)),
    # GLM-4.5: group-limited sigmoid routing with a correction bias (set random below: transformers starts it at
    # zero), a scaling factor, an ungated shared expert, a first dense layer, q/k/v biases and half-rotary heads
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(intermediate_size=80, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=3,
                      moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                      routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True)),
    # GLM-4.5's own shape of the rule: one group (every expert competes), q/k norms, no renormalization
    "glm4_moe_qk_norm": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                         dict(intermediate_size=80, num_hidden_layers=2, n_routed_experts=6, num_experts_per_tok=2,
                              moe_intermediate_size=32, n_shared_experts=2, n_group=1, topk_group=1,
                              first_k_dense_replace=0, norm_topk_prob=False, use_qk_norm=True)),
    # MiniMax-M2: sigmoid routing with the block's bias, Mixtral's expert names, OLMoE's whole-projection q/k norms,
    # RoPE on a quarter of each head (rotary_dim; said as partial_rotary_factor too, which transformers before 5.25
    # needs: it rotates whole heads when a config says only rotary_dim)
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM",
                   dict(intermediate_size=32, num_hidden_layers=2, num_local_experts=6, num_experts_per_tok=2,
                        head_dim=16, rotary_dim=4,
                        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.25})),
    # dots.llm1: Qwen3's attention (with biases here) over GLM-4.5's routing and shared experts; its last layer slides
    # over 6 tokens (max_window_layers), so the prompts' later tokens see only their window there
    "dots1": ("Dots1Config", "Dots1ForCausalLM",
              dict(intermediate_size=80, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=32, n_shared_experts=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                   routed_scaling_factor=2.0, norm_topk_prob=True, attention_bias=True, head_dim=16,
                   sliding_window=6, max_window_layers=2)),
    # ERNIE 4.5 MoE: softmax scores plus moe_statics' bias choose the experts, weights over max(sum, moe_norm_min),
    # shared experts, a dense first layer (moe_layer_start_index), interleaved RoPE in float32
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                     dict(intermediate_size=80, num_hidden_layers=3, moe_num_experts=8, moe_k=3,
                          moe_intermediate_size=32, moe_num_shared_experts=1, moe_layer_start_index=1, head_dim=16)),
}
PROMPTS = [[1, 17, 42, 99, 3], [1] + list(range(20, 60)), [1, 200, 201, 5, 5, 5, 7, 9, 11, 250, 30, 31, 32]]


def write_family(name: str, path) -> str:
    """FAMILIES[name]'s tiny random checkpoint, written by transformers into `path` (float32)."""
    import transformers

    config_cls, model_cls, fields = FAMILIES[name]
    torch.manual_seed(zlib.crc32(name.encode()) % 1000)  # (not hash(): a seed every run shares)
    config = getattr(transformers, config_cls)(**COMMON, **fields)
    model = getattr(transformers, model_cls)(config).float().eval()
    # the routing biases (GLM-4.5's buffers, ERNIE's parameters): not zero, so they are exercised
    for bias_name, bias in [*model.named_buffers(), *model.named_parameters()]:
        if bias_name.endswith("e_score_correction_bias"):
            with torch.no_grad():
                bias.copy_((0.02 if name.startswith("ernie") else 0.3) * torch.randn_like(bias))
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {name: write_family(name, tmp_path_factory.mktemp(name)) for name in FAMILIES}


@functools.cache
def _reference(path: str) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy outputs of PROMPTS and their teacher-forced logprobs (once per checkpoint)."""
    refs = hf_greedy(path, PROMPTS, MAX_NEW)
    return refs, [hf_token_logprobs(path, p, r) for p, r in zip(PROMPTS, refs)]


def assert_like_reference(outs: list[dict], refs: list[list[int]], logprobs: list[list[float]],
                          tol: float = 1e-4) -> None:
    """The engine's outputs are transformers' greedy tokens, each token's logprob within `tol` of its own."""
    assert [o["output_ids"] for o in outs] == refs
    for out, want in zip(outs, logprobs):
        assert [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] == pytest.approx(want, abs=tol)


@pytest.mark.parametrize("name", FAMILIES)
def test_moe_models_match_transformers(checkpoints, name):
    refs, logprobs = _reference(checkpoints[name])
    assert len({tuple(r) for r in refs}) == len(refs), "the reference does not depend on the prompt"
    with running_engine(checkpoints[name], skip_tokenizer_init=True, chunked_prefill_size=16, page_size=4) as llm:
        outs = llm.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0},
                            return_logprob=True)
    assert_like_reference(outs, refs, logprobs)


@pytest.mark.parametrize("name", ["qwen2_moe", "olmoe_clipped", "glm4_moe", "minimax_m2", "dots1", "ernie4_5_moe"])
def test_experts_shard_over_tensor_parallel_ranks(checkpoints, name):
    """tp_size 2: each rank holds half of every expert's (and the shared expert's) intermediate rows; the sum over
    the ranks is the layer's output (OLMoE, MiniMax-M2: each rank's q/k norm sums the mean square over both ranks'
    heads; GLM-4.5: every rank routes with the whole float32 router and its bias)."""
    path = checkpoints[name]
    refs, _ = _reference(path)
    with running_engine(path, skip_tokenizer_init=True, tp_size=2) as llm:
        outs = llm.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0})
    assert [o["output_ids"] for o in outs] == refs


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "glm4_moe"])
def test_expert_parallel_ranks_hold_whole_experts(checkpoints, name):
    """ep_size 2 (= tp_size): each rank holds half of the experts, whole, and skips the others' tensors at load;
    every rank sees every token and the sum over the ranks is the layer's output: token-exact, logprobs within
    1e-5 (the ranks' partial sums add in another order)."""
    path = checkpoints[name]
    refs, logprobs = _reference(path)
    with running_engine(path, skip_tokenizer_init=True, tp_size=2, ep_size=2) as llm:
        outs = llm.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0},
                            return_logprob=True)
    assert_like_reference(outs, refs, logprobs, tol=1e-5)


def test_expert_parallel_sizes_are_checked():
    from radixmesh.engine.config import EngineArgs, resolve_args
    from radixmesh.engine.model_config import ModelConfig
    from tests.conftest import model_path

    def resolve(name, **kw):
        path = model_path(name)
        return resolve_args(EngineArgs(model_path=path, device="cpu", **kw), ModelConfig.from_path(path))

    with pytest.raises(ValueError, match="ep_size must be 1 or tp_size"):
        resolve("tiny-qwen3-moe", tp_size=2, ep_size=4)
    with pytest.raises(ValueError, match="has no mixture-of-experts layers"):
        resolve("tiny-qwen3", tp_size=2, ep_size=2)
    with pytest.raises(ValueError, match="experts must be divisible by ep_size"):
        resolve("tiny-qwen3-moe", tp_size=8, ep_size=8)


def test_the_triton_moe_runner_matches_transformers_in_the_interpreter(checkpoints):
    """--moe-runner-backend triton: kernels.moe's grouped GEMMs (here in Triton's CPU interpreter) in the engine,
    and for decode batches of one token (three pairs over eight experts) kernels.moe_decode's few-token path instead:
    token-exact with transformers, logprobs within 1e-4; the expert counters count top_k experts per forwarded token
    on both paths."""
    import os

    from radixmesh.kernels.moe_decode import use_decode_path

    assert os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py: kernels run in the interpreter on CPU
    assert use_decode_path(1, 3, 8) and not use_decode_path(2, 3, 8)
    path = checkpoints["qwen3_moe"]
    new = MAX_NEW // 2  # (the interpreter runs every expert product of every step: the references' first tokens)
    refs, logprobs = ([r[:new] for r in got] for got in _reference(path))  # (greedy: the longer run begins so)
    params = {"max_new_tokens": new, "temperature": 0}
    # overlap scheduling off: a request stopping on EOS would forward the EOS too, a token `forwarded` leaves out
    with running_engine(path, skip_tokenizer_init=True, moe_runner_backend="triton", disable_radix_cache=True,
                        disable_overlap_schedule=True, enable_expert_distribution_metrics=True) as llm:
        outs = llm.generate(input_ids=PROMPTS[:1], sampling_params=params, return_logprob=True)  # decode: 1 token
        outs += llm.generate(input_ids=PROMPTS[1:], sampling_params=params, return_logprob=True)  # 2: grouped
        dist = llm.expert_distribution()
    assert_like_reference(outs, refs, logprobs)
    forwarded = sum(len(p) + len(o["output_ids"]) - 1 for p, o in zip(PROMPTS, outs))  # the last is sampled only
    assert len(dist["tokens"]) == 2 and all(sum(row) == 3 * forwarded for row in dist["tokens"]), dist


def test_glm_routing_in_one_launch_matches_transformers_in_the_interpreter(checkpoints):
    """--moe-runner-backend triton on GLM-4.5: kernels.moe.route_grouped (sigmoid, correction bias, groups, scaling
    in one launch, here in Triton's CPU interpreter) and the experts' kernels weighing in float32, a decode batch of one
    token on the few-token path: token-exact with transformers, logprobs within 1e-4."""
    path = checkpoints["glm4_moe"]
    new = MAX_NEW // 4  # (the interpreter runs every expert product of every step)
    refs, logprobs = ([r[:new] for r in got] for got in _reference(path))
    with running_engine(path, skip_tokenizer_init=True, moe_runner_backend="triton",
                        disable_radix_cache=True) as llm:
        outs = llm.generate(input_ids=PROMPTS[:2], sampling_params={"max_new_tokens": new, "temperature": 0},
                            return_logprob=True)
    assert_like_reference(outs, refs[:2], logprobs)


def test_partial_rotary_in_the_rotary_kernel_matches_transformers(checkpoints, monkeypatch):
    """GLM-4.5's half-rotary heads with its per-head q/k norms in the same launch, rotated by kernels.rotary, as on
    CUDA (here in Triton's interpreter): transformers' tokens and logprobs."""
    launches = force_rotary_kernel(monkeypatch)
    _serves_like_reference(checkpoints["glm4_moe_qk_norm"])
    assert launches and all(norm is not None for norm in launches)


@pytest.mark.parametrize("name", ["olmoe_clipped", "minimax_m2"])
def test_whole_projection_qk_norms_in_kernels_match_transformers(checkpoints, name, monkeypatch):
    """OLMoE's and MiniMax-M2's q/k norms over every head at once (Llama's numerics) in kernels.norm.rmsnorm, and
    their rotations (MiniMax-M2's quarter-rotary heads) in kernels.rotary, as on CUDA, forced here in Triton's
    interpreter: transformers' tokens and logprobs."""
    from radixmesh.engine.models import olmo2
    from radixmesh.kernels import norm

    launches, kernel = [], norm.rmsnorm
    monkeypatch.setattr(olmo2, "use_kernels", lambda t: True)
    monkeypatch.setattr(norm, "rmsnorm", lambda x, *a, **k: launches.append(x.shape[-1]) or kernel(x, *a, **k))
    rotations = force_rotary_kernel(monkeypatch)
    _serves_like_reference(checkpoints[name])
    assert launches and max(launches) > 16  # (whole projections, not heads)
    assert rotations and all(qk is None for qk in rotations)  # (normed before, not in the launch)


def test_qwen2_moe_gated_shared_expert_in_one_launch_matches_transformers(checkpoints, monkeypatch):
    """Qwen2-MoE's shared expert, gated by the sigmoid of its own one-row product, joined to the routed experts in
    kernels.moe_shared's one launch, as on CUDA (forced here in Triton's interpreter): transformers' tokens and
    logprobs."""
    from radixmesh.engine.models import moe
    from radixmesh.kernels import moe_shared

    launches, kernel = [], moe_shared.gated_shared_add
    monkeypatch.setattr(moe, "use_kernels", lambda t: True)
    monkeypatch.setattr(moe_shared, "gated_shared_add", lambda *a: launches.append(a[0].shape) or kernel(*a))
    _serves_like_reference(checkpoints["qwen2_moe"])
    assert launches


def _serves_like_reference(path: str) -> None:
    """PROMPTS served greedily from `path` (chunked prefill, pages of 4): transformers' tokens and logprobs."""
    refs, logprobs = _reference(path)
    with running_engine(path, skip_tokenizer_init=True, chunked_prefill_size=16, page_size=4) as llm:
        outs = llm.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0},
                            return_logprob=True)
    assert_like_reference(outs, refs, logprobs)


def _rewrite(src: str, dst, extra: dict[str, torch.Tensor], **config_fields) -> str:
    """A copy of the checkpoint at `src` with `extra` tensors added and config.json fields set."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(f"{src}/model.safetensors")
    save_file({**weights, **extra}, f"{dst}/model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **config_fields}))
    return str(dst)


def test_glm_multi_token_prediction_layers_are_skipped_and_nothing_else(checkpoints, tmp_path):
    """Published GLM-4.5 checkpoints hold num_nextn_predict_layers layers after the last decoder layer
    (model.layers.<num_hidden_layers>.*: eh_proj, enorm, hnorm, shared_head, a whole decoder layer): served without
    them, as transformers does; a tensor no layer has elsewhere is still refused."""
    path = checkpoints["glm4_moe"]
    mtp = {f"model.layers.3.{name}": torch.zeros(shape) for name, shape in [
        ("eh_proj.weight", (64, 128)), ("enorm.weight", (64,)), ("hnorm.weight", (64,)),
        ("shared_head.norm.weight", (64,)), ("self_attn.q_proj.weight", (64, 64)),
        ("mlp.experts.0.gate_proj.weight", (32, 64)), ("mlp.gate.e_score_correction_bias", (8,))]}
    with_mtp = _rewrite(path, tmp_path / "mtp", mtp, num_nextn_predict_layers=1)
    refs, logprobs = _reference(path)
    with running_engine(with_mtp, skip_tokenizer_init=True) as llm:
        out = llm.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0},
                           return_logprob=True)
    assert out["output_ids"] == refs[0]
    assert [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] == pytest.approx(logprobs[0], abs=1e-4)
    stray = _rewrite(path, tmp_path / "stray", {"model.layers.2.mlp.extra_proj.weight": torch.zeros(8, 64)})
    with pytest.raises(Exception, match="extra_proj"):
        with running_engine(stray, skip_tokenizer_init=True):
            pass


def test_glm_block_fp8_checkpoint_matches_its_dequantized_twin(checkpoints, tmp_path):
    """Our fp8 writer's block-wise GLM-4.5 (experts, shared expert, attention and dense MLP in fp8 with 16 x 32
    blocks; the float32 router and its bias left as they are, as GLM-4.5-FP8 publishes them) served on CPU, where
    it is dequantized at load: the dequantized twin's tokens, logprobs within 1e-5; and a per-channel one held in fp8
    on the Triton kernels against its twin."""
    from radixmesh.engine.quantization import fp8

    quantized = fp8.write_checkpoint(checkpoints["glm4_moe"], str(tmp_path / "fp8"), block=(16, 32))
    twin = fp8.dequantized_checkpoint(quantized, str(tmp_path / "twin"))
    want_ids, want_logprobs = _generate(twin, PROMPTS, 8)
    ids, logprobs = _generate(quantized, PROMPTS, 8)
    assert ids == want_ids and logprobs == pytest.approx(want_logprobs, abs=1e-5)
    # held in fp8 on the Triton kernels (the interpreter here), per channel (16-bit activations, so the products are
    # the dequantized weights'): the fp8 expert kernels weigh in float32 as GLM-4.5 does
    channel = fp8.write_checkpoint(checkpoints["glm4_moe"], str(tmp_path / "fp8-channel"))
    want_ids, want_logprobs = _generate(fp8.dequantized_checkpoint(channel, str(tmp_path / "channel-twin")),
                                        PROMPTS[:1], 4)
    ids, logprobs = _generate(channel, PROMPTS[:1], 4, fp8_gemm_backend="triton", moe_runner_backend="triton")
    assert ids == want_ids and logprobs == pytest.approx(want_logprobs, abs=1e-4)


def _generate(path: str, prompts: list[list[int]], n: int, **opts) -> tuple[list[int], list[float]]:
    """Each prompt's `n` greedy tokens and their logprobs, one list of each for all prompts."""
    with running_engine(path, skip_tokenizer_init=True, **opts) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": n, "temperature": 0},
                            return_logprob=True)
    pairs = [(t, lp) for o in outs for lp, t, _ in o["meta_info"]["output_token_logprobs"]]
    return [t for t, _ in pairs], [lp for _, lp in pairs]


@pytest.mark.parametrize("fields,words", [
    (dict(n_group=3), "n_group=3 groups"),  # 8 experts do not split into 3 groups
    (dict(n_group=2, topk_group=1, num_experts_per_tok=5), "topk_group=1"),  # one group of 4 cannot hold 5
    (dict(use_qk_norm=True), "q_norm"),  # the config says q/k norms, the checkpoint has none: missing tensors
])
def test_glm_configs_it_cannot_serve_are_refused(checkpoints, tmp_path, fields, words):
    bad = _rewrite(checkpoints["glm4_moe"], tmp_path / "bad", {}, **fields)
    with pytest.raises(Exception, match=words):
        with running_engine(bad, skip_tokenizer_init=True):
            pass


def test_minimax_m2_as_published_gives_partial_rotary_as_rotary_dim(checkpoints, tmp_path):
    """MiniMax-M2's published config.json says `rotary_dim` (no partial_rotary_factor; transformers 5 derives one from
    it): served from such a config, the same tokens and logprobs."""
    import json

    path = checkpoints["minimax_m2"]
    config = json.loads(open(f"{path}/config.json").read())
    rope = {k: v for k, v in config["rope_parameters"].items() if k != "partial_rotary_factor"}
    legacy = _rewrite(path, tmp_path / "legacy", {}, rope_parameters=rope)
    refs, logprobs = _reference(path)
    ids, got = _generate(legacy, PROMPTS, MAX_NEW)
    assert ids == [t for r in refs for t in r] and got == pytest.approx([lp for r in logprobs for lp in r], abs=1e-4)


@pytest.mark.parametrize("fields,words", [
    (dict(attn_type_list=[1, 0]), "lightning attention"), (dict(qk_norm_type="per_head"), "qk_norm_type"),
    (dict(use_routing_bias=False), "use_routing_bias"), (dict(shared_intermediate_size=64), "shared expert")])
def test_minimax_m2_fields_transformers_does_not_compute_are_refused(checkpoints, tmp_path, fields, words):
    bad = _rewrite(checkpoints["minimax_m2"], tmp_path / "bad", {}, **fields)
    with pytest.raises(Exception, match=words):
        with running_engine(bad, skip_tokenizer_init=True):
            pass
