"""DeepSeek-V2 and DeepSeek-V3 (multi-head latent attention over experts) token-exact with transformers (float32,
CPU), each a tiny random checkpoint written here by transformers itself, through the public Engine API: V2-Lite's
shape (one q_proj, greedy softmax routing), V2's (low-rank q, group-limited routing by each group's best score,
attention biases), V3's (sigmoid routing with the correction bias in groups, YaRN RoPE whose mscale_all_dim scales
the scores too) and V3 with rotate-half RoPE. We cache one latent a token and attend in the latent space
(engine.models.deepseek), transformers expands every head's keys and values: the same sums in another order, so
logprobs are compared within 1e-4 (a wrong absorption, scale or rotation moves them by far more)."""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import pytest
import torch

from tests.engine_utils import converse, running_engine
from tests.parity.test_moe_parity import MAX_NEW, PROMPTS, _generate, _reference, _rewrite, assert_like_reference

COMMON = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=80,
              max_position_embeddings=512, initializer_range=0.15, eos_token_id=255, bos_token_id=1,
              tie_word_embeddings=False, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
              kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
FAMILIES = {
    "deepseek_v2_lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                         dict(num_hidden_layers=3, q_lora_rank=None, topk_method="greedy", n_shared_experts=2,
                              first_k_dense_replace=1, routed_scaling_factor=1.5)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(num_hidden_layers=2, q_lora_rank=24, topk_method="group_limited_greedy", n_group=4,
                         topk_group=2, n_shared_experts=1, first_k_dense_replace=0, routed_scaling_factor=2.0,
                         attention_bias=True)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_hidden_layers=3, q_lora_rank=24, n_group=2, topk_group=1, norm_topk_prob=True,
                         n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                         rope_parameters=YARN)),
    # GLM-4.7-Flash: V3's attention and routing, its sparse layers listed (mlp_layer_types)
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM",
                      dict(num_hidden_layers=3, q_lora_rank=24, n_group=2, topk_group=1, norm_topk_prob=True,
                           n_shared_experts=1, routed_scaling_factor=1.8,
                           mlp_layer_types=["sparse", "dense", "sparse"])),
    "deepseek_v3_rotate_half": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                                dict(num_hidden_layers=2, q_lora_rank=None, n_group=1, topk_group=1,
                                     norm_topk_prob=False, n_shared_experts=1, first_k_dense_replace=0,
                                     rope_interleave=False)),
}


def write_family(name: str, path) -> str:
    """FAMILIES[name]'s tiny random checkpoint, written by transformers into `path` (float32), V3's correction bias
    random (transformers starts it at zero)."""
    import transformers

    config_cls, model_cls, fields = FAMILIES[name]
    torch.manual_seed(zlib.crc32(name.encode()) % 1000)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **fields)).float().eval()
    for bias_name, bias in model.named_buffers():
        if bias_name.endswith("e_score_correction_bias"):
            bias.copy_(0.3 * torch.randn_like(bias))
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {name: write_family(name, tmp_path_factory.mktemp(name)) for name in FAMILIES}


@pytest.mark.parametrize("name", FAMILIES)
def test_deepseek_models_match_transformers(checkpoints, name):
    refs, logprobs = _reference(checkpoints[name])
    assert len({tuple(r) for r in refs}) == len(refs), "the reference does not depend on the prompt"
    with running_engine(checkpoints[name], skip_tokenizer_init=True, chunked_prefill_size=16, page_size=4) as llm:
        outs = llm.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0},
                            return_logprob=True)
        # the latent cache read back: the longest prompt again finds its pages in the radix cache
        again = llm.generate(input_ids=PROMPTS[1], sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0})
    assert_like_reference(outs, refs, logprobs)
    assert again["output_ids"] == refs[1] and again["meta_info"]["cached_tokens"] >= 36


@pytest.mark.parametrize("name,ep", [("deepseek_v2", 1), ("deepseek_v3", 1), ("deepseek_v3", 2), ("glm4_moe_lite", 1)])
def test_heads_shard_over_tensor_parallel_ranks(checkpoints, name, ep):
    """tp_size 2: each rank holds half of the heads (their q, kv_b_proj and o_proj blocks) and the whole latent
    cache; the experts split by their intermediate rows, or (ep_size 2) whole experts a rank."""
    path = checkpoints[name]
    refs, _ = _reference(path)
    with running_engine(path, skip_tokenizer_init=True, tp_size=2, ep_size=ep) as llm:
        outs = llm.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0})
    assert [o["output_ids"] for o in outs] == refs


