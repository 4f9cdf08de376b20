"""Multi-LoRA on CUDA (issue 54): the Triton kernels against their twin at the Llama-3.1-8B shapes, and inside a CUDA
graph that replays whichever adapters its static slots name; the engine with CUDA graphs on, float32, Triton and
torch_native attention, token-exact with transformers + peft, with adapters and the base in one batch and more
adapters than device slots (evicted and copied back), the same tokens as with graphs off; nothing leaks."""

from __future__ import annotations

import pytest
import torch

from radixmesh.kernels.lora import lora_apply, lora_apply_reference, lora_layout
from tests.conftest import model_path
from tests.engine_utils import assert_no_leak, parity_prompts, running_engine
from tests.kernels.test_lora import TOLERANCE, make_case
from tests.parity.test_lora import ADAPTERS, MORE, NAME, NEW, peft_greedy, write_adapter
from tests.reference import hf_greedy

pytestmark = pytest.mark.gpu

HIDDEN, INTER, KV = 4096, 14336, 1024  # Llama-3.1-8B
SHAPES_8B = {"qkv": (HIDDEN, [HIDDEN, KV, KV]), "o": (HIDDEN, [HIDDEN]), "gate_up": (HIDDEN, [INTER, INTER]),
             "down": (INTER, [HIDDEN])}


@pytest.mark.parametrize("module", list(SHAPES_8B))
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_kernels_match_the_twin_at_the_8b_shapes(module, rows):
    k, widths = SHAPES_8B[module]
    x, a, b, scalings, slots, out, slices = make_case(rows, k, widths, 8, 16, torch.bfloat16, seed=rows)
    want = lora_apply_reference(*(t.cuda() for t in (x, a, b, scalings, slots)), slices, out.cuda())
    got = lora_apply(*(t.cuda() for t in (x, a, b, scalings)), lora_layout(slots.cuda(), 8), slices, out.cuda())
    torch.testing.assert_close(got, want, **TOLERANCE[torch.bfloat16])


def test_a_captured_graph_replays_whatever_adapters_its_slots_name():
    """One capture; replays with other slots per row (every adapter, one, none) equal eager forwards bit for bit."""
    x, a, b, scalings, slots, out, slices = (t.cuda() if isinstance(t, torch.Tensor) else t for t in
                                             make_case(48, 512, [256, 64, 64], 4, 16, torch.bfloat16, seed=1))
    static_slots = torch.full((48,), -1, dtype=torch.int32, device="cuda")
    static_out = torch.empty_like(out)

    def step():
        static_out.copy_(out)
        lora_apply(x, a, b, scalings, lora_layout(static_slots, 4), slices, static_out)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    for mix in (slots, torch.full_like(slots, 2), torch.full_like(slots, -1), slots.flip(0)):
        static_slots.copy_(mix)
        graph.replay()
        eager = lora_apply(x, a, b, scalings, lora_layout(mix, 4), slices, out.clone())
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager)


@pytest.fixture(scope="module")
def adapter_paths(tmp_path_factory) -> dict[str, str]:
    base = model_path(NAME)
    root = tmp_path_factory.mktemp("lora-cuda")
    return {name: write_adapter(base, root / name, r, a, t, rs, seed=i)
            for i, (name, r, a, t, rs) in enumerate([*ADAPTERS, *MORE])}


@pytest.mark.parametrize("backend,side,reduce", [("triton", True, True), ("triton", False, False),
                                                 ("torch_native", True, True)])
def test_adapters_and_the_base_in_cuda_graphs_match_peft(backend, side, reduce, adapter_paths, monkeypatch):
    """Two adapters and the base in one batch, decode in CUDA graphs where the backend has them (float32): peft's
    tokens, by default (the shrinks on a side stream beside the base products, engine.lora.batch; a decode batch's
    K parts summed by the shrink, kernels.lora.REDUCE_DECODE_PARTIALS) and with both turned off."""
    from radixmesh.engine.lora import batch as lora_batch
    from radixmesh.kernels import lora as lora_kernels

    monkeypatch.setattr(lora_batch, "_side_streams", {})
    if side:
        monkeypatch.delenv(lora_batch.SIDE_STREAM_ENV, raising=False)
    else:
        monkeypatch.setenv(lora_batch.SIDE_STREAM_ENV, "0")
    monkeypatch.setattr(lora_kernels, "REDUCE_DECODE_PARTIALS", reduce)
    base = model_path(NAME)
    paths = {n: adapter_paths[n] for n, *_ in ADAPTERS}
    prompts = parity_prompts(base)[:4]
    want = {None: hf_greedy(base, prompts, NEW), **{n: peft_greedy(base, p, prompts) for n, p in paths.items()}}
    with running_engine(base, device="cuda", dtype="float32", attention_backend=backend, enable_lora=True,
                        lora_paths=[f"{n}={p}" for n, p in paths.items()], max_total_tokens=8192,
                        cuda_graph_max_bs=32) as llm:
        graphs = llm.runner.graphs  # (torch_native attention runs no graphs: the LoRA kernels run eagerly there)
        assert (graphs is not None and graphs.lora is not None) == (backend == "triton")
        names = [None, "sql", "chat"] * len(prompts)
        outs = llm.generate(input_ids=[p for p in prompts for _ in range(3)], lora_path=names,
                            sampling_params={"temperature": 0, "max_new_tokens": NEW})
        assert [o["output_ids"] for o in outs] == [want[n][i] for i in range(len(prompts))
                                                   for n in (None, "sql", "chat")]
        # (made by the first batch with adapters: the graphs' capture, or the first eager forward)
        assert (torch.device("cuda", torch.cuda.current_device()) in lora_batch._side_streams) == side
        assert_no_leak(llm)


