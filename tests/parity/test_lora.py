"""Multi-LoRA (issue 54), engine side: adapters written by peft itself (random A and B, so every adapted projection
moves the outputs) served in one batch with the base model, token-exact with transformers + peft in float32; the
prefix cache keeps each adapter's KV apart; adapters load and unload at run time; a mixture of experts' attention is
adapted; what cannot be served right is refused with the reason."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import model_path
from tests.engine_utils import assert_no_leak, parity_prompts, running_engine
from tests.reference import eos_ids, hf_greedy

NAME = "tiny-llama"
NEW = 16
# (name, rank, alpha, targets, rslora): different ranks, different projections, fused and plain
ADAPTERS = [("sql", 4, 8, ["q_proj", "v_proj", "down_proj"], False),
            ("chat", 8, 32, ["k_proj", "o_proj", "gate_proj", "up_proj"], True)]


def write_adapter(base: str, out, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, use_rslora=rslora,
                        init_lora_weights=False)  # random B as well: the adapter changes what the model says
    get_peft_model(model, config).save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    base = model_path(NAME)
    root = tmp_path_factory.mktemp("lora")
    return {name: write_adapter(base, root / name, r, a, t, rs, seed=i)
            for i, (name, r, a, t, rs) in enumerate(ADAPTERS)}


@torch.inference_mode()
def peft_greedy(base: str, adapter: str, prompts: list[list[int]]) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    stops = eos_ids(model.base_model.model)
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        toks = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=NEW, pad_token_id=0)[0, len(p):].tolist()
        outs.append(toks[:next((i + 1 for i, t in enumerate(toks) if t in stops), len(toks))])
    return outs


def test_adapters_and_the_base_in_one_batch_match_transformers_and_peft(adapters):
    base = model_path(NAME)
    prompts = parity_prompts(base)[:6]
    want = {None: hf_greedy(base, prompts, NEW), **{n: peft_greedy(base, p, prompts) for n, p in adapters.items()}}
    assert want["sql"] != want[None] and want["chat"] != want[None]  # the adapters do change the outputs
    paths = [f"{n}={p}" for n, p in adapters.items()]
    with running_engine(base, enable_lora=True, lora_paths=paths, page_size=4, chunked_prefill_size=32) as llm:
        assert llm.lora_adapters() == ["chat", "sql"]
        # every prompt under every adapter and the base, mixed in one batch
        names = [None, "sql", "chat"] * len(prompts)
        batch = [p for p in prompts for _ in range(3)]
        outs = llm.generate(input_ids=batch, sampling_params={"temperature": 0, "max_new_tokens": NEW},
                            lora_path=names)
        got = [o["output_ids"] for o in outs]
        assert got == [want[n][i] for i in range(len(prompts)) for n in (None, "sql", "chat")]
        # again: the prefix cache is hit, but only within an adapter (an adapter's KV is its own)
        again = llm.generate(input_ids=batch, sampling_params={"temperature": 0, "max_new_tokens": NEW},
                             lora_path=names)
        assert [o["output_ids"] for o in again] == got
        # (the 3-token prompt fills no page of 4)
        assert all(o["meta_info"]["cached_tokens"] > 0 for o, p in zip(again, batch) if len(p) > 4)
        assert_no_leak(llm)


def test_an_adapters_kv_is_never_shared_with_the_base_or_another(adapters):
    base = model_path(NAME)
    prompt = parity_prompts(base)[2]
    with running_engine(base, enable_lora=True, lora_paths=[f"{n}={p}" for n, p in adapters.items()]) as llm:
        params = {"temperature": 0, "max_new_tokens": 4}
        first = llm.generate(input_ids=prompt, sampling_params=params)
        assert first["meta_info"]["cached_tokens"] == 0
        for name in ("sql", "chat"):  # the same prompt under each adapter: nothing cached for it yet
            assert llm.generate(input_ids=prompt, sampling_params=params, lora_path=name)[
                "meta_info"]["cached_tokens"] == 0
        assert llm.generate(input_ids=prompt, sampling_params=params, lora_path="sql")["meta_info"][
            "cached_tokens"] > 0


def test_adapters_load_and_unload_at_run_time(adapters):
    base = model_path(NAME)
    prompt = parity_prompts(base)[1]
    want = peft_greedy(base, adapters["chat"], [prompt])[0]
    params = {"temperature": 0, "max_new_tokens": NEW}
    with running_engine(base, enable_lora=True, max_lora_rank=8, max_loaded_loras=1) as llm:
        assert llm.lora_adapters() == []
        with pytest.raises(ValueError, match="unknown LoRA adapter 'chat'"):
            llm.generate(input_ids=prompt, sampling_params=params, lora_path="chat")
        llm.load_lora_adapter("chat", adapters["chat"])
        assert llm.generate(input_ids=prompt, sampling_params=params, lora_path="chat")["output_ids"] == want
        with pytest.raises(ValueError, match="1 LoRA adapters are loaded"):
            llm.load_lora_adapter("sql", adapters["sql"])
        with pytest.raises(ValueError, match="already loaded"):
            llm.load_lora_adapter("chat", adapters["chat"])
        # an adapter serving a request is not unloaded under it
        stream = llm.generate(input_ids=prompt, sampling_params={**params, "max_new_tokens": 200, "ignore_eos": True},
                              lora_path="chat", stream=True)
        next(stream)
        with pytest.raises(ValueError, match="unfinished request"):
            llm.unload_lora_adapter("chat")
        for _ in stream:
            pass
        llm.unload_lora_adapter("chat")
        assert llm.lora_adapters() == []
        llm.load_lora_adapter("sql", adapters["sql"])  # the freed slot takes another adapter
        assert llm.generate(input_ids=prompt, sampling_params=params, lora_path="sql")["output_ids"] == \
            peft_greedy(base, adapters["sql"], [prompt])[0]
        assert_no_leak(llm)


def _edit_config(src: str, dst, **changes) -> str:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_what_cannot_be_served_right_is_refused(adapters, tmp_path):
    base = model_path(NAME)
    with pytest.raises(ValueError, match="rank 8 is over --max-lora-rank 4"):
        with running_engine(base, enable_lora=True, max_lora_rank=4, lora_paths=[f"chat={adapters['chat']}"]):
            pass
    with pytest.raises(ValueError, match="use_dora=true"):
        with running_engine(base, enable_lora=True, max_lora_rank=8,
                            lora_paths=[f"d={_edit_config(adapters['sql'], tmp_path / 'dora', use_dora=True)}"]):
            pass
    with pytest.raises(ValueError, match="outside --lora-target-modules"):
        with running_engine(base, enable_lora=True, lora_target_modules=["q_proj", "v_proj"],
                            lora_paths=[f"chat={adapters['chat']}"]):
            pass
    with pytest.raises(ValueError, match="needs enable_lora"):
        with running_engine(base, lora_paths=[f"chat={adapters['chat']}"]):
            pass
    # an adapter for another base model (other shapes): refused, nothing loaded
    other = model_path("tiny-qwen3")
    with running_engine(other, enable_lora=True, max_lora_rank=8) as llm:
        with pytest.raises(ValueError, match="do not fit this base model"):
            llm.load_lora_adapter("chat", adapters["chat"])
        assert llm.lora_adapters() == []
    with running_engine(base) as llm:
        with pytest.raises(ValueError, match="needs an engine started with enable_lora"):
            llm.generate(input_ids=[1, 2, 3], lora_path="chat")



def test_max_loras_per_batch_keeps_other_adapters_waiting(adapters):
    """With --max-loras-per-batch 1, requests of a second adapter wait until the first's are done: no forward runs
    two adapters, and every output is still peft's."""
    base = model_path(NAME)
    prompts = parity_prompts(base)[1:4]
    want = {n: peft_greedy(base, p, prompts) for n, p in adapters.items()}
    with running_engine(base, enable_lora=True, max_loras_per_batch=1,
                        lora_paths=[f"{n}={p}" for n, p in adapters.items()]) as llm:
        seen = []
        forward = llm.runner.forward

        def record(batch):
            seen.append({s for s in batch.lora_slots or () if s})
            return forward(batch)

        llm.runner.forward = record
        names = ["sql", "chat"] * len(prompts)
        outs = llm.generate(input_ids=[p for p in prompts for _ in range(2)], lora_path=names,
                            sampling_params={"temperature": 0, "max_new_tokens": NEW})
        assert [o["output_ids"] for o in outs] == [want[n][i] for i in range(len(prompts)) for n in ("sql", "chat")]
        assert max(map(len, seen)) == 1 and len(set().union(*seen)) == 2
        assert_no_leak(llm)


