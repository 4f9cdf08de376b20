"""Sliding windows and soft-caps on CUDA: the tiny windowed checkpoints (tests/sliding_models.py) through every
attention backend, with CUDA graphs (the window and the cap are constants of each layer's captured launches) and
without.

float32 (Triton, torch_native): transformers' greedy tokens and teacher-forced logprobs. bfloat16 (Triton, FlashInfer,
whose window_left and logits_soft_cap are planned per wrapper, one wrapper per window): each generated token's
logprob within bfloat16 noise of transformers' float32 teacher-forced one; a backend that ignored the window or a cap
would be off by several nats (tests/parity/test_sliding_window.py's test_the_features_matter)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.engine_utils import running_engine
from tests.reference import hf_greedy
from tests.sliding_models import BF16_BACKENDS, assert_bf16_noise, build, check_runs, logprob_errors, prompts

pytestmark = pytest.mark.gpu

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
KINDS = ("gemma2", "gemma3", "mistral", "qwen2")
GREEDY = {"max_new_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """head_dim 64: a size FlashInfer's kernels take (Qwen2's is hidden / heads = 16: not for FlashInfer)."""
    root = tmp_path_factory.mktemp("sliding-cuda")
    return {kind: build(kind, root / kind, head_dim=64) for kind in KINDS}


def _generate(path: str, dtype: str, **kwargs) -> list[dict]:
    with running_engine(path, device="cuda", skip_tokenizer_init=True, mem_fraction_static=0.3, page_size=16,
                        chunked_prefill_size=32, dtype=dtype, **kwargs) as llm:
        first = llm.generate(input_ids=prompts(), sampling_params=GREEDY, return_logprob=True)
        again = llm.generate(input_ids=prompts(), sampling_params=GREEDY, return_logprob=True)  # cached prefixes
    check_runs(path, first, again, dtype)
    return first


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend,graphs", [("triton", True), ("triton", False), ("torch_native", False)])
def test_float32_matches_transformers(checkpoints, kind, backend, graphs):
    path = checkpoints[kind]
    outs = _generate(path, dtype="float32", attention_backend=backend, disable_cuda_graph=not graphs)
    assert [o["output_ids"] for o in outs] == hf_greedy(path, prompts(), GREEDY["max_new_tokens"])
    assert max(logprob_errors(path, outs)) < 1e-3


@pytest.mark.parametrize("kind", ("gemma2", "gemma3", "mistral"))
@pytest.mark.parametrize("prefill,decode", BF16_BACKENDS)
@pytest.mark.parametrize("graphs", [True, False])
def test_bfloat16_within_noise_of_transformers(checkpoints, kind, prefill, decode, graphs):
    path = checkpoints[kind]
    _generate(path, dtype="bfloat16", attention_backend=prefill, decode_attention_backend=decode,
              disable_cuda_graph=not graphs)  # (both runs within noise: check_runs)


@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer")
def test_flashinfer_plans_one_wrapper_per_window(checkpoints):
    """Gemma 2's sliding and global layers run different wrappers, planned with window_left = window - 1 and -1."""
    with running_engine(checkpoints["gemma2"], device="cuda", dtype="bfloat16", skip_tokenizer_init=True,
                        mem_fraction_static=0.3, attention_backend="flashinfer", disable_cuda_graph=True) as llm:
        backend = llm.runner.attn_backend
        assert set(backend.decode_wrappers) == set(backend.prefill_wrappers) == {None, 12}
        planned = {}  # (mode, window) -> the plan's (window_left, logits_soft_cap): FlashInfer keeps neither public
        for mode, wrappers in (("decode", backend.decode_wrappers), ("prefill", backend.prefill_wrappers)):
            for window, wrapper in wrappers.items():
                def spy(*args, _plan=wrapper.plan, _key=(mode, window), **kwargs):
                    planned[_key] = (kwargs["window_left"], kwargs["logits_soft_cap"])
                    return _plan(*args, **kwargs)

                wrapper.plan = spy
        llm.generate(input_ids=prompts()[:2], sampling_params=GREEDY)
        assert planned == {("decode", 12): (11, 4.0), ("decode", None): (-1, 4.0),
                           ("prefill", 12): (11, 4.0), ("prefill", None): (-1, 4.0)}
    torch.cuda.synchronize()


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer")
def test_flashinfer_sliding_lists_hold_only_the_window(checkpoints, graphs):
    """Mistral (every layer slides over 12 tokens): the sliding wrappers' page lists hold at most window - 1 keys
    before each request's new tokens, whatever the request's length, while engine.cache.swa frees the pages behind the
    window; the outputs stay within bfloat16 noise of transformers."""
    path = checkpoints["mistral"]
    with running_engine(path, device="cuda", dtype="bfloat16", skip_tokenizer_init=True, mem_fraction_static=0.3,
                        page_size=16, chunked_prefill_size=32, attention_backend="flashinfer",
                        disable_cuda_graph=not graphs) as llm:
        backend, lists = llm.runner.attn_backend, []
        assert set(backend.decode_wrappers) == {12} and llm.cache.swa is not None
        build = backend._kv_indices

        def recorded(batch, window, out):
            indptr, indices = build(batch, window, out)
            new = [1] * batch.batch_size if batch.mode.name == "DECODE" else batch.extend_lens_host
            lists.append((window, (indptr[1:] - indptr[:-1]).tolist(), new, list(batch.seq_lens_host)))
            return indptr, indices

        backend._kv_indices = recorded
        # 40 new tokens: a request frees its own pages only (not the prompt's, in the radix tree), a page of 16
        # once it lies wholly behind the window (16 tokens free nothing: 2026-12-06, H100)
        outs = llm.generate(input_ids=prompts(), sampling_params={**GREEDY, "max_new_tokens": 40},
                            return_logprob=True)
        assert llm.cache.swa.freed_tokens > 0
    assert lists and all(w == 12 for w, _, _, _ in lists)
    for _, lens, new, seq in lists:
        assert all(n <= 11 + e and (n == s or n == 11 + e) for n, e, s in zip(lens, new, seq)), (lens, new, seq)
    assert any(s > n for _, lens, _, seq in lists for n, s in zip(lens, seq))  # some lists really are cut
    assert_bf16_noise(path, outs)