def test_the_latent_cache_is_one_buffer_a_layer(checkpoints):
    """The pool holds one latent (kv_lora_rank + qk_rope_head_dim) a token and layer: K and V are one tensor, and
    the memory the engine plans for a token is that latent once."""
    from radixmesh.engine.cache.kv_pool import KVPool
    from radixmesh.engine.model_config import ModelConfig

    cfg = ModelConfig.from_path(checkpoints["deepseek_v3"])
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rope_head_dim) == (1, 40, 8)
    assert cfg.kv_bytes_per_token(torch.float32) == 3 * 40 * 4
    pool = KVPool(4, 2, 3, 1, 40, torch.float32, torch.device("cpu"), shared_kv=True)
    assert all(k is v for k, v in zip(pool.k, pool.v))
    latent = torch.randn(2, 1, 40)
    pool.write(1, torch.tensor([3, 5]), latent, latent)
    k, v = pool.read(1, torch.tensor([3, 5]), torch.float32)
    assert torch.equal(k, latent) and torch.equal(v, latent)


def test_block_fp8_checkpoint_matches_its_dequantized_twin(checkpoints, tmp_path):
    """Our fp8 writer's block-wise DeepSeek-V3 (every projection, kv_b_proj included, and the experts in fp8 with
    16 x 32 blocks, as DeepSeek-V3's own checkpoint is published): served on CPU, dequantized at load (kv_b_proj's
    blocks then carry q into the latent and the output out of it): the dequantized twin's tokens and logprobs."""
    from radixmesh.engine.quantization import fp8

    quantized = fp8.write_checkpoint(checkpoints["deepseek_v3"], str(tmp_path / "fp8"), block=(16, 32))
    twin = fp8.dequantized_checkpoint(quantized, str(tmp_path / "twin"))
    want_ids, want_logprobs = _generate(twin, PROMPTS, 8)
    ids, logprobs = _generate(quantized, PROMPTS, 8)
    assert ids == want_ids and logprobs == pytest.approx(want_logprobs, abs=1e-5)


