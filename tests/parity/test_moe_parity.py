"""Mixture-of-experts models token-exact with transformers (float32, CPU): Mixtral, Qwen2-MoE (shared expert, sparse
every other layer), Qwen3-MoE (a dense layer in mlp_only_layers) and OLMoE (q/k norms over the whole projection, with
and without clip_qkv), each a tiny random checkpoint written here by
transformers itself (per-expert tensors, as published), through the public Engine API, with tensor parallelism too.
Every generated token's logprob is compared as well: a wrong expert, weight or routing rule moves those far beyond
the tolerance even where the greedy choice survives."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.engine_utils import running_engine
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
}
PROMPTS = [[1, 17, 42, 99, 3], [1] + list(range(20, 60)), [1, 200, 201, 5, 5, 5, 7, 9, 11, 250, 30, 31, 32]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    import transformers

    out = {}
    for name, (config_cls, model_cls, fields) in FAMILIES.items():
        torch.manual_seed(hash(name) % 1000)
        config = getattr(transformers, config_cls)(**COMMON, **fields)
        model = getattr(transformers, model_cls)(config).float().eval()
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = str(path)
    return out


@functools.cache
def _reference(path: str) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy outputs of PROMPTS and their teacher-forced logprobs (once per checkpoint)."""
    refs = hf_greedy(path, PROMPTS, MAX_NEW)
    return refs, [hf_token_logprobs(path, p, r) for p, r in zip(PROMPTS, refs)]


@pytest.mark.parametrize("name", FAMILIES)
def test_moe_models_match_transformers(checkpoints, name):
    refs, logprobs = _reference(checkpoints[name])
    assert len({tuple(r) for r in refs}) == len(refs), "the reference does not depend on the prompt"
    with running_engine(checkpoints[name], skip_tokenizer_init=True, chunked_prefill_size=16, page_size=4) as llm:
        outs = llm.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0},
                            return_logprob=True)
    assert [o["output_ids"] for o in outs] == refs
    for out, want in zip(outs, logprobs):
        assert [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("name", ["qwen2_moe", "olmoe_clipped"])
def test_experts_shard_over_tensor_parallel_ranks(checkpoints, name):
    """tp_size 2: each rank holds half of every expert's (and the shared expert's) intermediate rows; the sum over
    the ranks is the layer's output (OLMoE: each rank's q/k norm sums the mean square over both ranks' heads)."""
    path = checkpoints[name]
    refs, _ = _reference(path)
    with running_engine(path, skip_tokenizer_init=True, tp_size=2) as llm:
        outs = llm.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0})
    assert [o["output_ids"] for o in outs] == refs


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_expert_parallel_ranks_hold_whole_experts(checkpoints, name):
    """ep_size 2 (= tp_size): each rank holds half of the experts, whole, and skips the others' tensors at load;
    every rank sees every token and the sum over the ranks is the layer's output: token-exact, logprobs within
    1e-5 (the ranks' partial sums add in another order)."""
    path = checkpoints[name]
    refs, logprobs = _reference(path)
    with running_engine(path, skip_tokenizer_init=True, tp_size=2, ep_size=2) as llm:
        outs = llm.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0},
                            return_logprob=True)
    assert [o["output_ids"] for o in outs] == refs
    for out, want in zip(outs, logprobs):
        assert [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] == pytest.approx(want, abs=1e-5)


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
    assert [o["output_ids"] for o in outs] == refs
    for out, want in zip(outs, logprobs):
        assert [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] == pytest.approx(want, abs=1e-4)
    forwarded = sum(len(p) + len(o["output_ids"]) - 1 for p, o in zip(PROMPTS, outs))  # the last is sampled only
    assert len(dist["tokens"]) == 2 and all(sum(row) == 3 * forwarded for row in dist["tokens"]), dist
