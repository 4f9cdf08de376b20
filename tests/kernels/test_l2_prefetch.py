"""kernels.l2_prefetch (a tensor pulled into L2 by the copy engine) and engine.layers.linear.prefetch_weight (a decode
graph's o_proj weight pulled in while attention runs). Off a Hopper GPU it must do nothing at all (its PTX is checked
in test_sm90_compile); on one, a prefetch inside a graph replayed under programmatic dependent launch must leave the
stream's order intact, and a model decoding with it gives the tokens it gives without."""

from __future__ import annotations

import pytest
import torch

from engine.layers import linear
from kernels.l2_prefetch import prefetch_l2
from kernels.runtime import pdl_supported


def test_off_a_hopper_gpu_it_does_nothing():
    t = torch.randn(1000)
    before = t.clone()
    prefetch_l2(t)  # a CPU tensor: no kernel, no error
    prefetch_l2(t[::2])  # not even the layout is asked about where nothing would run
    assert torch.equal(t, before)


def test_prefetch_weight_is_off_by_default_and_only_for_decode_batches(monkeypatch):
    import kernels.l2_prefetch as l2

    calls = []
    monkeypatch.setattr(l2, "prefetch_l2", calls.append)
    w = torch.empty(64, 64)
    linear.prefetch_weight(w, torch.empty(1, 64))
    assert not linear.PREFETCH_WEIGHTS and calls == []
    monkeypatch.setattr(linear, "PREFETCH_WEIGHTS", True)
    linear.prefetch_weight(w, torch.empty(1, 64))  # a CPU tensor: no kernels there
    assert calls == []


hopper = pytest.mark.skipif(not pdl_supported(), reason="needs a Hopper GPU and a Triton with gdc_wait")


@pytest.mark.gpu
@hopper
def test_a_prefetch_between_dependent_kernels_keeps_their_order():
    """gemv -> prefetch -> gemv of the first's output, each launched as a programmatic dependent in a CUDA graph: the
    second product must see the first's finished output on every replay (the prefetch kernel waits for the kernel
    before it before it ends, so the one after it, which waits for it, comes after that one). The first product is
    a large one, so a prefetch kernel that ended without waiting would let the second start early."""
    from kernels.gemv import gemv

    g = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn((28672, 4096), device="cuda", dtype=torch.bfloat16, generator=g) / 64
    small = torch.randn((4096, 28672), device="cuda", dtype=torch.bfloat16, generator=g) / 64
    x = torch.randn((1, 4096), device="cuda", dtype=torch.bfloat16, generator=g)
    with pytest.raises(ValueError, match="contiguous"):
        prefetch_l2(big[:, ::2])
    mid = torch.empty((1, 28672), device="cuda", dtype=torch.bfloat16)
    out = torch.empty((1, 4096), device="cuda", dtype=torch.bfloat16)

    def step():
        gemv(x, big, out=mid, pdl=True)
        prefetch_l2(small)
        gemv(mid, small, out=out, pdl=True)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(5):
        x.copy_(torch.randn((1, 4096), generator=torch.Generator().manual_seed(seed + 1)).to(x))
        mid.zero_()
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(mid, gemv(x, big))
        assert torch.equal(out, gemv(gemv(x, big), small))


@pytest.mark.gpu
@hopper
def test_a_model_decodes_the_same_tokens_with_its_weights_prefetched(monkeypatch):
    """The tiny Llama in bfloat16 with decode graphs: greedy tokens with each layer's o_proj weight prefetched equal
    those without, and the prefetch was captured into the graphs (once per layer per captured batch size <=
    SKINNY_ROWS)."""
    import kernels.l2_prefetch as l2
    from tests.engine_utils import parity_prompts, running_engine

    path = "models/tiny-llama"
    prompts = parity_prompts(path)
    greedy = {"max_new_tokens": 16, "temperature": 0}
    kw = dict(device="cuda", dtype="bfloat16", mem_fraction_static=0.3, page_size=16, attention_backend="triton")
    with running_engine(path, **kw) as llm:
        want = [o["output_ids"] for o in llm.generate(input_ids=prompts, sampling_params=greedy)]
    launched = []
    real = l2.prefetch_l2
    monkeypatch.setattr(l2, "prefetch_l2", lambda t: (launched.append(tuple(t.shape)), real(t)))
    monkeypatch.setattr(linear, "PREFETCH_WEIGHTS", True)
    with running_engine(path, **kw) as llm:
        got = [o["output_ids"] for o in llm.generate(input_ids=prompts, sampling_params=greedy)]
        model = llm.runner.model
    assert got == want
    o_proj = tuple(model.model.layers[0].self_attn.o_proj.weight.shape)
    assert launched and set(launched) == {o_proj}
    assert len(launched) % len(model.model.layers) == 0