def test_fp8_low_rank_projections_are_held_in_fp8(checkpoints, tmp_path):
    """A per-channel fp8 DeepSeek-V3 on the fp8 kernels (Triton's interpreter here): q_a_proj, q_b_proj,
    kv_a_proj_with_mqa and o_proj stay fp8 (half the bytes a decode step reads of them), kv_b_proj (whose head blocks
    the model multiplies itself) is dequantized; a prompt of under 16 tokens runs 16-bit activations, so the tokens
    and logprobs are the dequantized twin's."""
    from radixmesh.engine.quantization import fp8

    channel = fp8.write_checkpoint(checkpoints["deepseek_v3"], str(tmp_path / "fp8-channel"))
    want_ids, want_logprobs = _generate(fp8.dequantized_checkpoint(channel, str(tmp_path / "twin")), PROMPTS[:1], 4)
    with running_engine(channel, skip_tokenizer_init=True, fp8_gemm_backend="triton",
                        moe_runner_backend="triton") as llm:
        attn = llm.runner.model.model.layers[1].self_attn
        held = {n: getattr(attn, n).weight.dtype for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")}
        assert held == dict.fromkeys(held, torch.float8_e4m3fn) and attn.kv_b_proj.weight.dtype == torch.float32
        outs = llm.generate(input_ids=PROMPTS[:1], sampling_params={"max_new_tokens": 4, "temperature": 0},
                            return_logprob=True)
    pairs = [(t, lp) for o in outs for lp, t, _ in o["meta_info"]["output_token_logprobs"]]
    assert [t for t, _ in pairs] == want_ids
    assert [lp for _, lp in pairs] == pytest.approx(want_logprobs, abs=1e-4)


def test_multi_token_prediction_layers_are_skipped(checkpoints, tmp_path):
    """DeepSeek-V3's published checkpoint holds its multi-token-prediction layer after the last decoder layer
    (model.layers.<num_hidden_layers>.*): served without it, as transformers does."""
    path = checkpoints["deepseek_v3"]
    mtp = {f"model.layers.3.{name}": torch.zeros(shape) for name, shape in [
        ("eh_proj.weight", (64, 128)), ("enorm.weight", (64,)), ("hnorm.weight", (64,)),
        ("self_attn.kv_b_proj.weight", (112, 32)), ("mlp.gate.e_score_correction_bias", (8,))]}
    refs, logprobs = _reference(path)
    out_ids, out_logprobs = _generate(_rewrite(path, tmp_path / "mtp", mtp, num_nextn_predict_layers=1),
                                      PROMPTS[:1], MAX_NEW)
    assert out_ids == refs[0] and out_logprobs == pytest.approx(logprobs[0], abs=1e-4)


@pytest.mark.parametrize("name,fields,words", [
    ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method='noaux_tc'"),
    ("deepseek_v2", dict(norm_topk_prob=True), "norm_topk_prob=true"),
    ("deepseek_v3", dict(scoring_func="softmax"), "scoring_func='softmax'"),
    ("deepseek_v3", dict(moe_layer_freq=2), "moe_layer_freq=2"),
    ("deepseek_v3", dict(n_group=3), "n_group=3 groups"),  # 8 experts do not split into 3 groups
])
def test_configs_it_cannot_serve_are_refused(checkpoints, tmp_path, name, fields, words):
    """Routing DeepSeek's own code reads and transformers computes one way only, or cannot compute: refused at
    load with the field named, never served otherwise."""
    bad = _rewrite(checkpoints[name], tmp_path / "bad", {}, **fields)
    with pytest.raises(Exception, match=words.replace("(", r"\(")):
        with running_engine(bad, skip_tokenizer_init=True):
            pass


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_the_hierarchical_cache_brings_latent_pages_back_unchanged(checkpoints, kv_cache_dtype):
    """The latent pool's pages (K and V one buffer) go to host memory and come back (an engine whose device pool is
    too small for the conversations), every earlier token cached: every turn answers as an engine without a prefix
    cache; in fp8 (the latent stored once, its K and V scales one) as one that holds every page on the device (a
    prefill attends to its own tokens unrounded, so an fp8 engine without a cache answers otherwise)."""
    import random

    rng = random.Random(0)
    convs = [[rng.randrange(5, 250) for _ in range(60)] for _ in range(6)]
    common = dict(kv_cache_dtype=kv_cache_dtype, skip_tokenizer_init=True, page_size=4)
    path = checkpoints["deepseek_v3"]
    reference = dict(disable_radix_cache=True) if kv_cache_dtype == "auto" else dict(max_total_tokens=4096)
    with running_engine(path, **reference, **common) as plain, \
            running_engine(path, max_total_tokens=192, enable_hierarchical_cache=True, hicache_ratio=8,
                           **common) as tiered:
        # a host page holds each layer's latent once: [layers, page, 1, rank + rope], as the device pool holds it
        host, pool = tiered.cache.hierarchy.host, tiered.cache.hierarchy.mover.kv
        assert host.data.shape[1:] == (3, 4, 1, 40) and len(pool.buffers()) == 3
        assert host.page_bytes == pool.page_bytes * 3
        converse(tiered, plain, convs, {"max_new_tokens": 8, "temperature": 0}, rng, vocab=250)
        assert tiered.get_load()["host_hit_tokens"] > 0  # pages did come back from host memory


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_the_expanded_prefill_matches_transformers(checkpoints, monkeypatch, name, kv_cache_dtype):
    """Prefill in the expanded form (engine.attention.mla_expanded: each head's keys and values rebuilt from the
    latents, ordinary causal attention), in 16-token chunks (a cached prefix read back from the pool: fp8 in the
    second case) and decode in the latent form: transformers' tokens and logprobs (fp8: the latent engine's tokens,
    logprobs close)."""
    from radixmesh.engine.attention import mla_expanded

    path = checkpoints[name]
    opts = dict(skip_tokenizer_init=True, chunked_prefill_size=16, page_size=4, kv_cache_dtype=kv_cache_dtype)
    greedy = {"max_new_tokens": MAX_NEW, "temperature": 0}
    if kv_cache_dtype == "auto":
        refs, logprobs = _reference(path)
    else:
        with running_engine(path, **opts) as llm:
            latent = llm.generate(input_ids=PROMPTS, sampling_params=greedy, return_logprob=True)
    calls = []
    run = mla_expanded.expanded_attention
    monkeypatch.setattr(mla_expanded, "expanded_attention", lambda *a: calls.append(a[0].batch) or run(*a))
    monkeypatch.setenv("RADIXMESH_MLA_PREFILL", "expanded")
    with running_engine(path, **opts) as llm:
        outs = llm.generate(input_ids=PROMPTS, sampling_params=greedy, return_logprob=True)
    assert any(max(b.seq_lens_host[i] - b.extend_lens_host[i] for i in range(b.batch_size)) > 0 for b in calls)
    if kv_cache_dtype == "auto":
        assert_like_reference(outs, refs, logprobs)
    else:
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in latent]
        for a, b in zip(outs, latent):
            assert [x[0] for x in a["meta_info"]["output_token_logprobs"]] == pytest.approx(
                [x[0] for x in b["meta_info"]["output_token_logprobs"]], abs=1e-3)


