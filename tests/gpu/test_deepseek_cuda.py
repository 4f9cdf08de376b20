"""DeepSeek-V2 and DeepSeek-V3 on CUDA: the tiny checkpoints of tests/parity/test_deepseek_parity.py in float32,
token-exact with transformers (logprobs within 1e-3), by default on Triton's latent kernels (kernels.mla_extend,
kernels.mla_decode in CUDA graphs), with the experts' kernels and kernels.moe.route_grouped (V2's single-best group
score, V3's two-best with the bias); and in plain torch too, eagerly."""

from __future__ import annotations

import pytest

from tests.engine_utils import assert_no_leak, greedy_like_transformers, running_engine

pytestmark = pytest.mark.gpu
MAX_NEW = 12


@pytest.mark.parametrize("backend", [None, "torch_native"])
@pytest.mark.parametrize("name", ["deepseek_v2_lite", "deepseek_v2", "deepseek_v3"])
def test_deepseek_on_cuda_matches_transformers(tmp_path, name, backend):
    from tests.parity.test_deepseek_parity import write_family
    from tests.parity.test_moe_parity import PROMPTS

    path = write_family(name, tmp_path)
    opts = {} if backend is None else {"attention_backend": backend}
    with running_engine(path, device="cuda", dtype="float32", skip_tokenizer_init=True, chunked_prefill_size=16,
                        **opts) as llm:
        assert llm.args.prefill_attention_backend == llm.args.decode_attention_backend == (backend or "triton")
        assert (llm.runner.graphs is not None) == (backend is None)
        for batch in (PROMPTS, PROMPTS[:1]):  # (batch 1: a graph of its own)
            greedy_like_transformers(llm, path, batch, MAX_NEW)
        assert_no_leak(llm)


@pytest.mark.parametrize("block", [(16, 32), None], ids=["block", "channel"])
def test_fp8_deepseek_in_cuda_graphs_holds_its_projections_in_fp8(tmp_path, block):
    """An fp8 DeepSeek-V3 (block-wise with blocks cut by the latent's 40 rows and q_b_proj's 24 columns, or per
    channel) on CUDA in graphs: the low-rank projections, o_proj and the experts held in fp8, kv_b_proj dequantized;
    the dequantized twin's first token of each prompt, its logprob within 0.05 (a prefill's expert GEMMs quantize
    their activations per token group, W8A8, as SGLang's do: 0.011 off in Triton's interpreter, where the twin's
    second token of the last prompt is a near tie that flips)."""
    import torch

    from radixmesh.engine.quantization import fp8
    from tests.parity.test_deepseek_parity import write_family
    from tests.parity.test_moe_parity import PROMPTS

    path = fp8.write_checkpoint(write_family("deepseek_v3", tmp_path / "src"), str(tmp_path / "fp8"), block=block)
    twin = fp8.dequantized_checkpoint(path, str(tmp_path / "twin"))
    greedy = {"max_new_tokens": MAX_NEW, "temperature": 0}
    outs = []
    for p in (twin, path):
        with running_engine(p, device="cuda", dtype="float32", skip_tokenizer_init=True, chunked_prefill_size=16,
                            fp8_gemm_backend="triton", moe_runner_backend="triton") as llm:
            if p == path:
                attn = llm.runner.model.model.layers[1].self_attn
                assert {attn.q_a_proj.weight.dtype, attn.kv_a_proj_with_mqa.weight.dtype,
                        attn.o_proj.weight.dtype} == {torch.float8_e4m3fn}
                assert attn.kv_b_proj.weight.dtype == torch.float32 and llm.runner.graphs is not None
            got = llm.generate(input_ids=PROMPTS, sampling_params=greedy, return_logprob=True)
            outs.append([o["meta_info"]["output_token_logprobs"][0][:2] for o in got])
            assert_no_leak(llm)
    assert [t for _, t in outs[1]] == [t for _, t in outs[0]]
    assert [lp for lp, _ in outs[1]] == pytest.approx([lp for lp, _ in outs[0]], abs=0.05)


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_the_expanded_prefill_on_cuda_matches_transformers(tmp_path, monkeypatch, name):
    """Prefill in the expanded form (engine.attention.mla_expanded, torch's fused attention kernels over each head's
    rebuilt keys and values, 16-token chunks: a cached prefix too), decode on the latent kernels in CUDA graphs."""
    from tests.parity.test_deepseek_parity import write_family
    from tests.parity.test_moe_parity import PROMPTS

    monkeypatch.setenv("RADIXMESH_MLA_PREFILL", "expanded")
    path = write_family(name, tmp_path)
    with running_engine(path, device="cuda", dtype="float32", skip_tokenizer_init=True, chunked_prefill_size=16) as llm:
        greedy_like_transformers(llm, path, PROMPTS, MAX_NEW)
        assert_no_leak(llm)


def test_nextn_trees_on_the_latent_kernels_in_cuda_graphs_keep_the_greedy_tokens(tmp_path):
    """NEXTN drafting trees (two candidates a step) on CUDA's defaults: the head's tree steps and the target's
    verifies on kernels.mla_decode's tree mask, in CUDA graphs; transformers' greedy tokens."""
    from tests.parity.test_deepseek_parity import _reference, _with_mtp, write_family
    from tests.parity.test_moe_parity import MAX_NEW as REF_NEW
    from tests.parity.test_moe_parity import PROMPTS

    src = write_family("deepseek_v3", tmp_path / "src")
    path, _ = _with_mtp(src, tmp_path)
    refs, _ = _reference(src)
    with running_engine(path, device="cuda", dtype="float32", skip_tokenizer_init=True, speculative_algorithm="NEXTN",
                        speculative_num_steps=3, speculative_eagle_topk=2) as llm:
        assert llm.args.decode_attention_backend == "triton" and llm.runner.graphs is not None
        outs = llm.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": REF_NEW, "temperature": 0})
        assert_no_leak(llm)
    assert [o["output_ids"] for o in outs] == refs


@pytest.mark.parametrize("family", ["glm4_moe_lite", "glm4_moe"])
def test_glm_nextn_in_cuda_graphs_keeps_the_greedy_tokens(tmp_path, family):
    """NEXTN with GLM-4.7-Flash's (latent) and GLM-4.5's (grouped-query) multi-token-prediction layers, read from
    the mtp.safetensors beside the index, in CUDA graphs: transformers' greedy tokens, drafts proposed."""
    from tests.parity import test_moe_parity
    from tests.parity.test_deepseek_parity import FAMILIES, _reference, _with_mtp, write_family
    from tests.parity.test_moe_parity import MAX_NEW as REF_NEW
    from tests.parity.test_moe_parity import PROMPTS

    src = write_family(family, tmp_path / "src") if family in FAMILIES else \
        test_moe_parity.write_family(family, tmp_path / "src")
    path, _ = _with_mtp(src, tmp_path, family, apart=True)
    refs, _ = _reference(src)
    with running_engine(path, device="cuda", dtype="float32", skip_tokenizer_init=True, speculative_algorithm="NEXTN",
                        speculative_num_steps=3) as llm:
        assert llm.runner.graphs is not None
        outs = llm.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": REF_NEW, "temperature": 0})
        assert_no_leak(llm)
    assert [o["output_ids"] for o in outs] == refs
    assert all(o["meta_info"]["spec_draft_token_num"] > 0 for o in outs)
