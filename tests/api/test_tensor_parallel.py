"""Tensor parallelism on CPU (gloo): an engine spread over 2 or 4 processes gives the single-process engine's tokens,
greedy and seeded, with logprobs within 1e-5, through chunked prefill, the radix cache and grammars; with fewer KV
heads than ranks (replicated); across two "nodes" on loopback; a rank that dies, or hangs past --dist-timeout, fails the
engine cleanly, leaving no process behind."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time

import pytest

from radixmesh.engine import Engine
from radixmesh.engine.distributed import free_local_addr
from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine

OPTS = {"page_size": 16, "chunked_prefill_size": 64, "max_total_tokens": 4096}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "b": {"type": "string", "maxLength": 5}},
          "required": ["a", "b"], "additionalProperties": False}
pytestmark = pytest.mark.timeout(300)


def _greedy(llm, prompts: list[list[int]]) -> list[dict]:
    return llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": 12, "temperature": 0},
                        return_logprob=True, top_logprobs_num=3)


def _run(llm, prompts: list[list[int]]) -> list[dict]:
    """Greedy with logprobs, then seeded sampling and a grammar on the first prompts (their prefixes cached by then)."""
    greedy = _greedy(llm, prompts)
    seeded = llm.generate(input_ids=prompts[:4], sampling_params={"max_new_tokens": 12, "temperature": 0.9,
                                                                  "sampling_seed": 7, "n": 2})
    constrained = llm.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": 40, "temperature": 0,
                                                                       "json_schema": json.dumps(SCHEMA)})
    return greedy + seeded + constrained


def _assert_same(got: list[dict], want: list[dict]) -> None:
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    for g, w in zip(got, want):
        if "output_token_logprobs" not in w["meta_info"]:
            continue
        for (lp, tok, _), (wlp, wtok, _) in zip(g["meta_info"]["output_token_logprobs"],
                                               w["meta_info"]["output_token_logprobs"]):
            assert tok == wtok and abs(lp - wlp) < 1e-5
        for got_top, want_top in zip(g["meta_info"]["output_top_logprobs"], w["meta_info"]["output_top_logprobs"]):
            assert [t for _, t, _ in got_top] == [t for _, t, _ in want_top]
            assert max(abs(a[0] - b[0]) for a, b in zip(got_top, want_top)) < 1e-5


@pytest.mark.parametrize("name, tp", [("tiny-llama", 2), ("tiny-qwen3", 2), ("tiny-qwen2", 4)])
def test_tp_outputs_equal_one_process(name, tp):
    """tiny-qwen2 at TP=4 has 2 KV heads for 4 ranks (each KV head on two ranks), tied embeddings and q/k/v bias."""
    path = model_path(name)
    prompts = parity_prompts(path)
    with running_engine(path, **OPTS) as one:
        want = _run(one, prompts)
    with running_engine(path, tp_size=tp, **OPTS) as many:
        # 4 query heads split; 2 KV heads split at TP=2, each kept by two ranks at TP=4
        assert (many.runner.num_heads, many.runner.num_kv_heads) == (4 // tp, 1)
        got = _run(many, prompts)
        # every prompt again, its prefix now from the radix cache (the long and shared ones in whole pages). Greedy
        # alone: the seeded and grammar requests above already started from the greedy ones' cached prefixes, and
        # each step costs every rank (four processes at TP=4)
        again = _greedy(many, prompts)
    _assert_same(got, want)
    _assert_same(again, want[:len(prompts)])
    for out in got[-2:]:
        json.loads(out["text"])


def test_tp_embeddings_equal_one_process():
    path = model_path("tiny-qwen3-embed")
    prompts = parity_prompts(path)[:5]
    with running_engine(path, is_embedding=True, **OPTS) as one:
        want = [o["embedding"] for o in one.encode(input_ids=prompts)]
    with running_engine(path, is_embedding=True, tp_size=2, **OPTS) as many:
        got = [o["embedding"] for o in many.encode(input_ids=prompts)]
    assert max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w)) < 1e-5


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_tp_host_tier_serves_evicted_prefixes_as_one_process(policy):
    """The hierarchical cache's host tier under TP=2: the leader's device<->host copies are made on every rank's
    shard. A 128-token device pool holds about 2.5 of six 46-token sequences, so each round evicts the others to
    the host; the second round loads them back. Tokens and cached counts equal one process's."""
    path = model_path("tiny-llama")
    prompts = [p[:40] for p in parity_prompts(path, seed=3)[3:9]]
    hicache = dict(page_size=4, max_total_tokens=128, enable_hierarchical_cache=True, hicache_ratio=4,
                   hicache_write_policy=policy)
    runs = []
    for tp in (1, 2):
        with running_engine(path, tp_size=tp, **hicache) as llm:
            rounds = [[llm.generate(input_ids=p, sampling_params={"max_new_tokens": 6, "temperature": 0})
                       for p in prompts] for _ in range(2)]
            assert llm.get_load()["host_hit_tokens"] > 0
        runs.append([[(o["output_ids"], o["meta_info"]["cached_tokens"]) for o in r] for r in rounds])
    assert runs[0] == runs[1]
    assert all(cached == 36 for _, cached in runs[1][1])  # every prompt came back from the host pool