@pytest.mark.parametrize("new", [20, 7])
def test_the_expanded_prefills_attention_takes_a_fused_kernel(new):
    """The expanded form's causal attention (a whole prompt, and new tokens after a cached prefix) runs on torch's
    flash kernel, the plain fallback forbidden, and equals the scores computed by hand. (Given 3-D tensors, torch
    had only its plain fallback, which holds every score: DeepSeek-V2-Lite's 8k prefill ran out of memory on an
    H100 that way.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from radixmesh.engine.attention.mla_expanded import _causal

    g = torch.Generator().manual_seed(new)
    heads, total, dim, scale = 4, 20, 32, 0.2
    q, k, v = (torch.randn(heads, n, dim, generator=g) for n in (new, total, total))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = _causal(q, k, v, scale)
    scores = torch.einsum("hqd,hkd->hqk", q, k) * scale
    position = torch.arange(total - new, total)[:, None]  # each query's own position: the keys up to it
    scores = scores.masked_fill(torch.arange(total)[None, :] > position, float("-inf"))
    torch.testing.assert_close(out, torch.einsum("hqk,hkd->hqd", scores.softmax(-1), v), atol=1e-5, rtol=1e-5)


def test_the_expanded_prefill_is_chosen_where_it_multiplies_less(monkeypatch):
    """`auto` takes the expanded form for a long prompt, the latent one for a few new tokens over a long cached
    prefix (rebuilding its keys and values would cost more than the pairs save); decode is always latent; a mode
    that does not exist is refused."""
    from radixmesh.engine.attention import mla_expanded
    from radixmesh.engine.batch import ForwardMode

    def batch(new, total, mode=ForwardMode.EXTEND):
        return SimpleNamespace(mode=mode, tree_mask=None, extend_lens_host=new, seq_lens_host=total)
    v3 = (512, 64, 128, 128)  # kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim
    monkeypatch.setenv("RADIXMESH_MLA_PREFILL", "auto")
    assert mla_expanded.wanted(batch([8192], [8192]), *v3)
    assert mla_expanded.wanted(batch([512, 4], [1024, 4]), *v3)
    assert not mla_expanded.wanted(batch([16], [8192]), *v3) and not mla_expanded.wanted(batch([150], [150]), *v3)
    assert not mla_expanded.wanted(batch([1], [8192], ForwardMode.DECODE), *v3)
    monkeypatch.setenv("RADIXMESH_MLA_PREFILL", "latent")
    assert not mla_expanded.wanted(batch([8192], [8192]), *v3)
    monkeypatch.setenv("RADIXMESH_MLA_PREFILL", "mha")
    with pytest.raises(ValueError, match="RADIXMESH_MLA_PREFILL must be one of latent, expanded, auto"):
        mla_expanded.wanted(batch([8192], [8192]), *v3)


@pytest.mark.parametrize("store", [None, "file"])
def test_tp_host_tier_keeps_one_copy_of_the_latent(checkpoints, tmp_path, store):
    """Under TP=2 every rank holds the same latent. Without a store each rank keeps pinned host pages of its own (one
    latent a token and layer), and a small device pool sends conversations to the host and back: every turn answers
    as one process without a prefix cache, every earlier token cached. With a file store the host tier is one copy
    both ranks map (the leader alone backs pages up, the follower loads from it) and an L3 page is that one copy
    under keys any TP size shares: the prompts' second pass (write-through, a host pool smaller than the prompts)
    comes back whole pages from the host and the store, and a TP=1 engine on the same store finds them."""
    import random

    from tests.api.test_hicache_engine import NO_SKIP

    path = checkpoints["deepseek_v3"]
    common = dict(skip_tokenizer_init=True, page_size=4)
    greedy = {"max_new_tokens": 6, "temperature": 0}
    tier = dict(max_total_tokens=192, enable_hierarchical_cache=True, hicache_ratio=8 if store is None else 1)
    if store is not None:
        tier.update(hicache_storage_backend=store, hicache_storage_url=str(tmp_path / "l3"),
                    hicache_write_policy="write_through", hicache_storage_prefetch_policy="wait_complete",
                    hicache_storage_backend_extra_config=NO_SKIP)
    rng = random.Random(1)
    convs = [[rng.randrange(5, 250) for _ in range(60 if store is None else 40)] for _ in range(6)]
    with running_engine(path, disable_radix_cache=True, **common) as plain, \
            running_engine(path, tp_size=2, **tier, **common) as tiered:
        host = tiered.cache.hierarchy.host
        assert host.page_bytes == 3 * 4 * 40 * 4  # layers x page x (rank + rope) x float32
        shared = store is not None  # a store: one copy every rank maps; none: this rank's own pages
        assert host.replicated == shared and host.group.shape[1] == 1 and (host.path is not None) == shared
        if store is None:
            converse(tiered, plain, convs, {"max_new_tokens": 8, "temperature": 0}, rng, vocab=250)
        else:
            want = [plain.generate(input_ids=c, sampling_params=greedy)["output_ids"] for c in convs]
            for _ in range(2):
                outs = [tiered.generate(input_ids=c, sampling_params=greedy) for c in convs]
                assert [o["output_ids"] for o in outs] == want
            assert [o["meta_info"]["cached_tokens"] for o in outs] == [36] * 6
        load = tiered.get_load()
        assert load["host_hit_tokens"] > 0 and (store is None or load["storage_hit_tokens"] > 0)
    if store is not None:
        with running_engine(path, **tier, **common) as one:  # (TP=1: the same keys)
            out = one.generate(input_ids=convs[0], sampling_params=greedy)
            assert out["output_ids"] == want[0] and out["meta_info"]["cached_tokens"] == 36


def test_triton_latent_kernels_match_transformers_in_the_interpreter(checkpoints):
    """Prefill and decode on Triton's latent kernels (kernels.mla_extend, kernels.mla_decode: what a GPU runs by
    default), over a cached prefix too (chunked prefill), in Triton's interpreter: transformers' tokens and
    logprobs."""
    path = checkpoints["deepseek_v3"]
    refs, logprobs = _reference(path)
    with running_engine(path, skip_tokenizer_init=True, attention_backend="triton", moe_runner_backend="triton",
                        chunked_prefill_size=16, page_size=4) as llm:
        assert llm.args.prefill_attention_backend == llm.args.decode_attention_backend == "triton"
        outs = llm.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0},
                            return_logprob=True)
    assert_like_reference(outs, refs, logprobs)


def test_ngram_speculative_decoding_keeps_the_greedy_tokens(checkpoints):
    """Draft tokens verified over the latent cache (a tree of rows attending to their own keys) give the tokens plain
    decoding gives, on prompts whose continuations repeat (so drafts are proposed and accepted)."""
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 5, 9, 5, 9, 5], list(range(20, 50))]
    greedy = {"max_new_tokens": 16, "temperature": 0}
    outs = []
    for opts in ({}, {"speculative_algorithm": "NGRAM"}):
        with running_engine(checkpoints["deepseek_v3"], skip_tokenizer_init=True, **opts) as llm:
            outs.append([o["output_ids"] for o in llm.generate(input_ids=prompts, sampling_params=greedy)])
    assert outs[0] == outs[1]


def test_prefill_decode_disaggregation_moves_the_latent_pages(checkpoints):
    """A prefill engine and a decode engine (the services' handoff, the fake transfer backend moving the pool's
    pages through their mirrors): the latent pages the prefill side wrote decode on the other side to transformers'
    tokens, every page back on both sides."""
    import asyncio

    from tests.parity.test_pd_speculative import Pair

    path = checkpoints["deepseek_v2"]
    refs, _ = _reference(path)
    opts = dict(skip_tokenizer_init=True, page_size=4, chunked_prefill_size=16)
    greedy = {"max_new_tokens": MAX_NEW, "temperature": 0}
    with running_engine(path, **opts) as p, running_engine(path, **opts) as d:
        pair = Pair(p, d)
        # the pages move each layer's latent once: one buffer a layer, whose page is page_size latents
        assert len(pair.mp.buffers) == len(pair.md.buffers) == 2 and p.runner.kv_pool.parts == 1
        assert pair.mp.pool.page_bytes == 4 * (32 + 8) * 4

        async def run():
            return [await pair.generate(ids, greedy) for ids in PROMPTS]
        got = asyncio.run(run())
    assert [o["output_ids"] for o in got] == refs


def test_a_tp2_handoff_moves_one_copy_of_the_latent(checkpoints):
    """Prefill/decode under TP=2 (one engine in both roles, the services' transfer path over its mirrors, as
    tests/api/test_tp_disaggregation.py runs it): every rank holds the same latent, so one mirror serves them all (the
    leader stages out, a transfer moves one rank's pages, every rank stages in); transformers' tokens, every page
    back."""
    import asyncio

    from radixmesh.services.common.kv_transfer import KvTransfer
    from tests.api.test_tp_disaggregation import _handoff

    path = checkpoints["deepseek_v2"]
    refs, _ = _reference(path)
    greedy = {"max_new_tokens": MAX_NEW, "temperature": 0}
    with running_engine(path, tp_size=2, skip_tokenizer_init=True, page_size=4) as llm:
        transfer = KvTransfer(llm, "fake", "127.0.0.1")
        try:
            assert transfer.tp_size == 2 and transfer.mirror.replicated
            assert len(transfer.layout.bases) == len(llm.runner.kv_pool.buffers()) == 2  # one rank's, one a layer

            async def run():
                return [await _handoff(llm, llm, transfer, transfer, ids, greedy) for ids in PROMPTS]
            got = asyncio.run(run())
        finally:
            transfer.close()
        load = llm.get_load()
        assert load["prealloc_rooms"] == 0 and load["available_kv_tokens"] == load["max_total_num_tokens"]
    assert [o["output_ids"] for o in got] == refs


def test_lora_is_refused_with_its_reason(checkpoints):
    with pytest.raises(Exception, match="LoRA adapters of DeepseekV3ForCausalLM"):
        with running_engine(checkpoints["deepseek_v3"], skip_tokenizer_init=True, enable_lora=True, max_lora_rank=8):
            pass


def _with_mtp(path: str, tmp_path, family: str = "deepseek_v3", apart: bool = False) -> tuple[str, torch.nn.Module]:
    """The tiny DeepSeek-V3 (or `family`'s model) with a multi-token-prediction layer after its last, as DeepSeek-V3
    publishes one (`model.layers.3.*`: a sparse decoder layer, written by transformers, and the module's enorm,
    hnorm, eh_proj, shared_head and its copy of the embedding), and transformers' model whose layer 3 it is (the
    reference's). `apart`: as GLM-4.x publish it, in an mtp.safetensors beside an index that does not list it."""
    import json

    import transformers
    from safetensors.torch import load_file, save_file

    from tests.parity import test_moe_parity

    config_name, model_name, fields = FAMILIES.get(family) or test_moe_parity.FAMILIES[family]
    common = COMMON if family in FAMILIES else test_moe_parity.COMMON
    fields = {**fields, "num_hidden_layers": 4}
    if "mlp_layer_types" in fields:
        fields["mlp_layer_types"] = [*fields["mlp_layer_types"], "sparse"]
    torch.manual_seed(11)
    four = getattr(transformers, model_name)(getattr(transformers, config_name)(**common, **fields)).float()
    four.model.layers[3].mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8))
    four.save_pretrained(tmp_path / "four")
    layer = {k: v for k, v in load_file(str(tmp_path / "four" / "model.safetensors")).items()
             if k.startswith("model.layers.3.")}
    h, vocab = common["hidden_size"], common["vocab_size"]
    gen = torch.Generator().manual_seed(12)
    extra = {"enorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
             "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
             "eh_proj.weight": 0.15 * torch.randn(h, 2 * h, generator=gen),
             "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
             "shared_head.head.weight": 0.15 * torch.randn(vocab, h, generator=gen),
             "embed_tokens.weight": load_file(f"{path}/model.safetensors")["model.embed_tokens.weight"]}
    layer |= {f"model.layers.3.{k}": v for k, v in extra.items()}
    four.config._attn_implementation = "eager"
    four.mtp = extra
    if not apart:
        return _rewrite(path, tmp_path / "mtp", layer, num_nextn_predict_layers=1), four
    out = _rewrite(path, tmp_path / "mtp", {}, num_nextn_predict_layers=1)
    weights = load_file(f"{out}/model.safetensors")
    (tmp_path / "mtp" / "model.safetensors").unlink()
    save_file(weights, f"{out}/model-00001-of-00001.safetensors", metadata={"format": "pt"})
    save_file(layer, f"{out}/mtp.safetensors", metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(weights, "model-00001-of-00001.safetensors")}
    (tmp_path / "mtp" / "model.safetensors.index.json").write_text(json.dumps(index))
    return out, four


