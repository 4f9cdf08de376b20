"""An Engine gives its GPU memory back when it shuts down, as notebooks, test suites and RL loops need: five engines
one after another in one process, each sizing its KV pool from the free memory (the default 0.88 of the device),
each kept referenced after its shutdown, and the free memory back within 1 GiB of where it started each time."""

from __future__ import annotations

import gc

import pytest
import torch

from radixmesh.engine import Engine
from tests.conftest import model_path

pytestmark = pytest.mark.gpu

GIB = 1 << 30


def _free_bytes() -> int:
    return torch.cuda.mem_get_info()[0]


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "eager"])
def test_five_engines_in_a_row_each_give_the_memory_back(graphs):
    torch.cuda.init()
    gc.collect()
    torch.cuda.empty_cache()
    start = _free_bytes()
    kept = []
    for round_ in range(5):
        llm = Engine(model_path=model_path("tiny-qwen2"), device="cuda", random_seed=0, log_level="warning",
                     disable_cuda_graph=not graphs)
        used = start - _free_bytes()
        assert used > 0.5 * start, f"round {round_}: the engine took {used / GIB:.1f} GiB of {start / GIB:.1f} free"
        out = llm.generate(input_ids=[[5, 6, 7, 8]] * 4, sampling_params={"max_new_tokens": 8, "temperature": 0})
        assert all(len(o["output_ids"]) == 8 for o in out)
        llm.shutdown()
        kept.append(llm)  # still referenced: shutdown alone must free the memory
        lost = start - _free_bytes()
        assert lost < GIB, f"round {round_}: {lost / GIB:.2f} GiB not given back ({_free_bytes() / GIB:.1f} free)"
        with pytest.raises(RuntimeError, match="shut down"):
            llm.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 1})
