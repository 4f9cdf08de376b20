"""Multi-LoRA (issue 54), engine side: adapters written by peft itself (random A and B, so every adapted projection
moves the outputs) served in one batch with the base model, token-exact with transformers + peft in float32; the
prefix cache keeps each adapter's KV apart; adapters load and unload at run time; what cannot be served right is
refused with the reason."""

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
