"""GPT-OSS on CUDA: the defaults a GPU picks (Triton attention with the sinks, the Triton expert runner with the biases
and the clamped SwiGLU, decode in CUDA graphs), token-exact with transformers in float32 (logprobs within 1e-3), one
request at a time (batch-1 graphs) and in a batch (a padded graph); bfloat16 near float32's choices. The tiny checkpoint is tests/parity/test_gpt_oss_parity's (sinks, a 6-token window) with the published SwiGLU
limit, 7, and experts' weights large enough for it to bite: transformers before 5.25 (the GPU machine's 5.17) ignores
the config's swiglu_limit and swiglu_alpha for 7 and 1.702, so a checkpoint with another limit has two references."""

from __future__ import annotations

import pytest

from tests.engine_utils import assert_no_leak, running_engine
from tests.parity.test_gpt_oss_parity import write_gpt_oss
from tests.parity.test_model_families_more import PROMPTS
from tests.reference import hf_greedy, hf_token_logprobs

pytestmark = pytest.mark.gpu
MAX_NEW = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_gpt_oss(tmp_path_factory.mktemp("gpt_oss"), swiglu_limit=7.0, expert_std=0.4)


def test_the_checkpoint_depends_on_the_clamp_sinks_and_biases(checkpoint):
    from tests.parity.test_gpt_oss_parity import _tokens_without

    refs = hf_greedy(checkpoint, PROMPTS, MAX_NEW)
    assert all(_tokens_without(checkpoint, what) != refs for what in ("clamp", "sinks", "biases"))


def _matches_transformers(path: str, reference: str, check=lambda llm: None) -> None:
    """`path` on the GPU's defaults in float32, in a batch and one request at a time, against transformers on
    `reference`: its tokens, logprobs within 1e-3, no KV page leaked; `check(llm)` looks at the engine."""
    refs = hf_greedy(reference, PROMPTS, MAX_NEW)
    greedy = {"max_new_tokens": MAX_NEW, "temperature": 0}
    with running_engine(path, device="cuda", dtype="float32", skip_tokenizer_init=True,
                        disable_radix_cache=True) as llm:
        assert llm.args.decode_attention_backend == llm.args.prefill_attention_backend == "triton"
        assert llm.args.moe_runner_backend == "triton" and llm.runner.graphs is not None
        check(llm)
        batch = llm.generate(input_ids=PROMPTS, sampling_params=greedy, return_logprob=True)
        alone = [llm.generate(input_ids=p, sampling_params=greedy) for p in PROMPTS[:2]]
        assert_no_leak(llm)
    assert [o["output_ids"] for o in batch] == refs
    assert [o["output_ids"] for o in alone] == refs[:2]
    for p, out, ref in zip(PROMPTS, batch, refs):
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(hf_token_logprobs(reference, p, ref), abs=1e-3)


def test_gpt_oss_in_cuda_graphs_matches_transformers(checkpoint):
    _matches_transformers(checkpoint, checkpoint)


def _bfloat16_near_float32(path: str, reference: str, check=lambda llm: None) -> None:
    """`path` on the GPU in bfloat16, in a batch and one request at a time, judged against transformers in float32 on
    `reference` fed the same tokens: every token within 1 nat of the reference's best, and at least 3 in 4 its best.
    (bfloat16 greedy paths part from float32's at near ties: on CPU, plain torch in bfloat16 picked a token 0.9 nat
    below the best on the clamp-biting checkpoint, so this judges a gentler one; a wrong kernel misses by nats.)"""
    from tests.reference import hf_argmax_gaps

    greedy = {"max_new_tokens": MAX_NEW, "temperature": 0}
    with running_engine(path, device="cuda", dtype="bfloat16", skip_tokenizer_init=True) as llm:
        check(llm)
        outs = [o["output_ids"] for o in llm.generate(input_ids=PROMPTS, sampling_params=greedy)]
        outs += [llm.generate(input_ids=p, sampling_params=greedy)["output_ids"] for p in PROMPTS[:2]]
    gaps = [g for p, out in zip(PROMPTS + PROMPTS[:2], outs) for g in hf_argmax_gaps(reference, p, out)]
    assert max(gaps) <= 1.0 and sum(g == 0.0 for g in gaps) >= 0.75 * len(gaps), [round(g, 3) for g in gaps]


@pytest.fixture(scope="module")
def gentle(tmp_path_factory) -> str:
    """The checkpoint with experts' weights small enough that bfloat16 rounding rarely flips a greedy token."""
    return write_gpt_oss(tmp_path_factory.mktemp("gpt_oss_gentle"), swiglu_limit=7.0)


def test_gpt_oss_in_bfloat16_stays_near_float32(gentle):
    _bfloat16_near_float32(gentle, gentle)


def test_an_mxfp4_checkpoint_held_in_mxfp4_in_cuda_graphs_matches_its_twin(checkpoint, tmp_path_factory):
    """The MXFP4 checkpoint our writer makes: its experts held as codes and scales on the GPU (kernels.moe_mxfp4's
    grouped GEMMs for the prefill, its few-token launches for a lone request's graphs), token-exact in float32 with
    transformers on the dequantized twin, logprobs within 1e-3."""
    import torch

    from radixmesh.engine.quantization import mxfp4

    root = tmp_path_factory.mktemp("mxfp4")
    q = mxfp4.write_checkpoint(checkpoint, str(root / "mxfp4"))

    def held(llm) -> None:
        experts = [m for n, m in llm.runner.model.named_modules() if n.endswith("mlp.experts")]
        assert experts and all(m.w13.q.dtype == torch.uint8 and m.w13.q.is_cuda for m in experts)
    _matches_transformers(q, mxfp4.dequantized_checkpoint(q, str(root / "twin")), held)


def test_an_mxfp4_checkpoint_in_bfloat16_stays_near_its_float32_twin(gentle, tmp_path_factory):
    """In bfloat16 the held experts take Triton's microscaled products (kernels.moe_mxfp4: the few-token launches in
    a lone request's graphs, the grouped GEMMs for the prefill)."""
    from radixmesh.engine.quantization import mxfp4

    root = tmp_path_factory.mktemp("mxfp4_bf16")
    q = mxfp4.write_checkpoint(gentle, str(root / "mxfp4"))

    def held(llm) -> None:
        assert all(m.w13.q.is_cuda for n, m in llm.runner.model.named_modules() if n.endswith("mlp.experts"))
    _bfloat16_near_float32(q, mxfp4.dequantized_checkpoint(q, str(root / "twin")), held)
