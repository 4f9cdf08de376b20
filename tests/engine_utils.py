"""Helpers for tests that drive an Engine: construction with test defaults and the KV leak check."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch

from radixmesh.engine import Engine


@contextlib.contextmanager
def running_engine(path: str, **kwargs):
    """An Engine on CPU/float32 (unless overridden) that is leak-checked and shut down on exit."""
    opts = {"device": "cpu", "dtype": "float32", "random_seed": 0, "log_level": "warning", **kwargs}
    llm = Engine(model_path=path, **opts)
    try:
        yield llm
        assert_no_leak(llm)
    finally:
        llm.shutdown()


def assert_no_leak(llm: Engine) -> None:
    assert llm.flush_cache() is True
    info = llm.get_server_info()
    whole = info["max_total_num_tokens"]
    hybrid = llm.cache.hybrid  # a hybrid SWA pool (engine.cache.swa_pool): its pages all back too
    if hybrid is not None:
        hybrid.check([])
        whole = min(whole, hybrid.swa.num_pages * llm.cache.page)
    assert info["available_kv_tokens"] == whole, info
    free = llm.cache.pages.free_pages()
    assert len(set(free.tolist())) == len(free), "a page is on the free list twice"


def vocab_size(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["vocab_size"]


def parity_prompts(path: str, seed: int = 0) -> list[list[int]]:
    """Nine prompts of different lengths: three share a 120-token prefix, two share a 250-token prefix, and the
    longest (300 tokens) is longer than the 64-token prefill chunk the tests use."""
    gen = torch.Generator().manual_seed(seed)
    low, high = 16, vocab_size(path) - 16  # stay clear of special tokens at either end

    def rand(n: int) -> list[int]:
        return torch.randint(low, high, (n,), generator=gen).tolist()

    shared, long = rand(120), rand(300)
    return [rand(3), rand(11), rand(29), rand(57), shared + rand(5), shared + rand(13), shared + rand(40), long,
            long[:250] + rand(7)]


def converse(llm: Engine, plain: Engine, convs: list[list[int]], sp: dict, rng, rounds: int = 3,
             vocab: int = 200) -> None:
    """Conversations turn by turn: each turn sends the conversation so far (previous turns, answers and 8 new tokens)
    to `llm`; its output must equal `plain`'s (an engine without a prefix cache), and from the second turn on its
    cached tokens must cover every token the turn before computed (all but the answer's last one)."""
    for round_ in range(rounds):
        for i, conv in enumerate(convs):
            out = llm.generate(input_ids=conv, sampling_params=sp)
            assert out["output_ids"] == plain.generate(input_ids=conv, sampling_params=sp)["output_ids"]
            if round_:
                assert out["meta_info"]["cached_tokens"] == len(conv) - 1 - 8, (round_, i)
            convs[i] = conv + out["output_ids"] + [rng.randrange(5, vocab) for _ in range(8)]


def greedy_like_transformers(llm: Engine, path: str, prompts: list[list[int]], max_new: int,
                             logprob_tol: float = 1e-3) -> list[dict]:
    """The engine's greedy outputs for `prompts` (token ids), with their logprobs; asserts their tokens are
    transformers' float32 greedy continuation and each logprob within `logprob_tol` of its teacher-forced one."""
    from tests.reference import hf_greedy, hf_token_logprobs

    refs = hf_greedy(path, prompts, max_new)
    outs = llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": max_new, "temperature": 0},
                        return_logprob=True)
    assert [o["output_ids"] for o in outs] == refs
    for p, out, ref in zip(prompts, outs, refs):
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(hf_token_logprobs(path, p, ref), abs=logprob_tol)
    return outs


def force_rotary_kernel(monkeypatch) -> list:
    """engine.layers.rotary takes kernels.rotary's path, as where use_kernels holds (here in Triton's interpreter);
    returns the list each of the kernel's launches appends its q/k norm (None or a kernels.rotary.QKNorm tuple) to."""
    from radixmesh.engine.layers import rotary
    from radixmesh.kernels import rotary as rotary_kernels

    launches = []
    kernel = rotary_kernels.apply_rotary
    monkeypatch.setattr(rotary, "use_kernels", lambda t: True)
    monkeypatch.setattr(rotary_kernels, "apply_rotary",
                        lambda *a, qk_norm=None, **k: launches.append(qk_norm) or kernel(*a, qk_norm=qk_norm, **k))
    return launches