class ReferenceNextn:
    """The multi-token-prediction layer recomputed with transformers' DeepSeek-V3 modules over the whole sequence
    each time: eh_proj([enorm(embedding of t + 1), hnorm(the target's final hidden state at t)]), the decoder
    layer, shared_head; chained on its own outputs as EAGLE heads are."""

    def __init__(self, target: str, four):
        from tests.reference import hf_model
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

        self.target, self.four = hf_model(target), four
        eps = four.config.rms_norm_eps

        def norm(weight):
            module = DeepseekV3RMSNorm(weight.shape[0], eps)
            module.weight.data.copy_(weight)
            return module
        self.enorm, self.hnorm, self.final = (norm(four.mtp[k]) for k in ("enorm.weight", "hnorm.weight",
                                                                         "shared_head.norm.weight"))

    def _outputs(self, tokens: list[int], feats: torch.Tensor) -> torch.Tensor:
        embed = self.target.model.embed_tokens(torch.tensor(tokens))
        x = torch.cat([self.enorm(embed), self.hnorm(feats)], -1) @ self.four.mtp["eh_proj.weight"].T
        n = len(tokens)
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.four.model.layers[3](x[None], attention_mask=mask, position_ids=pos,
                                        position_embeddings=self.four.model.rotary_emb(x[None], pos))
        return (out[0] if isinstance(out, tuple) else out)[0]

    @torch.inference_mode()
    def drafts(self, fill: list[int], k: int) -> list[int]:
        feats = self.target.model(torch.tensor([fill[:-1]])).last_hidden_state[0]  # after the final norm
        tokens, out = list(fill[1:]), []
        for _ in range(k):
            outs = self._outputs(tokens, feats)
            out.append(int((self.final(outs[-1]) @ self.four.mtp["shared_head.head.weight"].T).argmax()))
            tokens.append(out[-1])
            feats = torch.cat([feats, outs[-1:]])
        return out