def _l3_run(llm) -> tuple[list[list[int]], list[int]]:
    """The L3 tests' prompts one at a time, greedy: (output ids, cached tokens) of each."""
    from tests.api.test_hicache_engine import _prompts

    outs = [llm.generate(input_ids=p, sampling_params={"max_new_tokens": 6, "temperature": 0})
            for p in _prompts(6, 40, seed=5)]
    return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs]


@functools.cache
def _l3_want() -> list[list[int]]:
    """One process's outputs for the L3 tests' prompts (no hierarchy), computed once for both of them."""
    with running_engine(model_path("tiny-qwen2"), page_size=4, max_total_tokens=1024) as one:
        return _l3_run(one)[0]


@pytest.mark.parametrize("policy, store", [("write_through", "file"), ("write_back", "memory")])
def test_tp_l3_store_keeps_every_ranks_shard(tmp_path, policy, store):
    """An L3 store under TP=2: a stored page holds both ranks' shards (keys of their own, which a TP=1 engine does
    not match). write_through: a new TP=2 engine on the same file store serves the prompts from it; write_back: the
    store takes what leaves the host pool and serves it back. Tokens equal one process's; nothing leaks."""
    from tests.api.test_hicache_engine import NO_SKIP, _flush_and_check_leaks

    path = model_path("tiny-qwen2")
    l3 = dict(page_size=4, max_total_tokens=96, enable_hierarchical_cache=True, hicache_ratio=1,
              hicache_write_policy=policy, hicache_storage_backend=store, hicache_storage_url=str(tmp_path / "l3"),
              hicache_storage_prefetch_policy="wait_complete", hicache_storage_backend_extra_config=NO_SKIP)
    want = _l3_want()
    with running_engine(path, tp_size=2, **l3) as llm:
        layout = llm.cache.hierarchy.host
        assert layout.page_bytes == 2 * layout.data[0].numel() * layout.data.element_size()
        first, _ = _l3_run(llm)
        again, cached = _l3_run(llm)
        assert first == again == want
        if store == "memory":
            assert llm.get_load()["storage_hit_tokens"] > 0 and cached == [36] * 6
        _flush_and_check_leaks(llm)
    if store == "file":
        with running_engine(path, tp_size=2, **l3) as llm:
            got, cached = _l3_run(llm)
            assert got == want and cached == [36] * 6, "every prompt should come back from the store"
            _flush_and_check_leaks(llm)
        with running_engine(path, **l3) as llm:  # one rank's pages are another layout: nothing to find
            got, cached = _l3_run(llm)
            assert got == want and cached == [0] * 6


def _python_m(argv: list[str]):
    """`python -m argv...`, forked from the test process's fork server where there is one (conftest.fork_server: the
    same runpy run without importing torch again, a few CPU-s), else started afresh."""
    from radixmesh.services import forkserver

    server = os.environ.get(forkserver.ENV)
    proc = forkserver.spawn(server, argv, dict(os.environ)) if server else "no fork server"
    return subprocess.Popen([sys.executable, "-m", *argv]) if isinstance(proc, str) else proc


def test_two_nodes_on_loopback():
    """--nnodes 2: node 0 is the engine (rank 0), node 1 a separate `python -m radixmesh.engine.tp_worker` (rank 1)."""
    path = model_path("tiny-llama")
    prompts = parity_prompts(path)[:4]
    with running_engine(path, **OPTS) as one:
        want = one.generate(input_ids=prompts, sampling_params={"max_new_tokens": 10, "temperature": 0})
    addr = free_local_addr()
    common = ["--model-path", path, "--tp", "2", "--nnodes", "2", "--dist-init-addr", addr, "--device", "cpu",
              "--dtype", "float32", "--page-size", "16", "--max-total-tokens", "4096", "--log-level", "warning"]
    node1 = _python_m(["radixmesh.engine.tp_worker", *common, "--node-rank", "1"])
    try:
        with running_engine(path, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr, **OPTS) as llm:
            got = llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": 10, "temperature": 0})
        assert node1.wait(timeout=60) == 0  # the leader's shutdown stopped it
    finally:
        node1.kill()
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]


