"""KV exactness on a model whose attention is spread over the whole context.

The bundled tiny models look back only a few tokens, so a wrong key or value far back in a cached prefix barely
moves their outputs. This model (seeded random weights, small scale, so attention stays diffuse) lets every
position matter: each generated token's logprob must equal transformers' teacher-forced logprob within 1e-4,
whatever path (cache hit, chunk, page size, retraction) produced the KV. Near-ties are irrelevant here because
the reference is teacher-forced on the engine's own tokens."""

from __future__ import annotations

import pytest
import torch

from tests.engine_utils import running_engine
from tests.parity.test_parity_cpu import CONFIGS
from tests.reference import hf_token_logprobs

VOCAB = 512


@pytest.fixture(scope="module")
def diffuse_model(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=None,
                      bos_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08 if "proj" in name else 1.0)
    path = tmp_path_factory.mktemp("diffuse") / "tiny-diffuse-llama"
    model.save_pretrained(path)
    return str(path)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(0, VOCAB, (150,), generator=gen).tolist()
    return [shared + torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 20, 71)] + [
        torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 200)]


def check(path: str, outs: list[dict], inputs: list[list[int]]) -> None:
    for out, prompt in zip(outs, inputs):
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(hf_token_logprobs(path, prompt, out["output_ids"]), abs=1e-4)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_logprobs_match_teacher_forced_reference(diffuse_model, cfg):
    inputs = prompts()
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    with running_engine(diffuse_model, skip_tokenizer_init=True, **cfg) as llm:
        for _ in range(2):  # the second pass runs on cached prefixes when the cache is on
            check(diffuse_model, llm.generate(input_ids=inputs, sampling_params=params, return_logprob=True), inputs)


def test_logprobs_match_under_eviction_and_retraction(diffuse_model):
    inputs = prompts()
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    with running_engine(diffuse_model, skip_tokenizer_init=True, page_size=4, max_total_tokens=320,
                        chunked_prefill_size=32, schedule_conservativeness=0.05) as llm:
        llm.generate(input_ids=inputs[:2], sampling_params=params)
        check(diffuse_model, llm.generate(input_ids=inputs, sampling_params=params, return_logprob=True), inputs)
        stats = llm.get_server_info()["internal_states"][0]
        assert stats["retractions"] > 0 and stats["evicted_tokens"] > 0, stats