def test_nextn_drafts_with_the_models_own_prediction_layer(checkpoints, tmp_path):
    """speculative_algorithm NEXTN (SGLang's: EAGLE with DeepSeek-V3's multi-token-prediction layer, read from the
    model's own checkpoint): transformers' greedy tokens, and every chain of drafts the reference layer proposes."""
    path, four = _with_mtp(checkpoints["deepseek_v3"], tmp_path)
    llm_args = _drafts_like_reference(path, four, _reference(checkpoints["deepseek_v3"])[0], chunked_prefill_size=16)
    assert llm_args.speculative_algorithm == "EAGLE" and llm_args.speculative_draft_model_path == path


def _drafts_like_reference(path: str, four, refs: list[list[int]], **opts):
    """NEXTN over the checkpoint at `path` (its MTP layer, transformers' `four`'s layer 3): transformers' greedy
    tokens `refs`, and every chain of drafts the reference layer proposes. Returns the engine's args."""
    from tests.parity.test_speculative_eagle import record_proposals

    with running_engine(path, skip_tokenizer_init=True, speculative_algorithm="NEXTN", speculative_num_steps=3,
                        page_size=4, **opts) as llm:
        seen = record_proposals(llm)
        outs = llm.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0})
    assert [o["output_ids"] for o in outs] == refs
    reference = ReferenceNextn(path, four)
    assert len(seen) >= len(PROMPTS)
    for fill, proposed in seen:
        assert proposed == reference.drafts(fill, len(proposed)), len(fill)
    return llm.args