def _mixed(adapter_paths: dict[str, str], graphs: bool) -> tuple[list[list[int]], int, int]:
    """Outputs of four adapters and the base over two device slots, how many decode forwards replayed a graph, and
    how many adapters were evicted."""
    base = model_path(NAME)
    prompts = parity_prompts(base)
    order = [(n, p) for p in prompts[:6] for n in [*adapter_paths, None]]
    with running_engine(base, device="cuda", dtype="float32", enable_lora=True, max_loras_per_batch=2,
                        max_loaded_loras=4, lora_paths=[f"{n}={p}" for n, p in adapter_paths.items()],
                        max_total_tokens=8192, chunked_prefill_size=64, cuda_graph_max_bs=32,
                        disable_cuda_graph=not graphs) as llm:
        replays = 0
        if graphs:
            replay = llm.runner.graphs.replay

            def counted(batch):
                nonlocal replays
                replays += 1
                return replay(batch)

            llm.runner.graphs.replay = counted
        outs = llm.generate(input_ids=[p for _, p in order], lora_path=[n for n, _ in order],
                            sampling_params={"temperature": 0, "max_new_tokens": NEW})
        lora = llm.runner.lora
        assert sum(lora.in_use) == 0
        assert_no_leak(llm)
        return [o["output_ids"] for o in outs], replays, lora.pool.evictions


def test_cuda_graphs_equal_eager_with_adapters_evicted_and_copied_back(adapter_paths):
    eager, _, _ = _mixed(adapter_paths, graphs=False)
    graphed, replays, evictions = _mixed(adapter_paths, graphs=True)
    assert replays > 0 and evictions > 0
    assert graphed == eager
    base = model_path(NAME)
    prompts = parity_prompts(base)[:6]
    want = {n: peft_greedy(base, p, prompts) for n, p in adapter_paths.items()}
    want[None] = hf_greedy(base, prompts, NEW)
    assert graphed == [want[n][i] for i in range(len(prompts)) for n in [*adapter_paths, None]]


def test_a_mixture_of_experts_attention_adapter_in_cuda_graphs_matches_peft(tmp_path):
    """tiny-qwen3-moe with an adapter of its attention projections, decode in CUDA graphs (float32, the experts on
    the Triton grouped GEMMs): peft's tokens, beside the base model's."""
    base = model_path("tiny-qwen3-moe")
    adapter = write_adapter(base, tmp_path / "attn", 4, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False, seed=7)
    prompts = parity_prompts(base)[:6]
    want = peft_greedy(base, adapter, prompts) + hf_greedy(base, prompts, NEW)
    with running_engine(base, device="cuda", dtype="float32", enable_lora=True, lora_paths=[f"attn={adapter}"],
                        max_total_tokens=8192, cuda_graph_max_bs=32) as llm:
        assert llm.runner.graphs is not None and llm.runner.graphs.lora is not None
        outs = llm.generate(input_ids=prompts * 2, lora_path=["attn"] * len(prompts) + [None] * len(prompts),
                            sampling_params={"temperature": 0, "max_new_tokens": NEW})
        assert [o["output_ids"] for o in outs] == want
        assert_no_leak(llm)


@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE-tree"])
def test_adapters_with_speculative_decoding_in_cuda_graphs_match_peft(adapter_paths, algorithm, tmp_path):
    """Verify rows (a chain's, or a draft tree's in the tree graphs) run their request's adapter in CUDA graphs
    (float32): peft's tokens beside the base model's."""
    from tests.parity.test_speculative_eagle import write_head

    base = model_path(NAME)
    paths = {n: adapter_paths[n] for n, *_ in ADAPTERS}
    prompts = parity_prompts(base)[:3]
    want = {None: hf_greedy(base, prompts, NEW), **{n: peft_greedy(base, p, prompts) for n, p in paths.items()}}
    spec = {"speculative_algorithm": "NGRAM"} if algorithm == "NGRAM" else {
        "speculative_algorithm": "EAGLE", "speculative_eagle_topk": 2, "speculative_num_steps": 2,
        "speculative_draft_model_path": write_head(tmp_path / "head", base, "eagle")}
    with running_engine(base, device="cuda", dtype="float32", enable_lora=True, max_total_tokens=8192,
                        lora_paths=[f"{n}={p}" for n, p in paths.items()], cuda_graph_max_bs=32,
                        speculative_num_draft_tokens=4, **spec) as llm:
        assert llm.runner.graphs is not None and llm.runner.graphs.lora is not None
        names = [None, "sql", "chat"] * len(prompts)
        outs = llm.generate(input_ids=[p for p in prompts for _ in range(3)], lora_path=names,
                            sampling_params={"temperature": 0, "max_new_tokens": NEW})
        assert [o["output_ids"] for o in outs] == [want[n][i] for i in range(len(prompts))
                                                   for n in (None, "sql", "chat")]
        assert_no_leak(llm)
