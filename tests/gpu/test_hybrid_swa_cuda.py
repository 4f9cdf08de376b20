"""Hybrid SWA memory on CUDA (engine.cache.swa_pool): Gemma 2 and Gemma 3's sliding layers in a pool of their own, read
through their own page table by the Triton kernels (and FlashInfer's window page lists) and written through the
full-slot -> SWA-slot map inside captured CUDA graphs, with a pool small enough that cached pages lose their SWA
partners and hits are cut back (tests/parity/test_hybrid_swa_memory.py is the CPU twin).

float32 (Triton, torch_native): transformers' greedy tokens and teacher-forced logprobs within 1e-3. bfloat16
(Triton, FlashInfer): within bfloat16 noise of transformers' float32 logprobs. Both pools whole after every run.

CUDA engines keep one pool until these pass on a GPU with every backend (swa_pool.why_no_hybrid says what is
missing), so the hybrid tests lift that gate for their engines (`hybrid_allowed`), and `test_cuda_keeps_one_pool`
checks that the gate holds and that one pool matches transformers. On an H100 (2026-12-05) every float32 case and
the bfloat16 Triton cases passed (FlashInfer was not installed). An H200's Gemma 2 failures a day before were the
reference's: transformers 5.17 runs Gemma 2 through SDPA, which drops the soft-cap (tests.reference.hf_model asks
for eager attention wherever scores are capped)."""

from __future__ import annotations

import pytest
import torch

from tests.engine_utils import running_engine
from tests.reference import hf_greedy
from tests.sliding_models import BF16_BACKENDS, build, logprob_errors, prompts

pytestmark = pytest.mark.gpu

GREEDY = {"max_new_tokens": 40, "temperature": 0}
# a 2048-token full pool and a 192-token SWA pool: every prompt's cached window competes for it
SMALL = dict(max_total_tokens=2048, swa_full_tokens_ratio=0.09375, page_size=16, chunked_prefill_size=32)


@pytest.fixture
def hybrid_allowed(monkeypatch):
    """The hybrid pool on CUDA despite swa_pool.why_no_hybrid's CUDA gate (the engine is built in this process, so
    the runner's reference is the one to replace)."""
    from radixmesh.engine import model_runner
    from radixmesh.engine.cache import swa_pool

    def without_cuda_gate(args, shares_table):
        why = swa_pool.why_no_hybrid(args, shares_table)
        return None if why is not None and why.startswith("a CUDA device") else why

    monkeypatch.setattr(model_runner, "why_no_hybrid", without_cuda_gate)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrid-swa-cuda")
    return {kind: build(kind, root / kind, head_dim=64) for kind in ("gemma2", "gemma3")}


def _generate(path: str, **kwargs) -> list[dict]:
    with running_engine(path, device="cuda", skip_tokenizer_init=True, mem_fraction_static=0.3, **SMALL,
                        **kwargs) as llm:
        assert llm.cache.hybrid is not None and llm.cache.hybrid.swa.num_pages == 12
        first = llm.generate(input_ids=prompts(), sampling_params=GREEDY, return_logprob=True)
        again = llm.generate(input_ids=prompts(), sampling_params=GREEDY, return_logprob=True)
        torch.cuda.synchronize()
        assert llm.cache.hybrid.freed_tokens > 0 and llm.cache.hybrid.evicted_tokens > 0
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in first]
    return first


@pytest.mark.parametrize("kind", ("gemma2", "gemma3"))
def test_cuda_keeps_one_pool(checkpoints, kind):
    """Until the hybrid pool passes here with every backend, a CUDA engine serves alternating models from one
    pool, as transformers."""
    path = checkpoints[kind]
    with running_engine(path, device="cuda", skip_tokenizer_init=True, mem_fraction_static=0.3, dtype="float32",
                        attention_backend="triton", **SMALL) as llm:
        assert llm.cache.hybrid is None
        outs = llm.generate(input_ids=prompts(), sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == hf_greedy(path, prompts(), GREEDY["max_new_tokens"])


@pytest.mark.usefixtures("hybrid_allowed")
@pytest.mark.parametrize("kind", ("gemma2", "gemma3"))
@pytest.mark.parametrize("backend,graphs", [("triton", True), ("triton", False), ("torch_native", False)])
def test_float32_matches_transformers(checkpoints, kind, backend, graphs):
    path = checkpoints[kind]
    outs = _generate(path, dtype="float32", attention_backend=backend, disable_cuda_graph=not graphs)
    assert [o["output_ids"] for o in outs] == hf_greedy(path, prompts(), GREEDY["max_new_tokens"])
    assert max(logprob_errors(path, outs)) < 1e-3


@pytest.mark.usefixtures("hybrid_allowed")
@pytest.mark.parametrize("prefill,decode", BF16_BACKENDS)
@pytest.mark.parametrize("graphs", [True, False])
def test_bfloat16_within_noise_of_transformers(checkpoints, prefill, decode, graphs):
    path = checkpoints["gemma2"]
    outs = _generate(path, dtype="bfloat16", attention_backend=prefill, decode_attention_backend=decode,
                     disable_cuda_graph=not graphs)
    errors = logprob_errors(path, outs)
    assert max(errors) < 0.25 and sum(errors) / len(errors) < 0.05, (max(errors), sum(errors) / len(errors))


@pytest.mark.usefixtures("hybrid_allowed")
@pytest.mark.parametrize("graphs", [True, False])
def test_bfloat16_gemma2_repeats_itself_over_cached_prefixes(checkpoints, graphs):
    """The case that failed on an H100 (2026-12-05; Triton, no graphs, the hybrid pool at the sizes
    test_sliding_window_cuda.py's engines get): the second run over the cached prefixes chose other greedy tokens
    (prompt 1 from its fourth). test_sliding_window_cuda.py runs the same engine with one pool."""
    path, greedy = checkpoints["gemma2"], {"max_new_tokens": 16, "temperature": 0}  # as that file's
    with running_engine(path, device="cuda", skip_tokenizer_init=True, mem_fraction_static=0.3, page_size=16,
                        chunked_prefill_size=32, dtype="bfloat16", attention_backend="triton",
                        disable_cuda_graph=not graphs) as llm:
        assert llm.cache.hybrid is not None
        first = llm.generate(input_ids=prompts(), sampling_params=greedy, return_logprob=True)
        again = llm.generate(input_ids=prompts(), sampling_params=greedy, return_logprob=True)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in first]
    errors = logprob_errors(path, first)
    assert max(errors) < 0.25 and sum(errors) / len(errors) < 0.05, (max(errors), sum(errors) / len(errors))
