"""RoPE scaling token-exact with transformers (float32, CPU): YaRN (its mscale, and mscale/mscale_all_dim, beta and
attention_factor fields), linear and dynamic NTK, each on a tiny random Llama or Qwen2 checkpoint written here by
transformers, with prompts past the original context (chunked prefill, so chunks start past it too). LongRoPE is
tested with Phi-3 (test_model_families.py), llama3 with the bundled tiny Llama (test_parity_cpu.py)."""

from __future__ import annotations

import pytest
import torch

from tests.engine_utils import running_engine
from tests.reference import hf_greedy, hf_token_logprobs

VOCAB, MAX_NEW, ORIGINAL, CONTEXT = 256, 16, 64, 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=CONTEXT, initializer_range=0.15, eos_token_id=VOCAB - 1,
              bos_token_id=1, tie_word_embeddings=False)
SCALINGS = {
    "yarn": ("LlamaConfig", "LlamaForCausalLM",
             {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}),
    "yarn-mscale": ("Qwen2Config", "Qwen2ForCausalLM",
                    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "mscale": 1.3,
                     "mscale_all_dim": 0.7, "beta_fast": 16, "beta_slow": 2}),
    "yarn-attention-factor": ("LlamaConfig", "LlamaForCausalLM",
                              {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                               "attention_factor": 1.25, "truncate": False}),
    "linear": ("LlamaConfig", "LlamaForCausalLM", {"rope_type": "linear", "factor": 3.0}),
    # up to max_position_embeddings dynamic NTK is plain RoPE (engine.layers.rope_scaling), and longer contexts refused
    "dynamic": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_type": "dynamic", "factor": 2.0}),
}


def prompts_for(name: str) -> list[list[int]]:
    """One short prompt and two past the original context (64 tokens), all ending well inside the 256 context."""
    gen = torch.Generator().manual_seed(len(name))
    return [[1] + torch.randint(2, VOCAB - 1, (n,), generator=gen).tolist() for n in (9, 100, 200)]


def write_scaled(path, config_cls: str, model_cls: str, rope: dict, seed: int) -> str:
    """A random transformers checkpoint of COMMON's shape with `rope` as its rope_scaling."""
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**COMMON, rope_scaling=rope)
    getattr(transformers, model_cls)(config).float().eval().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {name: write_scaled(tmp_path_factory.mktemp(name), *spec, seed=200 + i)
            for i, (name, spec) in enumerate(SCALINGS.items())}


@pytest.mark.parametrize("name", SCALINGS)
def test_rope_scaling_matches_transformers_past_the_original_context(checkpoints, name):
    path, prompts = checkpoints[name], prompts_for(name)
    refs = hf_greedy(path, prompts, MAX_NEW)
    logprobs = [hf_token_logprobs(path, p, r) for p, r in zip(prompts, refs)]
    assert len({tuple(r) for r in refs}) == len(refs), "the reference does not depend on the prompt"
    with running_engine(path, skip_tokenizer_init=True, chunked_prefill_size=48, page_size=4) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0},
                            return_logprob=True)
    assert [o["output_ids"] for o in outs] == refs
    for out, want in zip(outs, logprobs):
        assert [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] == pytest.approx(want, abs=1e-4)


def test_dynamic_ntk_past_max_position_embeddings_is_refused(checkpoints):
    from radixmesh.engine.config import EngineArgs, resolve_args
    from radixmesh.engine.model_config import ModelConfig

    path = checkpoints["dynamic"]
    with pytest.raises(ValueError, match="dynamic NTK RoPE") as err:
        resolve_args(EngineArgs(model_path=path, device="cpu", context_length=2 * CONTEXT),
                     ModelConfig.from_path(path))
    assert f"max_position_embeddings={CONTEXT}" in str(err.value)
    assert f"--context-length {CONTEXT} or less" in str(err.value)
