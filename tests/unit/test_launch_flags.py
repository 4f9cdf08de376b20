"""The launcher hands the engine's keyword arguments to its workers as SGLang-named flags: several-valued ones as
one flag followed by each value (they parse back to what was given)."""

from __future__ import annotations

from radixmesh.services.launch import engine_flags


def test_engine_keyword_arguments_become_flags_that_parse_back():
    flags = engine_flags({"enable_lora": True, "disable_cuda_graph": False, "lora_paths": ("sql=/a", "chat=/b"),
                          "cuda_graph_bs": [1, 2, 4], "max_lora_rank": 8, "lora_target_modules": (),
                          "random_seed": None})
    assert flags == ["--enable-lora", "--lora-paths", "sql=/a", "chat=/b", "--cuda-graph-bs", "1", "2", "4",
                     "--max-lora-rank", "8"]