# two more adapters for the device-slot tests: the highest rank (every projection) and the lowest
MORE = [("math", 16, 16, list(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")), False),
        ("code", 2, 4, ["v_proj", "up_proj", "down_proj"], False)]


@pytest.fixture(scope="module")
def four_adapters(adapters, tmp_path_factory) -> dict[str, str]:
    base = model_path(NAME)
    root = tmp_path_factory.mktemp("lora-more")
    more = {name: write_adapter(base, root / name, r, a, t, rs, seed=10 + i)
            for i, (name, r, a, t, rs) in enumerate(MORE)}
    return {**adapters, **more}


def test_more_adapters_than_device_slots_are_evicted_and_copied_back(four_adapters):
    """Four adapters, two device slots (--max-loras-per-batch 2): adapters move in and out of the slots as the
    requests of each run, least recently used first, and every output is still peft's; a long prompt prefilled in
    chunks counts as running (no forward mixes more than two); every adapter is let go of at the end."""
    base = model_path(NAME)
    prompts = parity_prompts(base)
    chosen = [prompts[7], prompts[1], prompts[2], prompts[3]]  # the first (300 tokens) runs in chunks of 32
    names = list(four_adapters)
    want = {n: peft_greedy(base, four_adapters[n], chosen) for n in names}
    want[None] = hf_greedy(base, chosen, NEW)
    order = [(n, i) for i in range(len(chosen)) for n in [*names, None]]
    with running_engine(base, enable_lora=True, max_loras_per_batch=2, max_loaded_loras=4, chunked_prefill_size=32,
                        page_size=4, lora_paths=[f"{n}={p}" for n, p in four_adapters.items()]) as llm:
        lora = llm.runner.lora
        seen = []
        forward = llm.runner.forward

        def record(batch):
            seen.append({s for s in batch.lora_slots or () if s})
            return forward(batch)

        llm.runner.forward = record
        outs = llm.generate(input_ids=[chosen[i] for _, i in order], lora_path=[n for n, _ in order],
                            sampling_params={"temperature": 0, "max_new_tokens": NEW})
        assert [o["output_ids"] for o in outs] == [want[n][i] for n, i in order]
        assert max(map(len, seen)) == 2 and len(set().union(*seen)) == 4
        assert lora.pool.evictions >= 2 and lora.pool.loads >= 4
        assert sum(lora.in_use) == 0  # every request let go of its adapter
        assert len(lora.pool.resident) + len(lora.pool.free) == 2
        assert_no_leak(llm)


def test_an_unloaded_adapters_device_slot_goes_to_the_next(four_adapters):
    """Unloading an adapter frees its device slot; one loaded after it runs there, token-exact."""
    base = model_path(NAME)
    prompt = parity_prompts(base)[2]
    params = {"temperature": 0, "max_new_tokens": NEW}
    with running_engine(base, enable_lora=True, max_loras_per_batch=1, max_loaded_loras=1, max_lora_rank=16) as llm:
        lora = llm.runner.lora
        for name in ("math", "code"):
            llm.load_lora_adapter(name, four_adapters[name])
            assert llm.generate(input_ids=prompt, sampling_params=params, lora_path=name)["output_ids"] == \
                peft_greedy(base, four_adapters[name], [prompt])[0]
            assert lora.pool.evictions == 0
            llm.unload_lora_adapter(name)
            assert lora.pool.resident == {} and lora.pool.free == [0]


def test_a_graphs_static_slots_give_the_eager_batchs_products(adapters):
    """What a CUDA graph reads (engine.lora.graph), on the CPU: the LoRA batch built once over the static slots, as a
    capture builds it, gives each replay's rows the products of that batch run eagerly, rows past it untouched."""
    from types import SimpleNamespace

    from radixmesh.engine.lora.graph import GraphLora

    base = model_path(NAME)
    with running_engine(base, enable_lora=True, max_loras_per_batch=2,
                        lora_paths=[f"{n}={p}" for n, p in adapters.items()]) as llm:
        lora = llm.runner.lora
        graph = GraphLora(lora, 8, torch.device("cpu"))
        captured = graph.batch(6)
        module = llm.runner.model.model.layers[1].self_attn.qkv_proj.lora
        gen = torch.Generator().manual_seed(0)
        x, out = torch.randn(6, 128, generator=gen), torch.randn(6, module.b.shape[1], generator=gen)
        sql, chat = lora.slot("sql"), lora.slot("chat")
        for ids in ([sql, 0, chat, sql], [chat, chat], None, [0, sql, 0, 0, chat]):
            rows = len(ids) if ids else 3
            graph.fill(SimpleNamespace(batch_size=rows, lora_slots=ids, extend_lens_host=[1] * rows))
            placed = lora.pool.resident
            assert graph.slots.tolist() == [placed[i] if i else -1 for i in ids or []] + [-1] * (8 - len(ids or []))
            eager = lora.batch(ids, [1] * rows)
            want = eager.apply(module, x[:rows], out[:rows].clone()) if eager else out[:rows]
            got = captured.apply(module, x, out.clone())
            assert torch.equal(got[:rows], want) and torch.equal(got[rows:], out[rows:])
            assert not torch.equal(got, out) or not ids


def test_a_decode_role_runs_no_more_adapters_at_once_than_its_device_slots(adapters):
    """Prefill/decode disaggregated (two engines, the fake transfer backend): the decode side pre-allocates a request
    of another adapter only once the running one's are done (--max-loras-per-batch 1: one device slot), and every
    output is still peft's."""
    import asyncio

    from tests.unit.test_pd_handoff import OPTS, Pair

    base = model_path(NAME)
    prompts = parity_prompts(base)[1:4]
    want = {n: peft_greedy(base, p, prompts) for n, p in adapters.items()}
    lora = {"enable_lora": True, "max_loras_per_batch": 1, "lora_paths": [f"{n}={p}" for n, p in adapters.items()]}
    with running_engine(base, **OPTS, **lora) as prefill, running_engine(base, **OPTS, **lora) as decode:
        seen = []
        forward = decode.runner.forward

        def record(batch):
            seen.append({s for s in batch.lora_slots or () if s})
            return forward(batch)

        decode.runner.forward = record
        pair = Pair(prefill, decode)
        order = [(n, i) for i in range(len(prompts)) for n in adapters]
        params = {"temperature": 0, "max_new_tokens": NEW}

        async def run():
            return await asyncio.gather(*(pair.generate(prompts[i], params, lora_path=n) for n, i in order))

        outs = asyncio.run(run())
        assert [o["output_ids"] for o in outs] == [want[n][i] for n, i in order]
        assert max(map(len, seen)) == 1 and len(set().union(*seen)) == 2
        assert sum(decode.runner.lora.in_use) == 0 and decode.runner.lora.pool.evictions >= 1


def test_lora_target_modules_leave_the_other_projections_without_adapter_weights(adapters):
    """--lora-target-modules q_proj v_proj down_proj: o_proj and gate/up carry no slots and run no LoRA products;
    the adapter of exactly those projections is still peft's."""
    base = model_path(NAME)
    prompts = parity_prompts(base)[2:4]
    with running_engine(base, enable_lora=True, lora_target_modules=["q_proj", "v_proj", "down_proj"],
                        lora_paths=[f"sql={adapters['sql']}"]) as llm:
        layer = llm.runner.model.model.layers[0]
        assert layer.self_attn.o_proj.lora is None and layer.mlp.gate_up_proj.lora is None
        assert layer.self_attn.qkv_proj.lora is not None and layer.mlp.down_proj.lora is not None
        outs = llm.generate(input_ids=prompts, lora_path="sql",
                            sampling_params={"temperature": 0, "max_new_tokens": NEW})
        assert [o["output_ids"] for o in outs] == peft_greedy(base, adapters["sql"], prompts)


def test_a_mixture_of_experts_serves_adapters_of_its_attention(tmp_path):
    """tiny-qwen3-moe: an adapter of the attention projections is served token-exact with transformers + peft beside
    the base model, also with slots for every projection (--lora-target-modules all: layer 1's dense MLP gets them,
    the sparse layers' experts none). peft puts an adapter of the MLP names on a mixture's fused expert parameters
    (target_parameters); that one, and one naming a sparse layer's MLP, are refused with the reason."""
    from safetensors.torch import save_file

    base = model_path("tiny-qwen3-moe")
    adapter = write_adapter(base, tmp_path / "attn", 4, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False, seed=7)
    prompts = parity_prompts(base)[:6]
    params = {"temperature": 0, "max_new_tokens": NEW}
    want = peft_greedy(base, adapter, prompts)
    assert want != hf_greedy(base, prompts, NEW) and sum(map(len, want)) >= 3 * NEW, want  # (changed, and long)
    for targets in (None, ["all"]):
        with running_engine(base, enable_lora=True, lora_paths=[f"attn={adapter}"], lora_target_modules=targets,
                            max_lora_rank=8) as llm:
            outs = llm.generate(input_ids=prompts + prompts, sampling_params=params,
                                lora_path=["attn"] * len(prompts) + [None] * len(prompts))
            assert [o["output_ids"] for o in outs[:len(prompts)]] == want
            assert_no_leak(llm)
    experts = write_adapter(base, tmp_path / "experts", 4, 16, ["q_proj", "gate_proj", "up_proj", "down_proj"], False,
                            seed=8)
    sparse = tmp_path / "sparse"
    sparse.mkdir()
    (sparse / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 16}))
    key = "base_model.model.model.layers.0.mlp.gate_proj"
    save_file({f"{key}.lora_A.weight": torch.zeros(4, 128), f"{key}.lora_B.weight": torch.zeros(64, 4)},
              str(sparse / "adapter_model.safetensors"))
    for path, words in ((experts, "experts, router and shared expert cannot be adapted"),
                        (sparse, "layer 0 of Qwen3MoeForCausalLM is a mixture-of-experts layer")):
        with pytest.raises(ValueError, match=words):
            with running_engine(base, enable_lora=True, lora_paths=[f"x={path}"]):
                pass