@pytest.mark.parametrize("family", ["glm4_moe_lite", "glm4_moe"])
def test_glm_drafts_with_its_prediction_layer_from_its_own_file(checkpoints, tmp_path, family):
    """GLM-4.7-Flash's multi-token-prediction layer is DeepSeek-V3's, GLM-4.5's holds GLM-4.5's own decoder layer
    (grouped-query attention on half-rotary heads, its experts); GLM-4.x publish it in an mtp.safetensors their index
    does not list. NEXTN reads it from there: every chain of drafts equal to the reference layer's (transformers'
    modules), transformers' greedy tokens; the model alone loads beside it. A model whose MTP layers the head is not
    is refused by name."""
    from tests.parity import test_moe_parity

    src = checkpoints[family] if family in FAMILIES else test_moe_parity.write_family(family, tmp_path / "src")
    path, four = _with_mtp(src, tmp_path, family, apart=True)
    refs, _ = _reference(src)
    _drafts_like_reference(path, four, refs)
    with running_engine(path, skip_tokenizer_init=True) as llm:  # (the MTP file read and skipped)
        outs = llm.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0})
    assert [o["output_ids"] for o in outs] == refs
    if family == "glm4_moe":
        other = _rewrite(test_moe_parity.write_family("qwen3_moe", tmp_path / "qwen3"), tmp_path / "qwen3-mtp", {},
                         num_nextn_predict_layers=1)
        with pytest.raises(ValueError, match="Qwen3MoeForCausalLM's multi-token-prediction layers are not "):
            with running_engine(other, skip_tokenizer_init=True, speculative_algorithm="NEXTN"):
                pass


@pytest.mark.parametrize("opts", [{"speculative_eagle_topk": 2, "speculative_num_draft_tokens": 11},
                                  {"speculative_eagle_topk": 2, "speculative_num_draft_tokens": 11,
                                   "attention_backend": "triton", "moe_runner_backend": "triton"},
                                  {"tp_size": 2}], ids=["tree", "tree-triton", "tp2"])
