"""Sliding-window attention and the Gemma families, token-exact with transformers in float32 on CPU.

The tiny checkpoints (tests/sliding_models.py: Gemma 2, Gemma 3, Mistral with a short window, Qwen2 with
use_sliding_window and max_window_layers) slide over 12 tokens, and the prompts run to 131 tokens: every decode step
and most prefill tokens sit past the window. Their attention is spread over the whole context, so each generated
token's logprob must equal transformers' teacher-forced one within 1e-4 whatever path produced the KV (prefix-cache
hits, prefill chunks shorter than the window, pages), and `test_the_features_matter` checks that dropping the window
(or Gemma 2's soft-caps) moves those logprobs far beyond that."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.engine_utils import force_rotary_kernel, running_engine
from tests.reference import hf_greedy, hf_token_logprobs
from tests.sliding_models import build, prompts

KINDS = ("gemma2", "gemma3", "mistral", "qwen2")
# 10 new tokens: the longer prompts decode past the window (12) from the start, and the 5-token one crosses it (its
# last two steps no longer see its first keys); the features still move logprobs far more than
# test_the_features_matter's 0.1 (already over the first 8 tokens: 1.96 to 30.8 nats, 0.53 for either soft-cap)
MAX_NEW = 10
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}
LOGPROB_ATOL = 1e-4
CONFIGS = [
    dict(chunked_prefill_size=16, page_size=1),  # chunks shorter than the window: it spans cached chunks
    dict(chunked_prefill_size=-1, page_size=4),
    dict(chunked_prefill_size=32, page_size=16, disable_radix_cache=True),
]
_refs: dict[str, tuple[list[list[int]], list[list[float]]]] = {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sliding")
    return {kind: build(kind, root / kind) for kind in KINDS}


def reference(path: str) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy outputs (generate, with its sliding-window cache) and their teacher-forced logprobs."""
    if path not in _refs:
        outs = hf_greedy(path, prompts(), MAX_NEW)
        _refs[path] = outs, [hf_token_logprobs(path, p, o) for p, o in zip(prompts(), outs)]
    return _refs[path]


def check(path: str, outs: list[dict]) -> None:
    want_ids, want_logprobs = reference(path)
    assert [o["output_ids"] for o in outs] == want_ids
    for out, want in zip(outs, want_logprobs):
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=LOGPROB_ATOL)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_parity(checkpoints, kind, cfg):
    path = checkpoints[kind]
    with running_engine(path, skip_tokenizer_init=True, **cfg) as llm:
        assert any(w is not None for w in llm.runner.attn_backend.shape.windows)
        check(path, llm.generate(input_ids=prompts(), sampling_params=GREEDY, return_logprob=True))
        again = llm.generate(input_ids=prompts(), sampling_params=GREEDY, return_logprob=True)
        check(path, again)
        if not cfg.get("disable_radix_cache"):
            assert sum(o["meta_info"]["cached_tokens"] for o in again) > 0


