"""--enable-deterministic-inference (engine.batch_invariant): a request's tokens and logprobs, bit for bit, whatever
runs beside it, wherever its prefix's KV came from, and whether its tokens were decoded or prefilled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixmesh.engine import Engine
from radixmesh.engine.batch_invariant import row_products
from tests import sliding_models
from tests.conftest import model_path
from tests.engine_utils import running_engine
from tests.parity.test_deepseek_parity import write_family
from tests.parity.test_gpt_oss_parity import write_gpt_oss

NEW = 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_product_gives_a_row_the_bits_it_has_alone(dtype):
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 200, generator=gen).to(dtype), torch.randn(96, generator=gen).to(dtype)
    per_head = torch.randn(3, 200, 40, generator=gen).to(dtype)
    x = torch.randn(33, 200, generator=gen).to(dtype)
    products = {  # each: rows [m, 200] -> its result with the rows first
        "linear": lambda t: F.linear(t, w, b), "matmul": lambda t: t @ w.t(), "mm": lambda t: torch.mm(t, w.t()),
        "addmm": lambda t: torch.addmm(b, t, w.t()), "vector": lambda t: t @ w[0],
        "broadcast": lambda t: torch.matmul(t[None].expand(3, -1, -1), w.t()).transpose(0, 1),
        "per head": lambda t: torch.matmul(t[None], per_head).transpose(0, 1),
        "bmm": lambda t: torch.bmm(t[None].expand(2, -1, -1), w.t()[None].expand(2, -1, -1)).transpose(0, 1),
        # elementwise functions on exp over contiguous rows of 8 and 24 (outside the mode, sigmoid's and SiLU's rows
        # take the scalar path alone and the vector one beside others: 13 and 28 of the rows here differ)
        "sigmoid": lambda t: torch.sigmoid(t[:, :8].contiguous()), "silu": lambda t: F.silu(t[:, :24].contiguous()),
        "tanh": lambda t: t[:, :8].contiguous().tanh(), "exp": lambda t: torch.exp(t[:, :8].contiguous() * 0.1)}
    for name, product in products.items():
        with row_products(True):
            alone = [product(x[i:i + 1])[0] for i in range(len(x))]
            for m in (2, 3, 4, 7, 33):
                rows = product(x[:m])
                assert all(torch.equal(rows[i], alone[i]) for i in range(m)), (name, m)
            got = product(x)
        assert torch.allclose(got.float(), product(x).float(), rtol=2e-2, atol=5e-2), name  # (the plain product)


def test_paths_the_rows_do_not_cover_raise():
    x = torch.randn(4, 8)
    with row_products(True):
        with pytest.raises(RuntimeError, match="einsum ran under --enable-deterministic-inference"):
            torch.einsum("ij,kj->ik", x, x)
        with pytest.raises(RuntimeError, match="scaled_dot_product_attention"):
            F.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None])
    assert torch.einsum("ij,kj->ik", x, x).shape == (4, 4)  # the mode ends with its context


def _prompt(vocab: int, seed: int, n: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _logprobs(out: dict) -> list[tuple]:
    return [tuple(x[:2]) for x in out["meta_info"]["output_token_logprobs"]]


def _check_invariance(llm: Engine, vocab: int) -> None:
    target = _prompt(vocab, 1, 21)
    sampled = {"temperature": 0.8, "sampling_seed": 16, "max_new_tokens": NEW, "ignore_eos": True}
    first = llm.generate(input_ids=[target], sampling_params=sampled, return_logprob=True)
    want = (first[0]["output_ids"], _logprobs(first[0]))
    assert first[0]["meta_info"]["cached_tokens"] == 0
    # beside others of other lengths, which start and end around it (decode batches of every size), its prompt cached
    for others in (1, 3, 6):
        ids = [target] + [_prompt(vocab, 10 + j, 5 + 7 * j) for j in range(others)]
        params = [sampled] + [{"temperature": 0, "max_new_tokens": 2 + 3 * j, "ignore_eos": True}
                              for j in range(others)]
        out = llm.generate(input_ids=ids, sampling_params=params, return_logprob=True)[0]
        assert (out["output_ids"], _logprobs(out)) == want, f"beside {others} others"
    # its first 13 tokens' KV computed for another prompt, the rest for it
    assert llm.flush_cache()
    llm.generate(input_ids=[target[:13] + _prompt(vocab, 3, 9)], sampling_params={"max_new_tokens": 1})
    out = llm.generate(input_ids=[target], sampling_params=sampled, return_logprob=True)[0]
    assert out["meta_info"]["cached_tokens"] >= 13
    assert (out["output_ids"], _logprobs(out)) == want, "over a prefix computed for another prompt"
    # greedy tokens' logprobs from their decode steps equal those of a prefill over them (a migration's recompute)
    assert llm.flush_cache()
    greedy = llm.generate(input_ids=[target], return_logprob=True,
                          sampling_params={"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True})[0]
    assert llm.flush_cache()
    again = llm.generate(input_ids=[target + greedy["output_ids"]], return_logprob=True,
                         logprob_start_len=len(target), sampling_params={"max_new_tokens": 1})[0]
    prefilled = [tuple(x[:2]) for x in again["meta_info"]["input_token_logprobs"]]
    assert prefilled[:NEW] == _logprobs(greedy)


CASES = {"llama, float32": lambda tmp: (model_path("tiny-llama"), {}),
         "llama over two tensor-parallel ranks": lambda tmp: (model_path("tiny-llama"), {"tp_size": 2}),
         "qwen3-moe": lambda tmp: (model_path("tiny-qwen3-moe"), {}),
         "gpt-oss: window, sinks, biased experts": lambda tmp: (write_gpt_oss(tmp), {"skip_tokenizer_init": True}),
         "gemma2: window, soft-caps": lambda tmp: (sliding_models.build("gemma2", tmp), {"skip_tokenizer_init": True}),
         # latent attention; a sigmoid router over 8 experts (a row of 8 takes exp's scalar path alone, its vector
         # path beside other rows: the elementwise functions run a row at a time under the flag)
         "deepseek-v3: latent attention, grouped sigmoid routing": lambda tmp: (write_family("deepseek_v3", tmp),
                                                                                 {"skip_tokenizer_init": True})}


@pytest.mark.parametrize("case", list(CASES))
def test_a_request_has_the_same_bits_in_any_batch_and_over_any_prefix(case, tmp_path):
    path, extra = CASES[case](tmp_path)
    with running_engine(path, enable_deterministic_inference=True, **extra) as llm:
        _check_invariance(llm, llm.model_config.vocab_size)


def test_prompts_prefilled_in_chunks_give_the_bits_of_one_prefill():
    """Another engine prefilling in 8-token chunks: the same tokens and logprobs for the same request, bit for bit."""
    target = _prompt(256, 5, 29)
    sampled = {"temperature": 0.8, "sampling_seed": 3, "max_new_tokens": NEW, "ignore_eos": True}
    outs = []
    for chunk in (None, 8):
        with running_engine(model_path("tiny-llama"), enable_deterministic_inference=True,
                            **({"chunked_prefill_size": chunk} if chunk else {})) as llm:
            out = llm.generate(input_ids=[target], sampling_params=sampled, return_logprob=True,
                               logprob_start_len=1)[0]
            outs.append((out["output_ids"], _logprobs(out), out["meta_info"]["input_token_logprobs"]))
    assert outs[0] == outs[1]


def test_unseeded_samples_draw_as_if_seeded_with_the_random_seed():
    target = _prompt(256, 2, 15)
    free = {"temperature": 1.0, "max_new_tokens": NEW, "ignore_eos": True}
    with running_engine(model_path("tiny-llama"), enable_deterministic_inference=True, random_seed=7) as llm:
        alone = llm.generate(input_ids=[target], sampling_params=free)[0]["output_ids"]
        pair = llm.generate(input_ids=[target, _prompt(256, 4, 30)], sampling_params={**free, "n": 2})
        seeded = llm.generate(input_ids=[target], sampling_params={**free, "sampling_seed": 7})[0]["output_ids"]
    assert alone == pair[0]["output_ids"] == seeded  # sample 0 of n draws with the seed itself
    assert pair[1]["output_ids"] != alone  # sample 1 with seed + 1


@pytest.mark.parametrize("kwargs, words", [
    ({"device": "cuda"}, "runs on CPU only so far"),
    ({"speculative_algorithm": "NGRAM"}, "does not cover speculative decoding"),
    ({"attention_backend": "triton"}, "runs attention on the torch_native backend")])
def test_what_it_does_not_cover_is_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Engine(model_path=model_path("tiny-llama"), enable_deterministic_inference=True, log_level="warning",
               **kwargs)