def test_nextn_drafts_trees_and_runs_under_tensor_parallelism(checkpoints, tmp_path, monkeypatch, opts):
    """NEXTN drafting trees (two candidates a step, verified under the tree mask on torch_native, and on Triton's
    latent kernels in the interpreter: a GPU's default), and with the target's heads over two ranks (the head whole
    on the leader): transformers' greedy tokens, drafts proposed. The trees' head is steered by the oracle of
    tests/parity/test_speculative_tree (the answer ranked second at every node), so every verify keeps a path
    through second-ranked children two deep, whose latent KV moves to the consecutive positions."""
    from radixmesh.engine.attention import triton_backend
    from tests.parity.test_speculative_tree import Oracle

    path, _ = _with_mtp(checkpoints["deepseek_v3"], tmp_path)
    refs, _ = _reference(checkpoints["deepseek_v3"])
    masked, run = [], triton_backend.latent_decode
    monkeypatch.setattr(triton_backend, "latent_decode", lambda *a, **kw: masked.append(kw["tree"] is not None)
                        or run(*a, **kw))
    triton = opts.get("attention_backend") == "triton"
    prompts, want = (PROMPTS[1:2], refs[1:2]) if triton else (PROMPTS, refs)  # (the interpreter is slow)
    tree = "speculative_eagle_topk" in opts
    with running_engine(path, skip_tokenizer_init=True, speculative_algorithm="NEXTN", speculative_num_steps=3,
                        page_size=4, **opts) as llm:
        if tree:
            Oracle(llm.scheduler.spec.model.runner, [p + r for p, r in zip(prompts, want)], COMMON["vocab_size"])
        outs = llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0})
        stats = llm.scheduler.load()
    assert [o["output_ids"] for o in outs] == want
    assert all(o["meta_info"]["spec_draft_token_num"] > 0 for o in outs)
    if tree:  # every tree (10 nodes) keeps at least the answer's two: the second-ranked child's second-ranked child
        assert stats["spec_accepted_tokens"] >= 2 * stats["spec_draft_tokens"] // 10 > 0
    # on Triton the tree rows (the head's tree steps, the target's verifies) run the latent kernel's tree mask (its
    # rule is tested against a twin in tests/kernels/test_mla_decode.py too)
    assert any(masked) == triton


def test_glm_flash_layer_types_default_and_are_checked(checkpoints, tmp_path):
    """GLM-4.7-Flash's mlp_layer_types: without it a dense first layer and sparse ones after (transformers'
    default); a value other than dense or sparse, or a list of another length, is refused."""
    import json

    from radixmesh.engine.model_config import ModelConfig

    src = checkpoints["glm4_moe_lite"]
    raw = json.loads(open(f"{src}/config.json").read())
    assert [ModelConfig.from_path(src).moe.sparse(i) for i in range(3)] == [True, False, True]
    del raw["mlp_layer_types"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert [ModelConfig.from_path(str(tmp_path)).moe.sparse(i) for i in range(3)] == [False, True, True]
    for bad in (["dense", "moe", "sparse"], ["dense", "sparse"]):
        (tmp_path / "config.json").write_text(json.dumps({**raw, "mlp_layer_types": bad}))
        with pytest.raises(ValueError, match="mlp_layer_types"):
            ModelConfig.from_path(str(tmp_path))


@pytest.mark.parametrize("name, backend", [("deepseek_v2_lite", "torch_native"), ("deepseek_v3", "torch_native"),
                                           ("deepseek_v3_rotate_half", "torch_native"), ("deepseek_v2_lite", "triton")])
def test_the_absorbed_decode_kernels_match_transformers(checkpoints, monkeypatch, name, backend):
    """kernels.mla_absorb on the decode path (each head's query into the latent space with the query and key rows in
    one launch; each head's value out of it into o_proj's input in another), run here in Triton's interpreter with the
    model's kernel paths forced on: transformers' tokens and logprobs, every decode step through the kernels (V2's
    float32 RoPE pairs, V3's interleaved, rotate-half; a batch of four rows and one alone). On the triton backend
    (its latent kernels interpreted too) the key rows go straight into the pool from the query's launch."""
    from radixmesh.engine.cache import kv_pool
    from radixmesh.engine.models import deepseek
    from radixmesh.kernels import mla_absorb

    path = checkpoints[name]
    refs, logprobs = _reference(path)
    rows, stored = [], []
    run, query_key = mla_absorb.absorbed_values, mla_absorb.absorbed_query_key
    monkeypatch.setattr(deepseek, "use_kernels", lambda t: True)
    monkeypatch.setattr(kv_pool, "use_kernels", lambda t: True)
    monkeypatch.setattr(mla_absorb, "absorbed_values", lambda out, *a, **k: rows.append(out.shape[0]) or run(out, *a, **k))
    monkeypatch.setattr(mla_absorb, "absorbed_query_key",
                        lambda *a, **k: stored.append(k["cache"] is not None) or query_key(*a, **k))
    greedy = {"max_new_tokens": MAX_NEW, "temperature": 0}
    with running_engine(path, skip_tokenizer_init=True, chunked_prefill_size=16, page_size=4,
                        attention_backend=backend) as llm:
        outs = llm.generate(input_ids=PROMPTS, sampling_params=greedy, return_logprob=True)
        alone = llm.generate(input_ids=PROMPTS[2], sampling_params=greedy)
    assert_like_reference(outs, refs, logprobs)
    assert alone["output_ids"] == refs[2]
    assert rows and max(rows) <= mla_absorb.MAX_ROWS and 1 in rows and len(PROMPTS) in rows
    assert any(stored) == (backend == "triton")  # (short prefill chunks, not decode steps, pass their key rows)
