"""The order in which `make test`'s pytest-xdist processes take the test files: longest first.

`--dist loadfile` hands out whole files, each to the first process with no more than two tests left, in the order of
the collection (`--no-loadscope-reorder`; xdist's own reorder puts the files with the most tests first, which on this
suite leaves the long mesh files of one to three tests for the end, where one process can still have a minute of work
while the other has none left). Longest first (LPT) ends the run on the short unit files instead.

Seconds: one process's time for the file (setups included) in a full `make test` on the 2-vCPU VM, measured on
2026-12-05 (`--durations=0`, summed by file; files of 12 s or more, or far from their folder's weight); only the
order matters, so they need upkeep only when a file grows past the ones above it. A file not listed weighs its
folder's FOLDER_S."""

from __future__ import annotations

FILE_S = {
    # The image's first build (its module fixture, ~80 s on a bare machine) goes first, and the compose tests, which
    # use the same image, well after it: their build then finds every layer cached (tests/deploy/podman.build takes
    # one build at a time, so they would otherwise wait for it)
    "tests/deploy/test_image.py": 250,
    "tests/deploy/test_compose.py": 60,
    "tests/e2e/test_pd.py": 210,
    "tests/e2e/test_chaos.py": 184,
    "tests/parity/test_fp8_weights_kernels.py": 122,
    "tests/api/test_tensor_parallel.py": 89,
    "tests/e2e/test_migration.py": 66,
    "tests/services/test_bench_router_smoke.py": 62,
    "tests/fuzz/test_fuzz_endpoints.py": 58,
    "tests/e2e/test_tp_mesh.py": 55,
    "tests/e2e/test_hicache_mesh.py": 55,
    "tests/kernels/test_attention.py": 54,
    "tests/parity/test_speculative_tree.py": 53,
    "tests/services/test_bench_serving_smoke.py": 52,
    "tests/e2e/test_speculative_mesh.py": 52,
    "tests/e2e/test_mesh_faults.py": 50,
    "tests/parity/test_parity_cpu.py": 49,
    "tests/e2e/test_lora_mesh.py": 48,
    "tests/services/test_router_lora.py": 48,
    "tests/e2e/test_moe_mesh.py": 45,
    "tests/api/test_tp_speculative.py": 43,
    "tests/services/test_router_resilience.py": 41,
    "tests/services/test_worker_registration.py": 41,
    "tests/e2e/test_supervision.py": 39,
    "tests/parity/test_speculative.py": 37,
    "tests/e2e/test_tracing.py": 35,
    "tests/kernels/test_sm90_compile.py": 35,
    "tests/parity/test_attention_backends.py": 34,
    "tests/parity/test_hybrid_swa_memory.py": 33,
    "tests/services/test_generate_stream.py": 33,
    "tests/e2e/test_chat_parsers.py": 33,
    "tests/services/test_bench_router_instructions_smoke.py": 32,
    "tests/services/test_worker_service.py": 30,
    "tests/unit/test_imports.py": 28,
    "tests/kernels/test_elementwise.py": 28,
    "tests/parity/test_sliding_window.py": 28,
    "tests/services/test_soak_smoke.py": 27,
    "tests/e2e/test_prometheus.py": 27,
    "tests/services/test_router_processes.py": 24,
    "tests/kernels/test_tree_attention.py": 23,
    "tests/services/test_router_metrics.py": 23,
    "tests/parity/test_moe_parity.py": 21,
    "tests/api/test_tp_disaggregation.py": 20,
    "tests/unit/test_transfer_backends.py": 20,
    "tests/services/test_router_processes_lora.py": 19,
    "tests/parity/test_fp8_kv.py": 18,
    "tests/api/test_resume.py": 18,
    "tests/kernels/test_attention_kv_scales.py": 18,
    "tests/parity/test_lora.py": 18,
    "tests/services/test_worker_kv_events.py": 18,
    "tests/services/test_worker_metrics.py": 17,
    "tests/parity/test_model_families_more.py": 17,
    "tests/e2e/test_pd_metrics.py": 17,
    "tests/services/test_router_cork.py": 16,
    "tests/e2e/test_internal_auth_mesh.py": 15,
    "tests/deploy/test_helm.py": 15,
    "tests/parity/test_fp8_kv_scales.py": 15,
    "tests/e2e/test_parity_http_grpc.py": 15,
    "tests/services/test_bench_speculative_smoke.py": 15,
    "tests/kernels/test_fp8_quant.py": 15,
    "tests/parity/test_sliding_window_memory.py": 14,
    "tests/parity/test_fp8_moe.py": 14,
    "tests/services/test_kvstore_service.py": 14,
    "tests/services/test_tokenizer_pool.py": 14,
    "tests/parity/test_pd_speculative.py": 14,
    "tests/services/test_tokenizer_without_torch.py": 13,
    "tests/services/test_bench_multiturn_smoke.py": 13,
    "tests/unit/test_speed_flags.py": 12,
    "tests/deploy/test_helm_internal_auth.py": 3,
    "tests/deploy/test_compose_config.py": 3,
    "tests/deploy/test_dockerfiles.py": 2,
    "tests/deploy/test_healthcheck.py": 1,
    "tests/e2e/test_embeddings_mesh.py": 1,
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