def test_adapters_under_tensor_parallelism_match_transformers_and_peft(adapters):
    """--tp-size 2: each rank holds its shard of every adapter (column-parallel projections: B's rows of its heads;
    row-parallel ones: A's columns, its share of B (A x) summed by the all-reduce with the products), token-exact
    with transformers + peft beside the base model; an adapter loaded and unloaded at run time reaches every rank
    (the other rank replays the leader's loads before its next forward)."""
    base = model_path(NAME)
    prompts = parity_prompts(base)[:3]
    want = {n: peft_greedy(base, p, prompts) for n, p in adapters.items()}
    params = {"temperature": 0, "max_new_tokens": NEW}
    with running_engine(base, enable_lora=True, lora_paths=[f"sql={adapters['sql']}"], max_lora_rank=8,
                        lora_target_modules=["all"], tp_size=2) as llm:
        outs = llm.generate(input_ids=prompts * 2, sampling_params=params, lora_path=["sql"] * 3 + [None] * 3)
        assert [o["output_ids"] for o in outs] == want["sql"] + hf_greedy(base, prompts, NEW)
        llm.load_lora_adapter("chat", adapters["chat"])
        outs = llm.generate(input_ids=prompts * 2, sampling_params=params, lora_path=["chat"] * 3 + ["sql"] * 3)
        assert [o["output_ids"] for o in outs] == want["chat"] + want["sql"]
        llm.unload_lora_adapter("sql")
        llm.load_lora_adapter("sql2", adapters["sql"])  # (into the slot "sql" held, on every rank)
        outs = llm.generate(input_ids=prompts, sampling_params=params, lora_path="sql2")
        assert [o["output_ids"] for o in outs] == want["sql"]
        assert_no_leak(llm)


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE", "EAGLE-tree"])
def test_adapters_with_speculative_decoding_match_transformers_and_peft(adapters, algorithm, tmp_path):
    """--speculative-algorithm with adapters (as SGLang serves them: the target model's): every verify row (a chain's
    or a draft tree's) runs its request's adapter, the drafts come from the base model (STANDALONE: the base model
    itself as the draft, so the adapters' requests have drafts rejected and the base's accepted; an EAGLE head reads
    the adapted target's hidden states), and every output is transformers + peft's."""
    from tests.parity.test_speculative_eagle import write_head

    base = model_path(NAME)
    prompts = parity_prompts(base)[:3]
    want = {None: hf_greedy(base, prompts, NEW), **{n: peft_greedy(base, p, prompts) for n, p in adapters.items()}}
    extra = {"NGRAM": {}, "STANDALONE": {"speculative_draft_model_path": base, "speculative_num_steps": 3},
             "EAGLE-tree": {"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 2, "speculative_num_steps": 2,
                            "speculative_draft_model_path": write_head(tmp_path / "head", base, "eagle")}}[algorithm]
    extra = {"speculative_algorithm": algorithm, **extra}
    with running_engine(base, enable_lora=True, lora_paths=[f"{n}={p}" for n, p in adapters.items()], page_size=4,
                        speculative_num_draft_tokens=4, **extra) as llm:
        names = [None, "sql", "chat"] * len(prompts)
        outs = llm.generate(input_ids=[p for p in prompts for _ in range(3)], lora_path=names,
                            sampling_params={"temperature": 0, "max_new_tokens": NEW})
        assert [o["output_ids"] for o in outs] == [want[n][i] for i in range(len(prompts))
                                                   for n in (None, "sql", "chat")]
        assert sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs) > 0  # (verifies ran)
        assert_no_leak(llm)