@pytest.mark.parametrize("kind,prefill,decode", [("gemma2", "triton", "triton"), ("gemma3", "triton", "torch_native")])
def test_triton_parity(checkpoints, kind, prefill, decode):
    """The Triton kernels (Triton's interpreter on CPU) with windows and soft-caps, over cached prefixes and chunks,
    alone or beside torch_native; few prompts and tokens: the interpreter is slow."""
    path = checkpoints[kind]
    picked = [1, 3]  # 23 and 57 prompt tokens (in chunks of 32), the second after a 40-token prefix; the second
    # pass finds both cached
    want_ids, want_logprobs = reference(path)
    n = 4  # a prefill and three decode steps a pass, every one past the window (and the interpreter runs each)
    sp = {"max_new_tokens": n, "temperature": 0}
    with running_engine(path, skip_tokenizer_init=True, chunked_prefill_size=32, page_size=4,
                        attention_backend=prefill, decode_attention_backend=decode) as llm:
        for _ in range(2):
            outs = llm.generate(input_ids=[prompts()[i] for i in picked], sampling_params=sp, return_logprob=True)
            for out, i in zip(outs, picked):
                assert out["output_ids"] == want_ids[i][:n]
                got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
                assert got == pytest.approx(want_logprobs[i][:n], abs=LOGPROB_ATOL)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gemma_norm_kernels_match_transformers(checkpoints, monkeypatch, kind):
    """Gemma's (1 + weight) norms in kernels (kernels.norm.gemma_rmsnorm; Gemma 3's q/k norms per head), and between
    sublayers the post-norm, the residual sum and the next norm in one launch (gemma_sandwich), Gemma 3's q/k norms
    inside the rotary launch, the GELU-and-multiply in one kernel, and on the triton backend's decode steps the
    rotation and the KV store in one launch (a sliding layer's slots looked up in it), as on CUDA: here in Triton's
    interpreter with the kernel paths forced on, transformers' tokens and logprobs."""
    from radixmesh.engine.cache import kv_pool
    from radixmesh.engine.layers import activation, norm
    from radixmesh.kernels import rotary as rotary_kernels
    from radixmesh.engine.models import gemma
    from radixmesh.kernels import norm as norm_kernels

    launches = []
    sandwich = norm_kernels.gemma_sandwich
    monkeypatch.setattr(norm, "use_kernels", lambda t: True)
    monkeypatch.setattr(gemma, "use_kernels", lambda t: True)
    monkeypatch.setattr(activation, "use_kernels", lambda t: True)
    monkeypatch.setattr(norm_kernels, "gemma_sandwich", lambda *a: launches.append(1) or sandwich(*a))
    rotations = force_rotary_kernel(monkeypatch)
    monkeypatch.setattr(kv_pool, "use_kernels", lambda t: True)
    stores, store = [], rotary_kernels.rotary_store_kv
    monkeypatch.setattr(rotary_kernels, "rotary_store_kv",
                        lambda *a, slot_map=None, **k: stores.append(slot_map) or store(*a, slot_map=slot_map, **k))
    path = checkpoints[kind]
    picked = [0, 3]
    want_ids, want_logprobs = reference(path)
    n = 4
    with running_engine(path, skip_tokenizer_init=True, chunked_prefill_size=32, page_size=4,
                        attention_backend="triton") as llm:
        outs = llm.generate(input_ids=[prompts()[i] for i in picked], sampling_params={"max_new_tokens": n,
                            "temperature": 0}, return_logprob=True)
    for out, i in zip(outs, picked):
        assert out["output_ids"] == want_ids[i][:n]
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want_logprobs[i][:n], abs=LOGPROB_ATOL)
    assert launches  # (the sandwich ran: two a layer a forward)
    assert rotations and all(qk is None if kind == "gemma2" else qk[3] for qk in rotations)  # (Gemma 3's offset)
    assert any(m is None for m in stores) and any(m is not None for m in stores)  # (global and sliding layers)


def _variant(path: str, dst, **config) -> str:
    shutil.copytree(path, dst)
    raw = json.loads((dst / "config.json").read_text())
    for key, value in config.items():
        if value is _DROP:
            raw.pop(key, None)
        else:
            raw[key] = value
    (dst / "config.json").write_text(json.dumps(raw))
    return str(dst)


_DROP = object()


def test_gemma3_hub_config_with_linear_rope_scaling(checkpoints, tmp_path):
    """Gemma 3 as the Hub's config.json files write it (transformers 4's fields: rope_theta, rope_local_base_freq,
    sliding_window_pattern, rope_scaling for the global layers, no layer_types), here with linear RoPE scaling:
    the same outputs as transformers reading those fields."""
    path = _variant(checkpoints["gemma3"], tmp_path / "hub", layer_types=_DROP, rope_parameters=_DROP,
                    rope_theta=500_000.0, rope_local_base_freq=5_000.0, sliding_window_pattern=3,
                    rope_scaling={"rope_type": "linear", "factor": 4.0})
    with running_engine(path, skip_tokenizer_init=True, chunked_prefill_size=16) as llm:
        check(path, llm.generate(input_ids=prompts(), sampling_params=GREEDY, return_logprob=True))


def _max_logprob_change(path: str, variant: str) -> float:
    outs, logprobs = reference(path)
    return max(max(abs(a - b) for a, b in zip(lp, hf_token_logprobs(variant, p, o)))
               for p, o, lp in zip(prompts(), outs, logprobs))


@pytest.mark.parametrize("kind,change", [
    ("gemma2", {"sliding_window": 4096}), ("gemma3", {"sliding_window": 4096}), ("mistral", {"sliding_window": 4096}),
    ("qwen2", {"sliding_window": 4096}), ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"final_logit_softcapping": None}),
])
def test_the_features_matter(checkpoints, tmp_path, kind, change):
    """The parity above would catch a backend that ignored the window or a soft-cap: transformers' own logprobs move
    by more than 0.1 without it. And the references are no degenerate repetition."""
    path = checkpoints[kind]
    assert _max_logprob_change(path, _variant(path, tmp_path / kind, **change)) > 0.1
    outs, _ = reference(path)
    assert all(len(set(o)) >= MAX_NEW // 2 for o in outs)


def test_the_reference_computes_the_soft_cap(checkpoints):
    """transformers 5.17 runs Gemma 2 through SDPA unless told otherwise, and SDPA has no soft-cap: that reference's
    greedy tokens differed from the model's (an H100, 2026-12-05). The reference asks for eager attention wherever
    scores are capped; the others keep transformers' default."""
    from tests.reference import hf_model

    assert hf_model(checkpoints["gemma2"]).config._attn_implementation == "eager"
    assert hf_model(checkpoints["mistral"]).config._attn_implementation != "eager"
