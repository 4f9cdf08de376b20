"""Phi-3 (LongRoPE, and a sliding window), OLMo 2 and Granite token-exact with transformers (float32, CPU), each a tiny
random checkpoint written here by transformers itself (Phi-3's fused qkv_proj and gate_up_proj tensors as published),
with its norm weights drawn away from 1 so that every weight shows: every generated token's logprob is compared too,
and a weight read from the wrong rows, a norm over the wrong span or a missing multiplier moves those far beyond the
tolerance."""

from __future__ import annotations

import pytest
import torch

from tests.engine_utils import running_engine
from tests.reference import hf_greedy, hf_token_logprobs

VOCAB, MAX_NEW, ORIGINAL = 256, 16, 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15, eos_token_id=VOCAB - 1,
              bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.15 * i for i in range(8)],
            "long_factor": [4.0 + 2.0 * i for i in range(8)]}
FAMILIES = {
    # LongRoPE with its attention factor sqrt(1 + ln(512 / 128) / ln(128)), served up to the original context
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(original_max_position_embeddings=ORIGINAL, rope_scaling=LONGROPE)),
    # every layer slides over 24 tokens (the prompts and outputs are longer): the attention backends' windows
    "phi3-window": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=24)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(embedding_multiplier=6.0, residual_multiplier=0.4, attention_multiplier=0.05, logits_scaling=3.0,
                     attention_bias=True, tie_word_embeddings=True)),  # Granite 3 ties its output layer
}
SERVE = {"phi3": dict(context_length=ORIGINAL)}
PROMPTS = [[1, 17, 42, 99, 3], [1] + list(range(20, 60)), [1, 200, 201, 5, 5, 5, 7, 9, 11, 250, 30, 31, 32]]
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}


def write_checkpoint(path, config_cls: str, model_cls: str, fields: dict, seed: int) -> str:
    """A random transformers checkpoint of COMMON's shape with `fields`, its norm weights drawn from [0.5, 1.5)."""
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **fields})
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {name: write_checkpoint(tmp_path_factory.mktemp(name), *spec, seed=100 + i)
            for i, (name, spec) in enumerate(FAMILIES.items())}


def _reference(path: str) -> tuple[list[list[int]], list[list[float]]]:
    refs = hf_greedy(path, PROMPTS, MAX_NEW)
    return refs, [hf_token_logprobs(path, p, r) for p, r in zip(PROMPTS, refs)]


def _assert_matches(outs: list[dict], refs: list[list[int]], logprobs: list[list[float]], atol: float) -> None:
    assert [o["output_ids"] for o in outs] == refs
    for out, want in zip(outs, logprobs):
        assert [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] == pytest.approx(want, abs=atol)


@pytest.mark.parametrize("name", FAMILIES)
def test_families_match_transformers(checkpoints, name):
    refs, logprobs = _reference(checkpoints[name])
    assert len({tuple(r) for r in refs}) == len(refs), "the reference does not depend on the prompt"
    with running_engine(checkpoints[name], skip_tokenizer_init=True, chunked_prefill_size=16, page_size=4,
                        **SERVE.get(name, {})) as llm:
        outs = llm.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    _assert_matches(outs, refs, logprobs, 1e-4)


@pytest.mark.parametrize("name", ["phi3", "olmo2"])
def test_families_shard_over_tensor_parallel_ranks(checkpoints, name):
    """tp_size 2: Phi-3's ranks each read their heads' rows of the fused qkv_proj (three runs of one tensor) and
    their gate and up rows of gate_up_proj; OLMo 2's their share of the q/k norm weights, the mean square summed
    over the ranks. Token-exact, logprobs within 1e-5 (partial sums add in another order)."""
    refs, logprobs = _reference(checkpoints[name])
    with running_engine(checkpoints[name], skip_tokenizer_init=True, tp_size=2, **SERVE.get(name, {})) as llm:
        outs = llm.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    _assert_matches(outs, refs, logprobs, 1e-5)


def test_olmo2_norms_in_kernels_match_transformers(checkpoints, monkeypatch):
    """OLMo 2's norms as on CUDA (kernels.norm.olmo2_rmsnorm over the whole q and k projections, olmo2_post_add
    between sublayers), forced here in Triton's interpreter: transformers' tokens, logprobs within 1e-4."""
    from radixmesh.engine.models import olmo2
    from radixmesh.kernels import norm

    launches, post_add = [], norm.olmo2_post_add
    monkeypatch.setattr(olmo2, "use_kernels", lambda t: True)
    monkeypatch.setattr(norm, "olmo2_post_add", lambda *a: launches.append(1) or post_add(*a))
    refs, logprobs = _reference(checkpoints["olmo2"])
    with running_engine(checkpoints["olmo2"], skip_tokenizer_init=True, chunked_prefill_size=16, page_size=4) as llm:
        outs = llm.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    _assert_matches(outs, refs, logprobs, 1e-4)
    assert launches


def test_phi3_window_changes_the_outputs(checkpoints, tmp_path):
    """The same weights without the window answer otherwise: the parity above rests on the window."""
    seed = 100 + list(FAMILIES).index("phi3-window")
    plain = write_checkpoint(tmp_path, "Phi3Config", "Phi3ForCausalLM", {}, seed=seed)
    assert _reference(plain)[1] != _reference(checkpoints["phi3-window"])[1]


def test_phi3_longrope_past_the_original_context_uses_long_factor(checkpoints, caplog):
    """Served past its original context, LongRoPE rotates every position with long_factor and says so at start-up
    (tests/parity/test_longrope_long_context.py: token-exact with transformers for prompts past it)."""
    from radixmesh.engine.config import EngineArgs, resolve_args
    from radixmesh.engine.model_config import ModelConfig

    path = checkpoints["phi3"]
    with caplog.at_level("WARNING"):
        resolve_args(EngineArgs(model_path=path, device="cpu"), ModelConfig.from_path(path))
    assert f"original_max_position_embeddings={ORIGINAL}" in caplog.text
    assert "--context-length 128 or less" in caplog.text