@pytest.mark.parametrize("kwargs, words", [
    ({"tp_size": 3}, "attention heads must be divisible by tp_size"),
    ({"tp_size": 2, "nnodes": 2}, "needs dist_init_addr"),
    ({"tp_size": 3, "nnodes": 2, "dist_init_addr": "127.0.0.1:1"}, "divisible by nnodes"),
])
def test_bad_tp_settings_are_clear_errors(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Engine(model_path=model_path("tiny-llama"), device="cpu", log_level="warning", **kwargs)



def test_a_hung_rank_fails_the_engine_within_the_dist_timeout():
    """A rank that stops answering (SIGSTOP) fails the next collective after --dist-timeout, not never; shutdown
    then kills it."""
    import signal

    # short (the idle engine of test_tp_disaggregation runs at the same 3 s): the test waits it out once
    llm = Engine(model_path=model_path("tiny-llama"), device="cpu", dtype="float32", log_level="warning", tp_size=2,
                 dist_timeout=3, **OPTS)
    (follower,) = llm._followers.procs
    try:
        os.kill(follower.pid, signal.SIGSTOP)
        start = time.monotonic()
        out = llm.generate("hello", {"max_new_tokens": 8, "temperature": 0})
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert "Timed out" in out["meta_info"]["finish_reason"]["message"]
        assert 2.5 < time.monotonic() - start < 20  # the timeout waited out, and not much more
    finally:
        llm.shutdown()
    follower.join(5)
    assert not follower.is_alive()


def test_a_failed_start_leaves_no_shared_memory_file(tmp_path, monkeypatch):
    """An engine start that fails after the leader made its shared host pool (TP with an L3 store), before the
    followers mapped it, unlinks the file and stops the followers."""
    import glob

    from radixmesh.engine.model_runner import ModelRunner

    def fail(self, host):
        assert os.path.exists(host.path)  # made, not yet unlinked
        raise RuntimeError("the followers could not be told")

    monkeypatch.setattr(ModelRunner, "publish_setup", fail)
    def children() -> set[str]:
        pids = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout.split()
        return {p for p in pids if os.path.exists(f"/proc/{p}") and
                "resource_tracker" not in open(f"/proc/{p}/cmdline").read()}

    before, others = set(glob.glob(f"/dev/shm/radixmesh-host-kv-{os.getpid()}-*")), children()
    with pytest.raises(RuntimeError, match="could not be told"):
        Engine(model_path=model_path("tiny-llama"), device="cpu", dtype="float32", log_level="warning", tp_size=2,
               page_size=4, max_total_tokens=96, enable_hierarchical_cache=True, hicache_ratio=1,
               hicache_storage_backend="file", hicache_storage_url=str(tmp_path / "l3"))
    assert set(glob.glob(f"/dev/shm/radixmesh-host-kv-{os.getpid()}-*")) == before
    assert children() <= others  # the follower is gone


def test_a_failed_rendezvous_leaves_the_process_able_to_start_a_group_and_a_killed_rank_fails_it(monkeypatch):
    """A group start whose followers never come (the rendezvous times out) leaves torch's per-process group counter
    as it found it: a TP engine started afterwards in the same process forms its group and generates, instead of its
    leader and fresh followers waiting for each other's keys until the timeout (a CI failure, 2026-11-29). That
    engine (one start for both claims) then has its follower killed: the engine fails at once, leaving no process."""
    import torch
    import torch.distributed as dist

    from radixmesh.engine import distributed
    from radixmesh.engine.distributed import TensorParallel, TPConfig

    monkeypatch.setattr(distributed, "RENDEZVOUS_MIN_S", 1.0)
    with pytest.raises(dist.DistStoreError):  # rank 0 of 2, alone
        TensorParallel(TPConfig(size=2, rank=0, init_addr=free_local_addr(), timeout_s=1.0), torch.device("cpu"))
    assert not dist.is_initialized() and dist.distributed_c10d._world.group_count == 0
    monkeypatch.setattr(distributed, "RENDEZVOUS_MIN_S", 60.0)
    path = model_path("tiny-llama")
    llm = Engine(model_path=path, device="cpu", dtype="float32", log_level="warning", tp_size=2, dist_timeout=20,
                 **OPTS)
    try:
        (follower,) = llm._followers.procs
        out = llm.generate("hello", {"max_new_tokens": 4, "temperature": 0})
        assert len(out["output_ids"]) == 4 and out["meta_info"]["completion_tokens"] == 4
        start = time.monotonic()
        follower.kill()
        follower.join(5)
        # the leader watches its node's ranks: a dead one fails the engine at once, not after a collective's
        # --dist-timeout (a peer's death can leave a gloo collective waiting for all of it)
        while llm.alive and time.monotonic() - start < 10:
            time.sleep(0.05)
        assert not llm.alive and time.monotonic() - start < 5
        with pytest.raises(RuntimeError, match=r"crashed: .*tensor parallel rank 1 exited \(code -9\)"):
            llm.generate("and again", {"max_new_tokens": 4})
    finally:
        llm.shutdown()
    follower.join(5)
    assert not follower.is_alive()
    children = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout.split()
    assert str(follower.pid) not in children
