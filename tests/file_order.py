"""The order in which `make test`'s pytest-xdist processes take the test files: longest first.

`--dist loadfile` hands out whole files, each to the first process with no more than two tests left, in the order of
the collection (`--no-loadscope-reorder`; xdist's own reorder puts the files with the most tests first, which on this
suite leaves the long mesh files of one to three tests for the end, where one process can still have a minute of work
while the other has none left). Longest first (LPT) ends the run on the short unit files instead.

Seconds: one process's time for the file in a full `make test` on the 2-vCPU CI VM, estimated from the slowest
tests (setups included) of the full runs of 2026-12-04; only the order matters, so they need upkeep only when a file
grows past the ones above it. A file not listed weighs its folder's FOLDER_S."""

from __future__ import annotations

FILE_S = {
    "tests/e2e/test_chaos.py": 135,  # 2026-12-05: 24 streams a fault, not 48
    "tests/e2e/test_pd.py": 155,
    "tests/fuzz/test_fuzz_endpoints.py": 60,  # 2026-12-05: RADIXMESH_FUZZ_SCALE 0.4 by default
    "tests/deploy/test_image.py": 100,
    "tests/parity/test_attention_backends.py": 60,  # 2026-12-05: tests/triton_interpreter.py
    "tests/e2e/test_migration.py": 62,  # 2026-12-05: 60 streams, not 100
    "tests/deploy/test_compose.py": 40,  # 2026-12-05: Prometheus started last
    "tests/services/test_bench_serving_smoke.py": 50,
    "tests/e2e/test_tp_mesh.py": 50,
    "tests/e2e/test_prometheus.py": 40,
    "tests/e2e/test_mesh_faults.py": 40,
    "tests/e2e/test_hicache_mesh.py": 40,
    "tests/kernels/test_sm90_compile.py": 40,
    "tests/api/test_tensor_parallel.py": 40,
    "tests/e2e/test_supervision.py": 35,
    "tests/services/test_soak_smoke.py": 26,  # 2026-12-05: 8 s, not 12
    "tests/e2e/test_chat_parsers.py": 30,
    "tests/services/test_bench_router_smoke.py": 30,
    "tests/api/test_tp_disaggregation.py": 25,
    "tests/e2e/test_tracing.py": 25,
    "tests/e2e/test_openai_client.py": 25,
    "tests/e2e/test_moe_mesh.py": 25,
    "tests/e2e/test_speculative_mesh.py": 25,
    "tests/services/test_bench_router_instructions_smoke.py": 22,
    "tests/e2e/test_lora_mesh.py": 20,
    "tests/e2e/test_internal_auth_mesh.py": 20,
    # added 2026-12-05, estimated from runs on the VM with other work beside them
    "tests/parity/test_fp8_weights_kernels.py": 90,
    "tests/parity/test_speculative_tree.py": 60,
    "tests/parity/test_sliding_window_memory.py": 40,
    "tests/kernels/test_fp8_gemm.py": 35,
    "tests/parity/test_phi4_mini.py": 25,
    "tests/parity/test_model_families_more.py": 45,  # 2026-12-05 (ninth session): estimated from a busy run
    "tests/parity/test_model_families_third.py": 30,
    "tests/parity/test_fp8_moe.py": 25,
    "tests/kernels/test_tree_attention.py": 20,
}
FOLDER_S = {"e2e": 15, "deploy": 15, "fuzz": 15, "services": 8, "api": 8, "gpu": 8, "parity": 6, "kernels": 4,
            "unit": 1}


def weight(path: str) -> float:
    """Expected seconds of the test file at `path` (relative to the repository, "/"-separated)."""
    if path in FILE_S:
        return FILE_S[path]
    parts = path.split("/")
    return FOLDER_S.get(parts[1], 8) if len(parts) > 2 else 8


def longest_first(items: list) -> None:
    """Reorders pytest `items` in place: files by weight, heaviest first; tests within a file, and files of equal
    weight, keep their collected order (module fixtures and tests that rely on an earlier one's state)."""
    rank = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        rank.setdefault(path, (-weight(path), len(rank)))
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])
