"""--lora-target-modules as SGLang resolves it: the flag's modules (peft names, the fused qkv_proj / gate_up_proj, or
`all` alone), else inferred from the adapters of --lora-paths (the projections their weights adapt), each name
standing for its whole fused module; a run-time adapter that adapts a module outside them is refused with an error
naming the modules, and one inside them (another projection of a targeted fused module) is served as peft serves it."""

from __future__ import annotations

import pytest

from radixmesh.engine.lora.config import resolve_targets
from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine
from tests.parity.test_lora import peft_greedy, write_adapter

NAME = "tiny-llama"
ALL = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    base, root = model_path(NAME), tmp_path_factory.mktemp("targets")
    return {"qd": write_adapter(base, root / "qd", 4, 8, ["q_proj", "down_proj"], False, seed=1),
            "v": write_adapter(base, root / "v", 4, 8, ["v_proj"], False, seed=2),
            "ou": write_adapter(base, root / "ou", 4, 8, ["o_proj", "up_proj"], False, seed=3)}


def test_declared_modules(adapters):
    assert resolve_targets(["all"], []) == ALL
    assert resolve_targets(["q_proj"], []) == ("k_proj", "q_proj", "v_proj")  # q/k/v share the qkv_proj slots
    assert resolve_targets(["qkv_proj", "gate_up_proj"], []) == ("gate_proj", "k_proj", "q_proj", "up_proj",
                                                                  "v_proj")
    assert resolve_targets(["o_proj", "down_proj"], [("qd", adapters["qd"])]) == ("down_proj", "o_proj")
    with pytest.raises(ValueError, match="'all' is given alone"):
        resolve_targets(["all", "q_proj"], [])
    with pytest.raises(ValueError, match=r"\['lm_head'\].*qkv_proj, gate_up_proj \(or all\)"):
        resolve_targets(["q_proj", "lm_head"], [])


def test_inferred_from_the_adapters_given_at_start(adapters):
    assert resolve_targets(None, [("qd", adapters["qd"])]) == ("down_proj", "k_proj", "q_proj", "v_proj")
    assert resolve_targets(None, [("qd", adapters["qd"]), ("ou", adapters["ou"])]) == ALL  # gate via up
    assert resolve_targets(None, []) == ALL  # nothing to infer from: every projection
    with pytest.raises(ValueError, match="no adapter_model.safetensors"):
        resolve_targets(None, [("x", adapters["qd"] + "-missing")])


def test_a_run_time_adapter_outside_the_inferred_modules_is_refused_naming_them(adapters):
    base = model_path(NAME)
    prompt = parity_prompts(base)[1]
    with running_engine(base, enable_lora=True, max_lora_rank=8, lora_paths=[f"qd={adapters['qd']}"]) as llm:
        assert llm.args.lora_target_modules == ("down_proj", "k_proj", "q_proj", "v_proj")
        with pytest.raises(ValueError) as err:
            llm.load_lora_adapter("ou", adapters["ou"])
        message = str(err.value)
        assert "adapts o_proj, up_proj, outside --lora-target-modules" in message
        assert "down_proj, k_proj, q_proj, v_proj only" in message and "or all" in message
        assert llm.lora_adapters() == ["qd"]
        llm.load_lora_adapter("v", adapters["v"])  # v_proj shares qkv_proj with the inferred q_proj
        out = llm.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 16}, lora_path="v")
        assert out["output_ids"] == peft_greedy(base, adapters["v"], [prompt])[0]
